"""Run directories as the web app sees them: which exist, their status and config, their learning curves.

Everything here only reads. A run is a directory holding `config.yaml` (what `python -m diprl.train`
writes first), found directly under the runs directory (or the runs directory itself). Its status comes
from its files, never from a process list:

- `running`: the driver's lock on `.lock` is held. The lock is looked up in `/proc/locks` rather than
  probed with `flock`, so the page never holds the lock for an instant and cannot make a `train.resume`
  starting at that moment fail with "in use".
- `finished`: no lock, and `league_summary.json` (written by the driver's last act) is at least as new as
  the last record of `metrics.jsonl`.
- `stopped`: no lock and no summary newer than the metrics: the driver was killed, or the run is a
  resume that was killed after the previous summary.

Learning curves are cut from `metrics.jsonl` into a few charts of (x, y) points, x being the learner
step where a record has one. A torn last line (a run being written) is skipped, never an error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.run_yaml import read_run_yaml_text

LOCK_FILE = ".lock"  # the driver's flock'ed lock (diprl.train.LOCK_FILE; not imported: train is heavy)
PLAY_DIR = "play"  # games played in the browser, under the runs directory (never a run)


class UnknownRun(LookupError):
    """A run name that is not a run directory under the runs directory."""


@dataclass(frozen=True)
class RunInfo:
    name: str  # the path relative to the runs directory ("." for the runs directory itself)
    path: Path
    status: str  # running | finished | stopped
    experiment: str
    steps: int  # the main learner's last step in metrics.jsonl (0 without any)
    max_steps: int | None
    updated: float  # newest modification time of the files the pages read
    config_text: str
    config: dict[str, Any] = field(default_factory=dict)


def discover_runs(runs_dir: Path) -> list[Path]:
    """Run directories: `runs_dir` itself if it is a run, else its children that are, newest first."""
    if (runs_dir / "config.yaml").is_file():
        return [runs_dir]
    if not runs_dir.is_dir():
        return []
    runs = [p for p in runs_dir.iterdir() if p.is_dir() and p.name != PLAY_DIR and (p / "config.yaml").is_file()]
    return sorted(runs, key=lambda p: (-_mtime(p / "config.yaml"), p.name))


def run_names(runs_dir: Path) -> list[str]:
    return [_name(runs_dir, p) for p in discover_runs(runs_dir)]


def resolve_run(runs_dir: Path, name: str) -> Path:
    """The run directory named `name`; `UnknownRun` for anything else (no path is built from the name)."""
    for path in discover_runs(runs_dir):
        if _name(runs_dir, path) == name:
            return path
    known = ", ".join(run_names(runs_dir)) or "none yet"
    raise UnknownRun(f"unknown run {name[:80]!r} under {runs_dir} (runs: {known})")


def _name(runs_dir: Path, path: Path) -> str:
    return "." if path == runs_dir else path.name


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def lock_held(lock_file: Path) -> bool:
    """True when some process holds a lock on `lock_file` (Linux `/proc/locks`; a probe elsewhere)."""
    try:
        stat = lock_file.stat()
    except OSError:
        return False
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return _probe_lock(lock_file)
    wanted = (os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino)
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter queued behind a holder, listed on its own line
            continue
        for word in fields:
            parts = word.split(":")
            if len(parts) != 3:
                continue
            try:
                found = (int(parts[0], 16), int(parts[1], 16), int(parts[2]))
            except ValueError:
                continue
            if found == wanted:
                return True
    return False


def _probe_lock(lock_file: Path) -> bool:
    """Where `/proc/locks` is missing: try a shared lock and let it go at once."""
    import fcntl

    try:
        with lock_file.open("r") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """`diprl.tracking.read_metrics`, keeping only records that are JSON objects."""
    from diprl.tracking import read_metrics as read

    return [r for r in read(path) if isinstance(r, dict)]


def run_status(run_dir: Path, records: list[dict[str, Any]] | None = None) -> str:
    if lock_held(run_dir / LOCK_FILE):
        return "running"
    summary = run_dir / "league_summary.json"
    if not summary.is_file():
        return "stopped"
    records = read_metrics(run_dir / "metrics.jsonl") if records is None else records
    last = max((float(r["time"]) for r in records if _number(r.get("time"))), default=0.0)
    return "finished" if _mtime(summary) + 1.0 >= last else "stopped"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _load_config(text: str) -> dict[str, Any]:
    """The resolved config as plain data; {} when it does not parse or is refused by the limits on a run's
    YAML (`diprl.run_yaml`: no aliases, interpolations, deep nesting or megabytes); the page still shows
    the text."""
    from omegaconf import OmegaConf

    from diprl.run_yaml import load_run_yaml

    try:
        data = OmegaConf.to_container(load_run_yaml(text, "config.yaml"), resolve=False)
    except Exception:  # refused, or any YAML or OmegaConf error: a config the page cannot summarise
        return {}
    return {str(k): v for k, v in data.items()} if isinstance(data, dict) else {}


def _get(config: dict[str, Any], *keys: str) -> Any:
    node: Any = config
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def run_config(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """The run's config.yaml: its text (at most `MAX_BYTES`) and what it parses to ({} when it does not)."""
    try:
        text = read_run_yaml_text(run_dir / "config.yaml")  # at most MAX_BYTES of it
    except OSError as exc:
        text = f"# config.yaml unreadable: {exc}"
    return text, _load_config(text)


