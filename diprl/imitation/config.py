"""The typed configuration of `python -m diprl.imitation` (`conf/imitation/default.yaml` over this schema).

One config nests the two it drives, so nothing is copied field by field: `data` is the teacher data
(`TeacherConfig`), `learner` the learner that trains and publishes (`LearnerConfig`, the same
schema as `conf/learner`). Read through Hydra's compose API, like `python -m diprl.evaluate`: the
override grammar and the schema's checks (a typo'd key or a wrong type fails before anything
starts), without Hydra's working-directory change or logging takeover.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diprl.imitation.data import TeacherConfig
from diprl.learn.config import LearnerConfig
from diprl.structured_config import ConfigError, compose_structured, too_small

SCHEMA_NAME = "imitate_schema"


@dataclass
class ImitateConfig:
    """Everything `python -m diprl.imitation` accepts as `key=value` (nested: `data.games=400`, `learner.lr=3e-3`)."""

    data: TeacherConfig = field(default_factory=TeacherConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    steps: int = 200  # optimiser steps (unless `epochs` is set)
    epochs: float = 0.0  # > 0: train until this many passes over the training decisions, instead of `steps`
    batch_size: int = 64  # decisions per optimiser step, whole game states (a state is never split)
    max_minutes: float = 0.0  # > 0: stop training after this many minutes (then publish and score)
    # The lr falls linearly to 0 over the steps the run will take (`train.planned_batches`; unless
    # `learner.lr_decay_steps` names another length): one epoch over 52,000 DumbBot decisions ended at
    # loss 0.40 with a constant lr and still falling, the last steps' noise left in the published adapter.
    lr_decay: bool = True
    out: str = "runs/imitate"  # run directory: the learner's metrics, the report
    adapter_root: str = "runs/adapters"  # the AdapterStore the PolicyServer serves from
    eval_batch_size: int = 32  # held-out states decoded at once for agreement
    # torch threads. 1 by default: on a shared 2-core machine two OpenMP threads spin-wait on each
    # other and a step ran 10x slower than with one (measured); 0 leaves torch's default.
    threads: int = 1
    quiet: bool = False  # no progress bars (they show only when stderr is a terminal anyway)
    verbose: bool = False  # library logs (DeepSpeed, transformers, torch) at INFO instead of WARNING

    def __post_init__(self) -> None:
        problems = too_small(self, ("steps", "batch_size", "eval_batch_size"), 1, "positive")
        problems += too_small(self, ("epochs", "max_minutes", "threads"), 0)
        if problems:
            raise ConfigError("imitation config: " + "; ".join(problems))


def load_imitate_config(overrides: Sequence[str], conf_dir: Path | None = None) -> ImitateConfig:
    """`conf/imitation/default.yaml` with `overrides` (Hydra syntax) applied, checked.

    Every problem (unknown key, wrong type, a value out of range, an unknown bot) is a `ConfigError`
    naming it.
    """
    return compose_structured(ImitateConfig, SCHEMA_NAME, "imitation", overrides, conf_dir)
