"""`LearnerSite`: what a learner shares with its run, whichever form it runs in.

A learner is one process (`Learner`), a rank of a group (`diprl.learn.group`), one adapter on a host
(`diprl.learn.host`) or the Ray actor of any of them (`diprl.learn.actor`); each needs the same three
things from the run, so they travel as one value from the driver down to the process that trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diprl.inference.adapters.pins import PinKey


@dataclass(frozen=True)
class LearnerSite:
    """Where a learner keeps what outlives it and where it publishes its versions.

    `run_dir`: checkpoints, metrics and the batch in flight, under `learner/<policy>/` and
    `checkpoints/<policy>/`. `adapter_root`: the `AdapterStore` it publishes versions to. `pin_key`: the
    run's adapter pin key, installed in every process that publishes or reads versions before it touches
    the store (None: each reads its node's key file; `diprl.inference.adapters.pins`).
    """

    run_dir: str | Path
    adapter_root: str | Path
    pin_key: PinKey | None = None