def config_value(run_dir: Path, *keys: str) -> Any:
    """One value of the run's config (`config_value(run_dir, "league", "health", "z")`), None if absent."""
    return _get(run_config(run_dir)[1], *keys)


def run_info(runs_dir: Path, run_dir: Path) -> RunInfo:
    text, config = run_config(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [int(r["step"]) for r in records if r.get("kind") == "learner" and r.get("policy", "main") == "main"
             and _number(r.get("step"))]  # fmt: skip
    max_steps = _get(config, "train", "max_steps")
    files = [run_dir / n for n in ("config.yaml", "metrics.jsonl", "league_summary.json", LOCK_FILE)]
    return RunInfo(
        name=_name(runs_dir, run_dir),
        path=run_dir,
        status=run_status(run_dir, records),
        experiment=str(_get(config, "experiment") or "?"),
        steps=max(steps, default=0),
        max_steps=int(max_steps) if isinstance(max_steps, int) else None,
        updated=max(_mtime(f) for f in files),
        config_text=text,
        config=config,
    )


# ------------------------------------------------------------------------------------- curves
# (title, record kind, value key, label): one line per policy (and per opponent for evaluations).
CHARTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("mean hero return (rollouts)", "rollout", ("rollout/mean_reward",)),
    ("hero centres at the horizon (rollouts)", "rollout", ("rollout/hero_centres",)),
    ("evaluation: hero mean centres (95% interval)", "eval", ("eval/hero_mean_sc",)),
    ("loss", "learner", ("loss",)),
    ("entropy", "learner", ("entropy",)),
    ("clip fraction", "learner", ("clip_frac_low", "clip_frac_high")),
    ("groups per second", "rollout", ("rollout/groups_per_s",)),
)


def _x(record: dict[str, Any]) -> float | None:
    for key in ("step", "learner/step"):
        if _number(record.get(key)):
            return float(record[key])
    return None


def learning_curves(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Charts for the runs page: [{"title", "series": [{"label", "points": [[x, y, lo?, hi?], ...]}]}]."""
    charts = []
    for title, kind, keys in CHARTS:
        series: dict[str, list[list[float]]] = {}
        for record in records:
            if record.get("kind") != kind:
                continue
            x = _x(record)
            if x is None:
                continue
            for key in keys:
                y = record.get(key)
                if not isinstance(y, int | float) or not _number(y):
                    continue
                label = str(record.get("policy", "main"))
                if kind == "eval":
                    label += f" vs {record.get('opponents', '?')}"
                if len(keys) > 1:
                    label += f" {key}"
                point = [x, float(y)]
                lo, hi = record.get(f"{key}_lo"), record.get(f"{key}_hi")
                if isinstance(lo, int | float) and isinstance(hi, int | float) and _number(lo) and _number(hi):
                    point += [float(lo), float(hi)]
                series.setdefault(label, []).append(point)
        charts.append({"title": title, "series": [{"label": k, "points": v} for k, v in sorted(series.items())]})
    return charts


def curves_payload(runs_dir: Path, run_dir: Path) -> dict[str, Any]:
    """What the runs page polls: status, steps and the charts, with the time of the newest file."""
    info = run_info(runs_dir, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    return {
        "run": info.name,
        "status": info.status,
        "steps": info.steps,
        "max_steps": info.max_steps,
        "records": len(records),
        "updated": info.updated,
        "charts": learning_curves(records),
    }
