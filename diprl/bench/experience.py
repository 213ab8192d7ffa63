"""How much experience per minute: the training loop before and after the experience work, side by side.

    python -m diprl.bench experience [--minutes 5] [--only random|selfplay] [--also-model small]

Runs the real training loop (`python -m diprl.train`, local Ray, PolicyServer, learner) for the same
minutes in each setting, one after the other, with evaluations off so the minutes go to training:

- `+experiment=random` in the OLD setting (what the CPU presets were before: Qwen's 151,936-id
  vocabulary (`model=tiny_qwen`), one match per rollout worker, the learner forwarding every record's
  whole prompt, the hero's seat alone trained) and in the NEW default (the compact vocabulary, many
  matches in flight, shared prefixes forwarded once, every seat a learner plays trained);
- the same for `+experiment=selfplay`, where every seat is the current main: the old setting trains
  one of the seven decisions each fork pays for, the new one all seven.

For each it prints hero decisions generated per second, records trained per second, the learner's
busy fraction (its step time over the run's time) and the mean batch the PolicyServer's engine held
while busy. Last line:
`experience_old=<records/s> experience_new=<records/s> experience_speedup=<new/old>
[experience_speedup_<model>=<new/old> ...] experience_selfplay_speedup=<new/old>`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diprl.console import add_console_flags, quiet_libraries

COMMON = [
    "train.max_steps=100000",
    "train.wandb=false",
    "train.dashboard=false",
    "train.web_port=null",
    "train.progress_every_s=30",
    "evaluation.at_start=false",
    "evaluation.at_end=false",
    "evaluation.every_steps=0",
]
# Today's setting before the experience work: also its 4 groups a step (both experiments had 4; `random`
# now takes 16, which at the old setting's supply would leave a quarter of a 4-minute run untrained).
OLD = [
    "model=tiny_qwen",
    "rollout.matches_in_flight=1",
    "learner.prefix_sharing=false",
    "league.train_seats=hero",
    "learner.groups_per_step=4",
]


@dataclass(frozen=True)
class Setting:
    label: str  # '<experiment> old|new', or 'random new:<model>'
    experiment: str
    overrides: tuple[str, ...]


def settings(only: str | None, also: Sequence[str] = ()) -> list[Setting]:
    """Old and new setting of each experiment (`only`: one of them); `also`: the new setting again with
    each of these model presets, for `random` (to choose the default body by measurement)."""
    out = []
    for experiment in ("random", "selfplay"):
        if only in (None, experiment):
            out.append(Setting(f"{experiment} old", experiment, tuple(OLD)))
            out.append(Setting(f"{experiment} new", experiment, ()))
            if experiment == "random":
                out += [Setting(f"random new:{m}", experiment, (f"model={m}",)) for m in also]
    return out


def speedups(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The last line's fields: trained records per second, new over old, per experiment and extra model."""

    def rate(label: str) -> float:
        return float(results[label]["records_trained_per_s"])

    fields: dict[str, float] = {}
    if "random old" in results:
        old, new = rate("random old"), rate("random new")
        fields |= {"experience_old": old, "experience_new": new, "experience_speedup": new / max(old, 1e-9)}
        for label in results:
            if label.startswith("random new:"):
                fields[f"experience_speedup_{label.split(':', 1)[1]}"] = rate(label) / max(old, 1e-9)
    if "selfplay old" in results:
        fields["experience_selfplay_speedup"] = rate("selfplay new") / max(rate("selfplay old"), 1e-9)
    return fields


def measure(setting: Setting, minutes: float, root: Path) -> dict[str, Any]:
    """One training run of `minutes`; its rates from the run's own records."""
    from diprl.run.config import compose_config
    from diprl.run.rundir import load_counters
    from diprl.tracking import read_metrics
    from diprl.train import run

    run_dir = root / setting.label.replace(" ", "-")
    args = [f"+experiment={setting.experiment}", f"train.run_dir={run_dir}", f"train.max_minutes={minutes}"]
    config, resolved = compose_config([*args, *COMMON, *setting.overrides])
    run(config, resolved)
    counters = load_counters(run_dir)
    seconds = counters.minutes * 60
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if r.get("kind") == "learner" and r.get("trained")]
    serving = [r for r in records if r.get("kind") == "serving"]
    return {
        "setting": setting.label,
        "model": config.model.name,
        "seconds": seconds,
        "learner_steps": len(steps),
        "groups": counters.groups,
        "hero_decisions_per_s": counters.hero_completions / seconds,
        "decisions_per_s": counters.completions / seconds,
        "records_trained_per_s": sum(int(r.get("records", 0)) for r in steps) / seconds,
        "learner_busy": sum(float(r.get("time_step_s", 0.0)) for r in steps) / seconds,
        "engine_mean_batch": serving[-1]["serving/mean_batch"] if serving else None,
        "run_dir": str(run_dir),
    }


def row(m: dict[str, Any]) -> str:
    batch = m["engine_mean_batch"]
    return (
        f"{m['setting']:<16}{m['model']:>10}{m['hero_decisions_per_s']:>12.2f}{m['records_trained_per_s']:>12.2f}"
        f"{m['learner_busy']:>9.0%}{(f'{batch:.1f}' if batch is not None else '-'):>8}{m['learner_steps']:>8}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench experience", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="training minutes per setting")
    parser.add_argument("--only", choices=["random", "selfplay"], help="one experiment's pair only")
    parser.add_argument(
        "--also-model",
        action="append",
        default=[],
        help="also run random's NEW setting on this model preset (repeatable): choosing the default body",
    )
    parser.add_argument("--out", help="keep the run directories here (default: a temporary directory)")
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="diprl-bench-experience-"))
    results = {}
    for setting in settings(args.only, args.also_model):
        results[setting.label] = measure(setting, args.minutes, root)
    print(f"\n{'setting':<16}{'model':>10}{'hero dec/s':>12}{'records/s':>12}{'learner':>9}{'batch':>8}{'steps':>8}")
    for m in results.values():
        print(row(m))
    (root / "experience.json").write_text(json.dumps(results, indent=1))
    print(" ".join(f"{k}={v:.2f}" for k, v in speedups(results).items()))
    return 0
