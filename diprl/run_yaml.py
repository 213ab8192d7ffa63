"""A run directory's `config.yaml`, read with limits: whoever can write into a run directory must not be
able to stall or exhaust the process that reads it (the web app's runs page, `train.resume`).

The file is what `python -m diprl.train` wrote: OmegaConf's resolved YAML, a few kilobytes of plain
mappings, lists and scalars a few levels deep, with no anchor, alias or interpolation. Anything else is
refused (`RunYamlError`, naming the file and the reason) before OmegaConf builds a node, by one linear
pass over the YAML's events:

- an anchor or alias: a few hundred bytes of nested aliases (a "billion laughs") expand into
  billions of nodes (a 334-byte file took 127 s);
- an interpolation (`${...}`): nested ones double a string per level when resolved, and resolvers
  reach the environment;
- more than `MAX_BYTES` bytes or containers nested deeper than `MAX_DEPTH`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_BYTES = 1 << 20
MAX_DEPTH = 32


class RunYamlError(ValueError):
    """A run's YAML that is refused: too large, too deep, or with anchors, aliases or interpolations."""


def read_run_yaml_text(path: Path) -> str:
    """The file's text, at most `MAX_BYTES` bytes of it (a longer file is cut there, never read whole)."""
    with path.open("rb") as fh:
        return fh.read(MAX_BYTES + 1).decode("utf-8", errors="replace")


def check_run_yaml(text: str, where: str) -> None:
    """`RunYamlError` unless `text` is plain YAML within the limits (see the module doc); linear in its size."""
    import yaml  # type: ignore[import-untyped]  # PyYAML, through OmegaConf; no stubs installed

    if len(text.encode("utf-8", errors="replace")) > MAX_BYTES:
        raise RunYamlError(f"{where}: larger than {MAX_BYTES} bytes (a run's config is a few kilobytes)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise RunYamlError(
                    f"{where}: holds a YAML anchor or alias, which a run's config never does (nested aliases "
                    "expand exponentially when loaded)"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise RunYamlError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            elif isinstance(event, yaml.ScalarEvent) and "${" in event.value:
                raise RunYamlError(
                    f"{where}: holds an interpolation ({event.value[:60]!r}); a run's config is resolved YAML"
                )
    except yaml.YAMLError as err:
        raise RunYamlError(f"{where}: not YAML ({str(err)[:200]})") from None


def load_run_yaml(text: str, where: str) -> Any:
    """`text` as an OmegaConf `DictConfig` (or `ListConfig`) once `check_run_yaml` accepts it."""
    from omegaconf import OmegaConf

    check_run_yaml(text, where)
    return OmegaConf.create(text)
