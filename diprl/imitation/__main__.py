"""Imitation warm start: clone a rule bot's orders into a LoRA adapter and publish it as a version.

    python -m diprl.imitation [data.games=400 data.opponents=[random] learner.model=small epochs=1 ...]

Plays (or reads from the cache) teacher games, trains the policy's LoRA by behaviour cloning through
the learner, publishes `<policy>@v<N>` to `adapter_root` and prints per-unit order agreement with the
teacher on held-out states before and after. Options are `key=value` (Hydra's override syntax) over
`conf/imitation/default.yaml`; an unknown key, a bad value or an unknown bot is an error (exit status 2).
The last line is `agreement_before=<x> agreement_after=<y> version=<policy>@v<N>`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diprl.imitation.config import ImitateConfig

PROG = "python -m diprl.imitation"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 after the run or `--help`, 2 after a bad option (said on stderr)."""
    from diprl.imitation.config import load_imitate_config
    from diprl.structured_config import Command

    return Command(PROG, __doc__, load_imitate_config).run(argv, _run)


def _run(config: ImitateConfig) -> list[str]:
    from diprl.imitation.run import run, summary_lines

    return summary_lines(run(config))


if __name__ == "__main__":
    sys.exit(main())
