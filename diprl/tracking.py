"""Where a training run reports: metrics JSONL, W&B (offline unless a key is set), Ray metrics, a progress
line, and learning-curve plots in the run directory.

One `Tracker` per run, owned by the training driver. Every record goes to the JSONL file first (the
source of truth a plot or a resumed run reads back), then to W&B and the Ray dashboard's metrics.
Nothing here knows about games or models: it moves dictionaries of numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from diprl.messages import MATCH_STAGES

# Metrics exported to the Ray dashboard (Prometheus names); every value is tagged with the policy, a rollout
# stage's with its stage, and an evaluation's also with its opponents (one evaluation logs a line per
# opponent: untagged, Random's and DumbBot's results overwrote each other in one series).
TAGGED_BY_OPPONENTS = frozenset({"eval/hero_mean_sc", "eval/hero_solo_rate"})
RAY_GAUGES = {
    "learner/step": ("diprl_learner_step", "learner steps taken"),
    "policy_lag_mean": ("diprl_policy_lag", "mean versions between the sampling policy and the learner"),
    "tokens_per_s": ("diprl_learner_tokens_per_s", "completion tokens trained per second"),
    "rollout/mean_reward": ("diprl_mean_reward", "mean hero return of recent groups"),
    "rollout/hero_centres": ("diprl_hero_centres", "mean hero supply centres at the fork horizon"),
    "rollout/groups_per_s": ("diprl_groups_per_s", "trajectory groups delivered per second"),
    "rollout/bad_completion_rate": ("diprl_bad_completion_rate", "share of recent LLM completions malformed"),
    "rollout/zero_variance_rate": ("diprl_zero_variance_rate", "share of recent trained seats whose forks all tied"),
    "rollout/level_outcome_rate": ("diprl_level_outcome_rate", "share of recent matches the hero ended level"),
    "queue/depth": ("diprl_queue_depth", "groups waiting for the learner"),
    "eval/hero_mean_sc": ("diprl_eval_hero_mean_sc", "evaluation: hero mean centres"),
    "eval/hero_solo_rate": ("diprl_eval_hero_solo_rate", "evaluation: hero solo rate"),
    "league/rating": ("diprl_league_rating", "openskill mu - 3 sigma of the current version"),
    # League health (diprl/league/health.py), from the `league` records the driver writes every few main steps.
    "league/exploitability_lb": (
        "diprl_league_exploitability_lb",
        "lower bound on the exploitability of main's newest frozen version (exploiter's Wilson low - 1/2)",
    ),
    "league/exploitability_lb_max": (
        "diprl_league_exploitability_lb_max",
        "largest exploitability lower bound over main's frozen versions",
    ),
    "league/nash_entropy": ("diprl_league_nash_entropy", "entropy (nats) of the Nash over the measured members"),
    "league/nash_support": ("diprl_league_nash_support", "members with Nash weight above 1e-6"),
    "league/nash_main": ("diprl_league_nash_main", "main's Nash weight (no value while main is left out)"),
    "league/nash_left_out_count": ("diprl_league_nash_left_out", "members left out of the Nash (an unplayed pair)"),
    "league/rpp": ("diprl_league_rpp", "relative population performance: learners and newest snapshots vs the rest"),
    "league/best_version_number": ("diprl_league_best_version", "N of main's best version main@vN by evaluation"),
    "league/best_score": ("diprl_league_best_score", "evaluation score (mean centres) of main's best version"),
    "league/rollbacks": ("diprl_league_rollbacks", "rollbacks of main to its best version decided so far"),
    "league/rollbacks_done": ("diprl_league_rollbacks_done", "rollbacks of main the learner carried out"),
}
# A rollout's seconds per match, one series per stage of one gauge (`rollout/<stage>_s`, see MATCH_STAGES).
STAGE_GAUGE = "diprl_rollout_stage_seconds"
STAGE_KEYS = {f"rollout/{stage}_s": stage for stage in MATCH_STAGES}


def gauge_tags(key: str, policy: str, opponents: str) -> dict[str, str]:
    """The tags of metric `key`'s value: its policy, and its opponents or its stage where it has one."""
    if key in TAGGED_BY_OPPONENTS:
        return {"policy": policy, "opponents": opponents}
    if key in STAGE_KEYS:
        return {"policy": policy, "stage": STAGE_KEYS[key]}
    return {"policy": policy}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Tracker:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], use_wandb: bool = True, project: str = "diprl"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file: TextIO = self.path.open("a")
        self._wandb: Any = None
        if use_wandb:
            self._wandb = _start_wandb(self.run_dir, config, project)
        self._gauges: dict[str, Any] = {}
        try:
            from ray.util import metrics

            for key, (name, description) in RAY_GAUGES.items():
                tags = tuple(gauge_tags(key, "", ""))
                self._gauges[key] = metrics.Gauge(name, description=description, tag_keys=tags)
            stages = metrics.Gauge(STAGE_GAUGE, description="rollout seconds per match", tag_keys=("policy", "stage"))
            self._gauges |= dict.fromkeys(STAGE_KEYS, stages)
        except Exception:  # no Ray worker context (unit tests): the JSONL file is enough
            self._gauges = {}

    def log(self, kind: str, values: Mapping[str, Any], policy: str = "main") -> None:
        """Append one record (`kind`: learner, rollout, eval, league, progress) everywhere it goes."""
        record = {"time": time.time(), "kind": kind, "policy": policy, **values}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in values.items() if _finite(v)}
        opponents = str(values.get("opponents", ""))
        series = f"[{opponents}]" if opponents else ""  # W&B: one series per opponent set, as the gauges
        if self._wandb is not None and numbers:
            self._wandb.log({f"{policy}/{k}{series}": v for k, v in numbers.items()})
        for key, value in numbers.items():
            gauge = self._gauges.get(key)
            if gauge is not None:
                gauge.set(float(value), tags=gauge_tags(key, policy, opponents))

    def move_records(self, drop: Callable[[dict[str, Any]], bool], moved_to: Path) -> int:
        """Move the records `drop` selects out of the metrics file (to `moved_to`); their number.

        A learner that restored an older checkpoint takes the lost steps again: their first records
        leave the file so it holds every step once (see `diprl.atomic_io.move_jsonl_records`).
        """
        from diprl.atomic_io import move_jsonl_records

        self._file.close()
        try:
            return move_jsonl_records(self.path, moved_to, drop)
        finally:
            self._file = self.path.open("a")

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


