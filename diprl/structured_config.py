"""Loading `conf/<group>/<name>.yaml` into a typed dataclass, with clear errors.

Every configurable part (model presets, inference, rewards) reads its YAML the same way: unknown
names list the known ones, and a typo'd key or a wrong type names the file instead of silently
becoming a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

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
