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


def test_learning_gain_is_paired_and_its_interval_brackets_the_mean() -> None:
    from diprl.bench.learning import paired_gain

    before = [4, 4, 3, 5, 4, 4, 2, 6]
    after = [5, 6, 3, 6, 5, 4, 4, 7]
    gain = paired_gain(before, after)
    assert gain["gain"] == pytest.approx(1.0)
    assert 0.0 < gain["lo"] <= gain["gain"] <= gain["hi"]
    same = paired_gain(before, before)
    assert same == {"gain": 0.0, "lo": 0.0, "hi": 0.0}
    with pytest.raises(ValueError, match="paired games"):
        paired_gain(before, after[:-1])


def test_learning_benchmark_runs_the_chosen_configurations() -> None:
    from diprl.bench.learning import DEFAULT, VARIANTS, chosen_variants

    assert chosen_variants(False) == (DEFAULT,)
    assert chosen_variants(True) == VARIANTS
    picked = chosen_variants(False, ["imitation-all", "scratch-all"])
    assert [v.name for v in picked] == ["scratch-all", "imitation-all"]
    with pytest.raises(ValueError, match="unknown configuration"):
        chosen_variants(False, ["scratch-forks"])
