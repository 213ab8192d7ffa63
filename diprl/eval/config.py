"""The typed configuration of `python -m diprl.evaluate` (Hydra structured config, group-free).

Read through Hydra's compose API rather than `@hydra.main`: the command gets Hydra's override
grammar and the schema's checks (a typo'd key or a wrong type fails before anything starts) but
no working-directory change, output folders or logging takeover; `out=` decides where files go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diprl.game import DEFAULT_MAX_YEAR
from diprl.structured_config import CONF_DIR

SCHEMA_NAME = "evaluate_schema"


@dataclass
class EvaluateConfig:
    """`python -m diprl.evaluate` options; every one is `key=value` on the command line."""

    policy: str = ""  # the hero PolicyRef: bot:<name>, base, or <policy>@v<N> (required)
    opponents: Any = "bot:dumbbot"  # one PolicyRef or a list [a,b]: the six other seats, round-robin
    games: int = 140  # multiple of 7 for an even power rotation
    max_year: int = DEFAULT_MAX_YEAR
    seed: int = 0
    temperature: float = 1.0  # LLM seats only; 0: greedy
    max_tokens: int = 384  # LLM seats only
    sampling_seed: int | None = 0  # LLM seats' sample stream (same games, other samples); null: the engine's
    replays: int = 0  # write replay JSON, SVG frames and an HTML viewer for the first N games
    critical_supports: bool = True  # re-adjudicate hero supports to find critical ones
    workers: int = 1  # processes for bots-only suites
    crossplay: list[str] = field(default_factory=list)  # [refA,refB,...]: each as hero vs 6 of each other
    crossplay_games: int = 0  # games per ordered pair; 0: `games`
    out: str = "runs/eval/latest"
    adapters: str = "runs/adapters"  # the AdapterStore holding <policy>@v<N> (standalone runs)
    server: str = "local"  # conf/inference/<name>.yaml: the PolicyServer started for LLM seats
    ray_cpus: int = 0  # CPUs for the local Ray started for LLM seats; 0: Ray's default
    progress: bool = True  # progress bar on stderr, drawn when stderr is a terminal
    verbose: bool = False  # library logs (Ray, vLLM) at INFO instead of WARNING


def option_help() -> list[str]:
    """`key=default` for every option, for `--help` (the meanings are in this module's schema)."""
    defaults = EvaluateConfig()
    return [f"  {f.name}={getattr(defaults, f.name)}" for f in fields(EvaluateConfig)]


def _explain(exc: BaseException) -> str:
    """Hydra's message and its cause's, first lines only ("Could not override 'gmes'": Key 'gmes' not in ...)."""
    parts = []
    for e in (exc, exc.__cause__):
        text = str(e).strip() if e is not None else ""
        if text and not text.startswith("To append"):
            parts.append(text.splitlines()[0].rstrip("."))
    if len(parts) == 1 and "missing EQUAL" in str(exc):
        parts.append("options are key=value")
    return ": ".join(parts) or repr(exc)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=EvaluateConfig)


def load_evaluate_config(overrides: Sequence[str], conf_dir: Path | None = None) -> EvaluateConfig:
    """`conf/evaluate/default.yaml` with `overrides` (Hydra syntax) applied, as an `EvaluateConfig`.

    Errors (unknown key, wrong type, bad override syntax) come back as `ValueError` with Hydra's
    message, which names the key.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register()
    directory = (conf_dir or CONF_DIR) / "evaluate"
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
            cfg = compose(config_name="default", overrides=list(overrides))
        config = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ValueError(_explain(exc)) from exc
    if not isinstance(config, EvaluateConfig):
        raise ValueError(f"{directory}/default.yaml did not produce an EvaluateConfig")
    if isinstance(config.opponents, list | tuple):
        config.opponents = [str(o) for o in config.opponents]
    elif not isinstance(config.opponents, str):
        raise ValueError(f"opponents must be a PolicyRef or a list of them, got {config.opponents!r}")
    return config
