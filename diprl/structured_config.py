"""Loading `conf/<group>/<name>.yaml` into a typed dataclass, with clear errors.

Every configurable part (model presets, inference, rewards) reads its YAML the same way: unknown
names list the known ones, and a typo'd key or a wrong type names the file instead of silently
becoming a default.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration (an unknown name, a wrong value, an inconsistent setting): reported, with what
    is wrong, before anything starts."""


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def known_configs(group: str, conf_dir: Path | None = None) -> list[str]:
    directory = (conf_dir or CONF_DIR) / group
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def load_structured(schema: type[T], group: str, name: str, conf_dir: Path | None = None) -> T:
    """`conf/<group>/<name>.yaml` merged over `schema`'s defaults (its Hydra `defaults` list is ignored)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = (conf_dir or CONF_DIR) / group / f"{name}.yaml"
    if not path.is_file() or "/" in name or name.startswith("."):
        known = ", ".join(known_configs(group, conf_dir)) or "none"
        raise KeyError(f"unknown {group} config {name!r} (known: {known})")
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ValueError(f"{path}: expected a mapping of settings")
    raw.pop("defaults", None)
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if not isinstance(config, schema):
        raise ValueError(f"{path}: did not produce a {schema.__name__}")
    return config


def explain_override_error(exc: BaseException) -> str:
    """A Hydra or OmegaConf error in one line: its first line and its cause's ("Could not override 'gmes'":
    Key 'gmes' not in ...), with the grammar's hint when an option has no `=`."""
    parts = []
    for e in (exc, exc.__cause__):
        text = str(e).strip() if e is not None else ""
        if text and not text.startswith("To append"):
            parts.append(text.splitlines()[0].rstrip("."))
    if "missing EQUAL" in str(exc):
        parts.append("options are key=value")
    return ": ".join(dict.fromkeys(parts)) or repr(exc)


def compose_structured(
    schema: type[T], schema_name: str, group: str, overrides: Sequence[str], conf_dir: Path | None = None
) -> T:
    """`conf/<group>/default.yaml` (whose `defaults` list names `schema_name`) with `overrides` applied.

    Through Hydra's compose API rather than `@hydra.main`: a command gets Hydra's override grammar and the
    schema's checks (a typo'd key or a wrong type fails before anything starts) but no working-directory
    change, output folders or logging takeover. Every problem, the schema's own `ValueError`s included, is
    a one-line `ConfigError` naming it, so a command reports all of them the same way.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name=schema_name, node=schema)
    directory = (conf_dir or CONF_DIR) / group
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
            cfg = compose(config_name="default", overrides=list(overrides))
        config = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(explain_override_error(exc)) from exc
    if not isinstance(config, schema):
        raise ConfigError(f"{directory}/default.yaml did not produce a {schema.__name__}")
    return config


def too_small(config: object, names: Sequence[str], low: float, rule: str = "") -> list[str]:
    """`<name> must be <rule>, got <value>` for each field of `config` in `names` not >= `low` (NaN is not);
    `rule` is `>= <low>` unless given ("positive"). The range check every config's `__post_init__` repeats."""
    values = [(name, getattr(config, name)) for name in names]
    return [f"{name} must be {rule or f'>= {low}'}, got {value}" for name, value in values if not value >= low]


def dotted_options(
    config: DataclassInstance, names: Sequence[str] | None = None, prefix: str = ""
) -> list[tuple[str, Any]]:
    """(key, value) for the fields `names` of the dataclass `config` (all of them, in order, if None); a field that
    is itself a dataclass is listed field by field, dotted (`data.games`), as its options are given on the command
    line."""
    items: list[tuple[str, Any]] = []
    for name in names if names is not None else [f.name for f in fields(config)]:
        value = getattr(config, name)
        if is_dataclass(value) and not isinstance(value, type):
            items += dotted_options(value, prefix=f"{prefix}{name}.")
        else:
            items.append((f"{prefix}{name}", value))
    return items


def option_lines(defaults: DataclassInstance, names: Sequence[str] | None = None) -> list[str]:
    """`  key=default` for the fields `names` of the dataclass `defaults` (`dotted_options`), for `--help`."""
    return [f"  {key}={value}" for key, value in dotted_options(defaults, names)]


def overrides(config: DataclassInstance) -> list[str]:
    """`config`'s fields as Hydra command-line overrides (`search.candidates=8`, None as `null`)."""
    return [f"{key}={'null' if value is None else value}" for key, value in dotted_options(config)]


@dataclass(frozen=True)
class Command(Generic[T]):
    """A `key=value` command: its name, its usage text, how its options load into a config, and what
    `--help` lists (`options`; None: every field of `load([])`, the YAML's defaults). One place, so that
    every command answers help and mistakes alike."""

    prog: str
    usage: str | None
    load: Callable[[list[str]], T]
    options: Callable[[], list[str]] | None = None

    def read(self, argv: Sequence[str] | None) -> T | int:
        """What the command is to run, or its exit status when it runs nothing.

        `-h`, `--help` or `help` prints the usage and the options and gives 0; a bad option (`load` raises a
        `ValueError`, a `ConfigError` among them, or an `OSError`, such as an unwritable output path) is one
        line on stderr and gives 2. `argv` None reads `sys.argv`.
        """
        args = list(sys.argv[1:] if argv is None else argv)
        if any(a in ("-h", "--help", "help") for a in args):
            print(self.usage)
            print("options (key=default):")
            print("\n".join(self.options() if self.options is not None else self._default_options()))
            return 0
        try:
            return self.load(args)
        except (ValueError, OSError) as exc:
            print(f"{self.prog}: error: {exc}", file=sys.stderr)
            return 2

    def run(self, argv: Sequence[str] | None, report: Callable[[T], list[str]]) -> int:
        """The command end to end: its options read as `read` reads them, library logs quieted unless the
        config says `verbose`, then `report(config)` run and its lines printed. 0 after a run."""
        from diprl.console import quiet_libraries

        config = self.read(argv)
        if isinstance(config, int):
            return config
        quiet_libraries(bool(getattr(config, "verbose", False)))
        print("\n".join(report(config)))
        return 0

    def _default_options(self) -> list[str]:
        defaults = self.load([])
        if not is_dataclass(defaults) or isinstance(defaults, type):
            raise TypeError(f"{self.prog}: its config is not a dataclass; give the command its options")
        return option_lines(defaults)