WANDB_ID_FILE = "wandb_run_id"
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id: made once (the directory's name plus a random suffix) and kept in the run directory,
    so a resume continues its own W&B run and two runs whose directories share a name never share one."""
    path = run_dir / WANDB_ID_FILE
    try:
        saved = path.read_text().strip()
    except OSError:
        saved = ""
    if _WANDB_ID.fullmatch(saved):
        return saved
    from diprl.atomic_io import write_file_atomic

    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", run_dir.resolve().name).strip("-")[:48] or "run"
    made = f"{slug}-{secrets.token_hex(6)}"
    write_file_atomic(path, f"{made}\n".encode())
    return made


def _start_wandb(run_dir: Path, config: Mapping[str, Any], project: str) -> Any:
    """W&B online only when a key is configured; offline (files in the run directory) otherwise."""
    try:
        import wandb
    except ImportError:
        return None
    online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
    return wandb.init(
        project=project,
        dir=str(run_dir),
        name=run_dir.name,
        config=dict(config),
        mode="online" if online else "offline",
        resume="allow",
        id=wandb_run_id(run_dir),
        settings=wandb.Settings(silent=True, console="off"),
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file, skipping a torn last line (a killed run)."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressLine:
    """One status line: rewritten in place on a terminal (at most once a second); otherwise (a log file, a
    pipe) one line per learner step, at most one every `every_s` seconds, and a forced line whenever its
    text is new. A log then holds each step once: printing on a clock alone repeated a slow step's line."""

    def __init__(self, every_s: float = 10.0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.every_s = every_s
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._step: Any = object()  # the step of the last line printed (none yet)
        self._text = ""

    def update(self, fields: Mapping[str, Any], force: bool = False) -> None:
        now = time.monotonic()
        text = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        if self.tty:
            due = force or now - self._last >= 1.0
        elif force:
            due = text != self._text
        else:
            due = fields.get("step") != self._step and now - self._last >= self.every_s
        if not due:
            return
        self._last, self._step, self._text = now, fields.get("step"), text
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def plot_learning_curves(records: Sequence[Mapping[str, Any]], out: Path, title: str = "") -> Path | None:
    """learning_curves.png: hero return and centres from rollouts, evaluation centres with their 95%
    interval, and the learner's loss statistics, against learner steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learner = [r for r in records if r.get("kind") == "learner" and r.get("policy") == "main"]
    rollout = [r for r in records if r.get("kind") == "rollout" and r.get("policy") == "main"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not learner and not evals:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    if rollout:
        ax.plot([r["learner/step"] for r in rollout], [r["rollout/mean_reward"] for r in rollout], ".-", label="return")
        ax2 = ax.twinx()
        ax2.plot(
            [r["learner/step"] for r in rollout], [r["rollout/hero_centres"] for r in rollout], "g.-", label="centres"
        )
        ax2.set_ylabel("hero centres at horizon", color="g")
    ax.set_title("rollouts (recent groups)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("mean hero return")
    ax = axes[0][1]
    for opponent in sorted({str(r.get("opponents")) for r in evals}):
        rows = [r for r in evals if str(r.get("opponents")) == opponent]
        steps = [r["step"] for r in rows]
        mean = [r["eval/hero_mean_sc"] for r in rows]
        low = [r.get("eval/hero_mean_sc_lo", m) for r, m in zip(rows, mean, strict=True)]
        high = [r.get("eval/hero_mean_sc_hi", m) for r, m in zip(rows, mean, strict=True)]
        ax.plot(steps, mean, "o-", label=f"vs {opponent}")
        ax.fill_between(steps, low, high, alpha=0.2)
    ax.set_title("evaluation: hero mean centres (95% CI)")
    ax.set_xlabel("learner step")
    if evals:
        ax.legend(fontsize=8)
    for ax, keys, name in (
        (axes[1][0], ("loss", "loss_pg", "loss_entropy", "loss_kl"), "loss"),
        (axes[1][1], ("entropy", "clip_frac_low", "clip_frac_high", "tis_capped_frac", "kl"), "statistics"),
    ):
        steps = [r.get("step", i) for i, r in enumerate(learner)]
        for key in keys:
            values = [r.get(key) for r in learner]
            if any(_finite(v) for v in values):
                ax.plot(steps, [v if _finite(v) else float("nan") for v in values], ".-", label=key)
        ax.set_title(f"learner {name}")
        ax.set_xlabel("learner step")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
