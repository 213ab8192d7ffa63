"""`python -m diprl.bench <name> [options]`: dispatch to the benchmark module registered under `name`.

Modules are imported only when chosen, so a benchmark that needs heavy dependencies (torch, vllm, ray) costs
nothing to the others. To add one, write `diprl/bench/<module>.py` with `main(argv: list[str] | None) -> int`
and register it in `BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module (relative to this package) exposing `main(argv: list[str] | None) -> int`.
BENCHMARKS: dict[str, str] = {
    "engine": "diprl.bench.engine",
    "constraint": "diprl.bench.constraint",
    "inference": "diprl.bench.inference",
    "rollout": "diprl.bench.rollout",
    "learner": "diprl.bench.learner",
    "league": "diprl.bench.league",
    "learning": "diprl.bench.learning",
    "faults": "diprl.bench.faults",
    "experience": "diprl.bench.experience",
    "strength": "diprl.bench.strength",
    "search-cost": "diprl.bench.search_cost",
    "canary": "diprl.bench.canary",
    "league-value": "diprl.bench.league_value",
    "preload": "diprl.bench.preload",
    "cpu-lora": "diprl.bench.cpu_lora",
    "fork-points": "diprl.bench.fork_points",
}


def main(argv: list[str] | None = None) -> int:
    """Take the benchmark name from the first argument and hand everything after it to that benchmark.

    The split is done by hand rather than with `argparse.REMAINDER` so that options such as `--help` after the
    name reach the benchmark's own parser instead of this one.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m diprl.bench",
        description="Run one benchmark; `python -m diprl.bench <name> --help` lists its options.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark to run")
    if not args or args[0] not in BENCHMARKS:
        parser.parse_args(args[:1])  # prints usage or help and exits
        return 2
    module = importlib.import_module(BENCHMARKS[args[0]])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
