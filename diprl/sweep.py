"""Sweeps: `python -m diprl.train -m <overrides>` and `python -m diprl.sweep <sweep_dir>`.

`-m` (`--multirun`) takes Hydra's sweep syntax (`learner.lr=1e-3,1e-2`, `range(1,4)`, `choice(a,b)`) and runs
every point of the cartesian product, in order, as a `python -m diprl.train` of its own: its own process and
Ray (or the cluster `RAY_ADDRESS` names, when the sweep is itself a Ray job), its own run directory
`<sweep_dir>/<index>`, so a failed point is a row of the summary and never stops the others. `sweep.json` in
the sweep directory lists the points, their overrides, run directories and exit codes, and is rewritten
(atomically) as each point ends. The sweep directory is `train.run_dir` when given, else
`runs/sweeps/<experiment>-<UTC time>`.

`python -m diprl.sweep <sweep_dir>` prints a table of each point's final figures: the varied overrides, the
main learner's last step and loss, the rollouts' last hero centres, the last evaluation against each
opponent (mean centres and its 95% interval), and the exit code.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_json_atomic
from diprl.tracking import read_metrics

MULTIRUN_FLAGS = ("-m", "--multirun")


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """Every point of a sweep: the cartesian product of the sweep overrides, other overrides kept as written."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: list[list[str]] = []
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    for written, override in zip(overrides, parsed, strict=True):
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices.append([written])
            continue
        if key.lstrip("+~") == "train.run_dir":
            raise ValueError("train.run_dir cannot be swept: the sweep gives each point <train.run_dir>/<index>")
        choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
    return [list(point) for point in itertools.product(*choices)]


def _sweep_dir(overrides: Sequence[str]) -> tuple[Path, list[str]]:
    """The sweep's directory and the overrides without `train.run_dir` (each point gets its own)."""
    rest, chosen = [], None
    for override in overrides:
        if override.lstrip("+").startswith("train.run_dir="):
            chosen = override.split("=", 1)[1]
        else:
            rest.append(override)
    if chosen is None:
        experiment = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), "")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        chosen = f"runs/sweeps/{experiment or 'default'}-{stamp}"
    return Path(chosen), rest


def run_sweep(args: Sequence[str]) -> int:
    """Run every point (see the module doc); 0 when all of them succeeded, else the first failure's code."""
    overrides = [a for a in args if a not in MULTIRUN_FLAGS]
    sweep_dir, overrides = _sweep_dir(overrides)
    try:
        points = expand(overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        print(f"error: the sweep directory {sweep_dir} is not empty", file=sys.stderr)
        return 2
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "points": [
            {"index": i, "overrides": point, "run_dir": str(sweep_dir / str(i)), "exit_code": None}
            for i, point in enumerate(points)
        ]
    }
    write_json_atomic(sweep_dir / "sweep.json", record, indent=1)
    print(f"sweep of {len(points)} points: {sweep_dir}", flush=True)
    for entry in record["points"]:
        print(f"point {entry['index']}: {' '.join(entry['overrides'])}", flush=True)
        command = [sys.executable, "-m", "diprl.train", *entry["overrides"], f"train.run_dir={entry['run_dir']}"]
        entry["exit_code"] = subprocess.run(command).returncode
        write_json_atomic(sweep_dir / "sweep.json", record, indent=1)
    print("\n".join(table(summarize(sweep_dir))))
    failed = [p["exit_code"] for p in record["points"] if p["exit_code"] != 0]
    print(f"sweep_dir={sweep_dir} points={len(points)} failed={len(failed)}", flush=True)
    return int(failed[0]) if failed else 0


def _varied(points: list[list[str]]) -> list[set[str]]:
    """Each point's overrides that not every point shares (what tells the rows apart)."""
    shared = set.intersection(*(set(p) for p in points)) if points else set()
    return [set(p) - shared for p in points]


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per point of `sweep_dir/sweep.json`: its varied overrides and final figures (None: not there)."""
    points = json.loads((Path(sweep_dir) / "sweep.json").read_text())["points"]
    varied = _varied([p["overrides"] for p in points])
    rows = []
    for entry, differs in zip(points, varied, strict=True):
        records = read_metrics(Path(entry["run_dir"]) / "metrics.jsonl")
        learner = [r for r in records if r.get("kind") == "learner" and r.get("policy", "main") == "main"]
        rollout = [r for r in records if r.get("kind") == "rollout" and "rollout/hero_centres" in r]
        row: dict[str, Any] = {
            "point": " ".join(o for o in entry["overrides"] if o in differs) or "(all alike)",
            "steps": learner[-1].get("step") if learner else None,
            "loss": learner[-1].get("loss") if learner else None,
            "hero_centres": rollout[-1]["rollout/hero_centres"] if rollout else None,
        }
        for r in records:
            if r.get("kind") == "eval" and "eval/hero_mean_sc" in r:
                row[f"eval {r.get('opponents', '?')}"] = (
                    f"{r['eval/hero_mean_sc']:.2f} [{r['eval/hero_mean_sc_lo']:.2f}, {r['eval/hero_mean_sc_hi']:.2f}]"
                )
        row["exit"] = entry.get("exit_code")
        row["run_dir"] = entry["run_dir"]
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of `summarize`'s rows, columns in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    columns = [c for c in columns if c not in ("exit", "run_dir")] + ["exit", "run_dir"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    sweep_dir = Path(args[0])
    if not (sweep_dir / "sweep.json").is_file():
        print(f"error: {sweep_dir} holds no sweep.json (made by `python -m diprl.train -m ...`)", file=sys.stderr)
        return 2
    print("\n".join(table(summarize(sweep_dir))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
