"""The simulated-league benchmark runs small, writes its PNG and its one-line summary (no timings asserted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diprl.bench.__main__ import main


def test_league_benchmark_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "league.png"
    assert main(["league", "--matches", "300", "--window", "50", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    shares = dict(re.findall(r"(\w+)=(\d\.\d\d)", last))
    assert set(shares) >= {"league_anchor_share", "skill_selfplay_share", "picked_wr", "uniform_wr"}
    assert float(shares["skill_selfplay_share"]) > 0.9  # skill matching collapses into self-play
    assert float(shares["league_anchor_share"]) >= 0.1  # the reserved anchor share is kept
