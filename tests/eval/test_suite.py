"""The fixed suite: the games the arena always played, LLM seats of all games in one batch per phase, checked config."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from diprl.eval.config import GamesConfig
from diprl.eval.refs import UnknownPolicyRef
from diprl.eval.suite import SuiteConfig, game_specs, run_suite, run_suites
from diprl.game.seating import standard_powers
from diprl.rollout.lockstep import request_seed

from .conftest import RecordingClient


@pytest.fixture(scope="module")
def bots_report() -> dict[str, Any]:
    play = GamesConfig(games=7, max_year=1902, seed=5)
    return run_suite(SuiteConfig(policy="bot:dumbbot", opponents=["bot:random"], play=play))


def test_bot_suite_plays_the_games_the_arena_always_played(bots_report: dict[str, Any]) -> None:
    # Pinned from the arena's own process-pool engine before it became a caller of the suite
    # (`run_arena(ArenaConfig("dumbbot", "random", games=7, max_year=1902, seed=5))`): seating and
    # seeds must not move, or every published figure would stop being reproducible.
    assert bots_report["hero_centres_per_game"] == [7, 7, 8, 9, 6, 9, 6]
    assert [g["category"] for g in bots_report["per_game"]] == ["top"] * 7
    assert [round(g["hero_sum_of_squares"], 4) for g in bots_report["per_game"]] == [
        41.1765, 36.8421, 53.3333, 57.0423, 24.8276, 57.0423, 27.9070
    ]  # fmt: skip


def test_report_is_well_formed(bots_report: dict[str, Any]) -> None:
    r = bots_report
    assert r["games"] == 7 and r["label"] == "bot:dumbbot vs bot:random"
    assert sum(c["count"] for c in r["categories"].values()) == 7
    assert sorted(g["hero_power"] for g in r["per_game"]) == list(standard_powers())
    assert r["hero_mean_sc"] == pytest.approx(sum(r["hero_centres_per_game"]) / 7)
    low, high = r["hero_centres"]["ci95"]
    assert low <= r["hero_mean_sc"] <= high
    assert r["order_issues"] == {"total": 0, "hero": 0}
    assert r["llm"]["requests"] == 0
    b = r["behaviour"]
    assert b["support_rate"]["n"] == b["orders"] > 0
    assert sum(b["support_verdicts"].values()) == b["support_rate"]["count"]  # every support classified
    assert b["critical_support_rate"]["count"] == b["support_verdicts"]["critical"]
    years = r["centres_by_year"]
    assert years["years"][0] == 1901 and years["mean"][0] == pytest.approx(22 / 7)  # Russia starts with 4
    for g in r["per_game"]:
        assert g["hero_centres_by_year"][-1] == g["hero_centres"]


def test_llm_seats_of_all_games_share_one_call_per_phase(recording_client: RecordingClient) -> None:
    play = GamesConfig(games=3, max_year=1901, max_tokens=64)
    config = SuiteConfig(policy="base", opponents=["bot:random", "main@v2"], play=play)
    report = run_suite(config, recording_client)
    calls = recording_client.calls
    # Every game plays the same 1901 phases (S, F movement; W adjustments when someone builds), so
    # each call holds the LLM seats of all three games: hero + 3 of the 6 seats round-robin.
    assert len(calls) == report["timing"]["llm_calls"] <= max(g["phases"] for g in report["per_game"])
    first = calls[0]
    assert len(first) == 3 * (1 + 3)
    assert Counter(r.policy for r in first) == {"base": 3, "main@v2": 9}
    for request in first:
        assert set(request.to_dict()) == {"policy", "prompt", "legal", "temperature", "max_tokens", "sample_seed"}
        assert request.max_tokens == 64 and str(request.prompt).startswith("<|im_start|>")
    # Every seat of every game has its own sampling seed, fixed by game seed, power and phase.
    seeds = [r.sample_seed for r in first]
    assert len(set(seeds)) == len(seeds)
    assert seeds[0] == request_seed(game_specs(config)[0].seed, first[0].legal["power"], "S1901M")
    assert report["llm"]["requests"] == sum(len(c) for c in calls)
    assert report["llm"]["hero_requests"] == sum(r.policy == "base" for c in calls for r in c)
    assert report["llm"]["errors"] == 0 and report["order_issues"]["total"] == 0
    specs = game_specs(config)
    assert [s.seats[s.hero] for s in specs] == ["base"] * 3


def test_unseeded_suites_send_no_seed(recording_client: RecordingClient) -> None:
    play = GamesConfig(games=1, max_year=1901, max_tokens=64, sampling_seed=None)
    config = SuiteConfig(policy="base", opponents=["bot:random"], play=play)
    run_suite(config, recording_client)
    assert all(r.sample_seed is None for call in recording_client.calls for r in call)


def test_another_sampling_stream_redraws_the_same_games() -> None:
    assert request_seed(5, "FRANCE", "S1901M", 0) == request_seed(5, "FRANCE", "S1901M")
    assert request_seed(5, "FRANCE", "S1901M", 1) != request_seed(5, "FRANCE", "S1901M", 0)
    with pytest.raises(ValueError, match="sampling_seed"):
        GamesConfig(sampling_seed=-1)


def test_llm_seats_without_a_client_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="PolicyClient"):
        run_suite(SuiteConfig(policy="base", opponents=["bot:random"], play=GamesConfig(games=1, max_year=1901)))


def test_workers_do_not_change_results() -> None:
    play = GamesConfig(games=4, max_year=1901, seed=2)
    one = run_suite(SuiteConfig(policy="bot:random", opponents=["bot:random"], play=play))
    two = run_suite(SuiteConfig(policy="bot:random", opponents=["bot:random"], play=play, workers=2))
    assert one["per_game"] == two["per_game"]


def test_several_bot_suites_share_one_run_and_keep_their_own_games() -> None:
    play = GamesConfig(games=3, max_year=1901, seed=7, critical_supports=False)
    configs = [SuiteConfig(policy=f"bot:{hero}", opponents=["bot:random"], play=play) for hero in ("hold", "random")]
    together = run_suites(configs, progress=False)
    alone = [run_suite(config) for config in configs]

    def games(report: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "suite"} for g in report["per_game"]]

    assert [games(r) for r in together] == [games(r) for r in alone]
    assert [r["label"] for r in together] == ["bot:hold vs bot:random", "bot:random vs bot:random"]
    assert together[0]["timing"]["suites_in_one_run"] == 2


def test_a_failing_bot_game_names_the_game(monkeypatch: pytest.MonkeyPatch) -> None:
    from diprl.eval import suite

    def broken(spec: suite.GameSpec) -> Any:
        raise KeyError("engine state")
        yield  # a generator, as the real job is

    monkeypatch.setattr(suite, "play_game", broken)
    with pytest.raises(RuntimeError, match=r"game 0 of suite 0 \(seed 0, hero AUSTRIA\) failed: KeyError"):
        run_suite(SuiteConfig(policy="bot:random", opponents=["bot:random"], play=GamesConfig(games=1, max_year=1901)))


def test_games_config_is_kept_alone_and_checked() -> None:
    from diprl.eval.config import EvaluateConfig

    config = SuiteConfig(play=EvaluateConfig(policy="bot:hold", games=7, out="elsewhere"))
    assert type(config.play) is GamesConfig and config.play.games == 7  # only the games part is kept
    with pytest.raises(TypeError, match="GamesConfig"):
        SuiteConfig(play={"games": 7})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "bot:dumbot"}, "unknown bot"),
        ({"policy": "main@v0"}, "unknown PolicyRef"),
        ({"opponents": ["bot:random", "main"]}, "unknown PolicyRef"),
        ({"opponents": []}, "at least one"),
        ({"workers": 0}, "workers"),
        ({"play": GamesConfig(replays=1)}, "replay_dir"),
    ],
)
def test_bad_suite_options_are_clear_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"games": 0}, "games"),
        ({"max_year": 1800}, "max_year"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"replays": 3, "games": 2}, "replays"),
        ({"sampling_seed": True}, "sampling_seed"),
    ],
)
def test_bad_games_are_clear_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GamesConfig(**kwargs)


def test_unknown_refs_have_their_own_error_type() -> None:
    with pytest.raises(UnknownPolicyRef):
        SuiteConfig(policy="bot:nobody")
    assert SuiteConfig(opponents="bot:random").opponents == ["bot:random"]  # type: ignore[arg-type]
