"""The engine benchmark runs, agrees with itself and prints its figure; timings are never asserted."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
    from diprl.eval.stats import paired_gain

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


def test_the_warm_start_gets_lines_of_its_own() -> None:
    from diprl.bench.learning import warm_start_lines

    rows = [
        {"variant": "scratch-fork", "sc_before": 4.0, "learning_gain_lo": 0.5},
        {"variant": "imitation-fork", "sc_before": 6.5, "learning_gain_lo": -0.2},
        {"variant": "imitation-all", "sc_before": 6.5, "learning_gain_lo": 0.1},
    ]
    assert warm_start_lines(rows) == ["warm_start_sc=6.500", "warm_start_gain_lo=0.100"]
    assert warm_start_lines(rows[:1]) == []


def test_experience_benchmark_pairs_old_and_new_settings_and_divides_records_per_second() -> None:
    from diprl.bench.experience import OLD, settings, speedups

    chosen = settings(None, ["small"])
    assert [s.label for s in chosen] == ["random old", "random new", "random new:small", "selfplay old", "selfplay new"]
    assert chosen[0].overrides == tuple(OLD) and "model=tiny_qwen" in OLD and chosen[1].overrides == ()
    assert chosen[2].overrides == ("model=small",)
    assert [s.label for s in settings("selfplay", ["small"])] == ["selfplay old", "selfplay new"]
    rates = {"random old": 1.0, "random new": 6.5, "random new:small": 4.0, "selfplay old": 0.1, "selfplay new": 2.0}
    fields = speedups({k: {"records_trained_per_s": v} for k, v in rates.items()})
    assert fields == pytest.approx(
        {
            "experience_old": 1.0,
            "experience_new": 6.5,
            "experience_speedup": 6.5,
            "experience_speedup_small": 4.0,
            "experience_selfplay_speedup": 20.0,
        }
    )


def test_learning_benchmark_evaluates_greedily_unless_told_otherwise(tmp_path: Path) -> None:
    from diprl.bench.learning import DEFAULT, training_args
    from diprl.run.config import compose_config

    args = training_args(DEFAULT, 1.0, tmp_path / "run")
    config, _ = compose_config(args)
    assert config.evaluation.temperature == 0.0 and config.evaluation.games == 56
    assert config.rollout.train_turns == "fork" and config.train.max_minutes == 1.0
    sampled, _ = compose_config(training_args(DEFAULT, 1.0, tmp_path / "run", 1.0, ["learner.lr=0.001"]))
    assert sampled.evaluation.temperature == 1.0 and sampled.learner.lr == 0.001


def test_the_warm_start_steps_at_its_own_rate_unless_told_otherwise(tmp_path: Path) -> None:
    """RL from the imitation adapter starts at WARM_START_LR, on the imitation's model, anchored to it by a KL
    penalty; a rate on the bench's command line still wins."""
    from diprl.bench.learning import (
        EVAL_GAMES,
        RECORDS_PER_STEP,
        VARIANTS,
        WARM_START_EVAL_GAMES,
        WARM_START_GROUP_SIZE,
        WARM_START_KL_COEF,
        WARM_START_LR,
        WARM_START_WARMUP_MAX_PHASES,
        training_args,
        warm_start_overrides,
    )
    from diprl.run.config import compose_config

    warm = next(v for v in VARIANTS if v.warm_start)
    adapter = str(tmp_path / "adapter")
    config, _ = compose_config(
        training_args(warm, 1.0, tmp_path / "run", overrides=warm_start_overrides(adapter, "tiny"))
    )
    assert (config.learner.lr, config.learner.init_adapter, config.model.name) == (WARM_START_LR, adapter, "tiny")
    assert config.rollout.episode.warmup_max_phases == WARM_START_WARMUP_MAX_PHASES > 4  # later years too
    # anchored to the warm start itself: a fixed KL reference, not an EMA that follows the drift
    assert (config.learner.kl_coef, config.learner.ema_decay) == (WARM_START_KL_COEF, 1.0) and WARM_START_KL_COEF > 0
    # eight forks a decision, the same 64 records a step, untrained decisions played greedily
    episode = config.rollout.episode
    assert (episode.group_size, episode.untrained_temperature) == (WARM_START_GROUP_SIZE, 0.0)
    assert episode.group_size > 4
    assert config.learner.groups_per_step * episode.group_size == RECORDS_PER_STEP == 64
    # more games than from scratch, a multiple of 7 (every power as often), the first 56 the same seeds
    assert config.evaluation.games == WARM_START_EVAL_GAMES > EVAL_GAMES and WARM_START_EVAL_GAMES % 7 == 0
    # evaluated before the run (`warm_start_evaluation`), not inside its training minutes
    assert config.evaluation.at_start is False and config.evaluation.at_end is True
    scratch = compose_config(training_args(warm, 1.0, tmp_path / "run"))[0]  # what the warm start keeps
    assert scratch.evaluation.games == EVAL_GAMES == 56 and scratch.evaluation.at_start is True
    assert scratch.learner.groups_per_step * scratch.rollout.episode.group_size == RECORDS_PER_STEP
    assert compose_config(training_args(warm, 1.0, tmp_path / "run"))[0].learner.lr > WARM_START_LR
    told = [*warm_start_overrides(adapter, "tiny"), "learner.lr=0.0005"]
    assert compose_config(training_args(warm, 1.0, tmp_path / "run", overrides=told))[0].learner.lr == 0.0005


