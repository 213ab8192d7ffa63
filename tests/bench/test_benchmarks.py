"""The engine benchmark runs, agrees with itself and prints its figure; timings are never asserted."""

from __future__ import annotations

import re

import pytest

from diprl.bench.__main__ import main


def test_engine_benchmark_quick_run_matches_states_and_prints_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--quick"]) == 0  # non-zero if the naive and wrapped games ever diverge
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"engine_speedup=\d+\.\d\d", out[-1])
    assert any("identical final states and phase counts: 2/2 games" in line for line in out)
    assert any(line.startswith("DiplomacyGame.fork: every order played") for line in out)


def test_unknown_benchmark_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["nope"])
    assert exc.value.code == 2


def test_constraint_benchmark_model_free_part_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["constraint", "--states", "8", "--batch", "4", "--skip-vllm"]) == 0
    out = capsys.readouterr().out
    assert "8 movement states with 8+ units" in out
    assert re.search(r"mask ids per step, batch 4: mean \d+\.\d+ ms", out)
