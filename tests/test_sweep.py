"""Sweeps: `python -m diprl.train -m ...` runs every point of Hydra's sweep syntax in a run directory of its own,
and `python -m diprl.sweep <sweep_dir>` tabulates the points' final figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from diprl.sweep import expand, summarize, table

if TYPE_CHECKING:
    from tests.conftest import SmokeSweep

ROOT = Path(__file__).resolve().parents[1]


def test_hydra_sweep_syntax_expands_to_every_point_in_order() -> None:
    points = expand(["+experiment=smoke", "learner.lr=1e-3,1e-2", "train.max_steps=range(1,3)"])
    assert points == [
        ["+experiment=smoke", "learner.lr=0.001", "train.max_steps=1"],
        ["+experiment=smoke", "learner.lr=0.001", "train.max_steps=2"],
        ["+experiment=smoke", "learner.lr=0.01", "train.max_steps=1"],
        ["+experiment=smoke", "learner.lr=0.01", "train.max_steps=2"],
    ]
    assert expand(["+experiment=smoke", "learner.lr=1e-3"]) == [["+experiment=smoke", "learner.lr=1e-3"]]
    with pytest.raises(ValueError, match=r"train\.run_dir"):
        expand(["train.run_dir=a,b"])  # the sweep gives each point its directory


def _fake_point(run_dir: Path, step: int, loss: float, centres: float) -> None:
    run_dir.mkdir(parents=True)
    records = [
        {"kind": "learner", "policy": "main", "step": s, "loss": loss + (step - s)} for s in range(1, step + 1)
    ] + [
        {"kind": "rollout", "policy": "main", "rollout/hero_centres": centres},
        {
            "kind": "eval",
            "policy": "main",
            "step": step,
            "opponents": "bot:random",
            "eval/hero_mean_sc": 5.0,
            "eval/hero_mean_sc_lo": 4.5,
            "eval/hero_mean_sc_hi": 5.5,
        },
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_summary_takes_each_points_last_figures(tmp_path: Path) -> None:
    _fake_point(tmp_path / "0", step=3, loss=0.5, centres=4.0)
    _fake_point(tmp_path / "1", step=2, loss=0.25, centres=6.0)
    sweep = {
        "points": [
            {
                "index": 0,
                "overrides": ["+experiment=smoke", "learner.lr=0.001"],
                "run_dir": str(tmp_path / "0"),
                "exit_code": 0,
            },
            {
                "index": 1,
                "overrides": ["+experiment=smoke", "learner.lr=0.01"],
                "run_dir": str(tmp_path / "1"),
                "exit_code": 0,
            },
            {
                "index": 2,
                "overrides": ["+experiment=smoke", "learner.lr=0.1"],
                "run_dir": str(tmp_path / "2"),
                "exit_code": 1,
            },
        ]
    }
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    rows = summarize(tmp_path)
    assert [r["point"] for r in rows] == ["learner.lr=0.001", "learner.lr=0.01", "learner.lr=0.1"]
    assert rows[0]["steps"] == 3 and rows[0]["loss"] == 0.5 and rows[0]["hero_centres"] == 4.0
    assert rows[0]["eval bot:random"] == "5.00 [4.50, 5.50]"
    assert rows[1]["steps"] == 2 and rows[1]["loss"] == 0.25
    assert rows[2]["exit"] == 1 and rows[2]["steps"] is None  # a failed point is a row, not an error
    lines = table(rows)
    assert lines[0].startswith("| point ") and len(lines) == 2 + 3


@pytest.mark.slow
def test_a_sweep_gives_each_point_its_run_directory_runs_on_past_a_failed_point_and_sums_up(
    smoke_sweep: SmokeSweep,
) -> None:
    """Two points, one trained for real and one refused by the config check (`learner.lr=-1`, exit status 2
    before anything starts): the sweep runs both, records each exit code, and exits with the failed one's; the
    summary has a row for each. (The sweep is tests/conftest.py's `smoke_sweep`, which the network audit's test
    reads too: one real run for both.)"""
    sweep_dir = smoke_sweep.sweep_dir
    assert smoke_sweep.exit_code == 2, smoke_sweep.output[-6000:]
    assert "lr must be positive" in smoke_sweep.output
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert [p["run_dir"] for p in points] == [str(sweep_dir / "0"), str(sweep_dir / "1")]
    assert [p["exit_code"] for p in points] == [0, 2]
    trained = Path(points[0]["run_dir"])
    assert "lr: 0.001" in (trained / "config.yaml").read_text()
    assert list((trained / "provenance").glob("*.json"))
    assert (trained / "checkpoints" / "main" / "step-10").is_dir()
    assert not Path(points[1]["run_dir"]).exists()  # refused before it took a directory
    summary = subprocess.run(
        [sys.executable, "-m", "diprl.sweep", str(sweep_dir)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert summary.returncode == 0, summary.stderr
    rows = [line for line in summary.stdout.splitlines() if line.startswith("| learner.lr=")]
    assert len(rows) == 2 and "| 10 |" in rows[0] and "| 2 |" in rows[1], summary.stdout  # steps; exit code