def test_the_warm_start_is_evaluated_once_for_its_games_and_paired_with_a_runs_last_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm start's "before" is `python -m diprl.evaluate` of the imitation's version, on the games the run
    evaluates at its end, served as the run's model; made once per bench directory and games, made again
    for other games; a run's `suites` report and the standalone top-level one read alike."""
    import json
    from dataclasses import asdict, replace

    import diprl.evaluate
    from diprl.bench.learning import _eval_reports, _hero_centres, warm_start_evaluation
    from diprl.eval.config import GamesConfig
    from diprl.imitation.run import REPORT
    from diprl.inference.adapters import AdapterStore
    from tests.inference.lora_fixtures import make_lora_dir

    made: list[Any] = []

    def evaluate(plan: Any) -> dict[str, Any]:
        made.append(plan.config)
        report = {
            "config": asdict(plan.suite),
            "hero_centres_per_game": [float(i % 5) for i in range(plan.suite.play.games)],
        }
        Path(plan.config.out).mkdir(parents=True, exist_ok=True)
        (Path(plan.config.out) / "report.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(diprl.evaluate, "run", evaluate)
    imitation = tmp_path / "imitation"
    version = str(AdapterStore(imitation / "adapters").publish("imitation", make_lora_dir(tmp_path, seed=1)))
    (imitation / REPORT).write_text(json.dumps({"version": version, "model": "tiny_wide"}))
    play = GamesConfig(games=112, max_year=1906, seed=12345, temperature=0.0)
    before = warm_start_evaluation(imitation, "tiny_wide", play)
    assert len(made) == 1 and made[0].games_config() == play
    assert (made[0].policy, made[0].opponents, made[0].served_model) == (version, ["bot:random"], "tiny_wide")
    assert made[0].adapters == str(imitation / "adapters")
    assert warm_start_evaluation(imitation, "tiny_wide", play) == before and len(made) == 1  # made once
    other = warm_start_evaluation(imitation, "tiny_wide", replace(play, games=56))
    assert len(made) == 2 and other != before and made[1].games == 56  # other games: made again
    (before.parent / "report.json").write_text(json.dumps({"config": {}, "hero_centres_per_game": []}))
    warm_start_evaluation(imitation, "tiny_wide", play)
    assert len(made) == 3  # a report that does not say it is of these games is made again

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    after = run_dir / "after.json"
    after.write_text(json.dumps({"suites": {"bot:random": {"hero_centres_per_game": [1.0, 2.0]}}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "eval/report": str(after)}) + "\n")
    assert _eval_reports(run_dir, before) == (before, after)
    with pytest.raises(RuntimeError, match="evaluations at the start and the end, found 1"):
        _eval_reports(run_dir)
    assert _hero_centres(after) == [1.0, 2.0] and _hero_centres(before)[:6] == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]
