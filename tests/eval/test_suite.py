"""The fixed suite: the same games as the arena, LLM seats of all games in one batch per phase, checked config."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from diprl.bots import make_agent
from diprl.eval.arena import ArenaConfig, run_arena, standard_powers
from diprl.eval.refs import UnknownPolicyRef
from diprl.eval.suite import SuiteConfig, game_specs, request_seed, run_suite

from .conftest import RecordingClient


@pytest.fixture(scope="module")
def bots_report() -> dict[str, Any]:
    return run_suite(SuiteConfig(policy="bot:dumbbot", opponents=["bot:random"], games=7, max_year=1902, seed=5))


def test_bot_suite_plays_exactly_the_arenas_games(bots_report: dict[str, Any]) -> None:
    # Same seeds, same seating: the suite must reproduce the arena game for game.
    arena = run_arena(ArenaConfig("dumbbot", "random", games=7, max_year=1902, seed=5), make_agent)
    assert bots_report["hero_centres_per_game"] == [g.hero_centres for g in arena]
    assert [g["category"] for g in bots_report["per_game"]] == [g.category for g in arena]
    assert [g["centres"] for g in bots_report["per_game"]] == [g.centres for g in arena]


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
    config = SuiteConfig(policy="base", opponents=["bot:random", "main@v2"], games=3, max_year=1901, max_tokens=64)
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
    config = SuiteConfig(
        policy="base", opponents=["bot:random"], games=1, max_year=1901, max_tokens=64, sampling_seed=None
    )
    run_suite(config, recording_client)
    assert all(r.sample_seed is None for call in recording_client.calls for r in call)


def test_another_sampling_stream_redraws_the_same_games() -> None:
    assert request_seed(5, "FRANCE", "S1901M", 0) == request_seed(5, "FRANCE", "S1901M")
    assert request_seed(5, "FRANCE", "S1901M", 1) != request_seed(5, "FRANCE", "S1901M", 0)
    with pytest.raises(ValueError, match="sampling_seed"):
        SuiteConfig(sampling_seed=-1)


def test_llm_seats_without_a_client_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="PolicyClient"):
        run_suite(SuiteConfig(policy="base", opponents=["bot:random"], games=1, max_year=1901))


def test_workers_do_not_change_results() -> None:
    one = run_suite(SuiteConfig(policy="bot:random", opponents=["bot:random"], games=4, max_year=1901, seed=2))
    two = run_suite(
        SuiteConfig(policy="bot:random", opponents=["bot:random"], games=4, max_year=1901, seed=2, workers=2)
    )
    assert one["per_game"] == two["per_game"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "bot:dumbot"}, "unknown bot"),
        ({"policy": "main@v0"}, "unknown PolicyRef"),
        ({"opponents": ["bot:random", "main"]}, "unknown PolicyRef"),
        ({"opponents": []}, "at least one"),
        ({"games": 0}, "games"),
        ({"max_year": 1800}, "max_year"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"replays": 3, "games": 2}, "replays"),
        ({"replays": 1}, "replay_dir"),
    ],
)
def test_bad_suite_options_are_clear_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_unknown_refs_have_their_own_error_type() -> None:
    with pytest.raises(UnknownPolicyRef):
        SuiteConfig(policy="bot:nobody")
    assert SuiteConfig(opponents="bot:random").opponents == ["bot:random"]  # type: ignore[arg-type]
