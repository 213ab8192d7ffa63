"""League health (`diprl.league.health`): fixtures a reader can check by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from diprl.league.health import (
    BehaviourRates,
    BestVersion,
    ExploitLedger,
    GuardConfig,
    HealthConfig,
    Score,
    collapse_faults,
    entropy,
    nash_over_measured,
    population_value,
    relative_population_performance,
    rollback_decision,
    wilson_interval,
)
from diprl.league.payoff import Payoff, hero_outcome

RPS = {("rock", "scissors"): 1.0, ("scissors", "paper"): 1.0, ("paper", "rock"): 1.0}


def payoff_of(rates: dict[tuple[str, str], float], games: int = 10) -> Payoff:
    """A payoff where each listed pair played `games` games, the first member winning a share `rate` of each."""
    payoff = Payoff(decay=1.0)
    for (a, b), rate in rates.items():
        for _ in range(games):
            payoff.update(a, b, rate)
    return payoff


def nash_of(payoff: Payoff, members: list[str], min_games: float = 1.0, main: str = "main"):  # type: ignore[no-untyped-def]
    return nash_over_measured(members, payoff.win_rate, payoff.games, min_games, main=main)


# ------------------------------------------------------------------------------------------ Nash
def test_rock_paper_scissors_weighs_each_a_third() -> None:
    report = nash_of(payoff_of(RPS), ["rock", "paper", "scissors"], main="rock")
    assert report.weights == pytest.approx(dict.fromkeys(["rock", "paper", "scissors"], 1 / 3), abs=1e-6)
    assert report.entropy == pytest.approx(math.log(3), abs=1e-6)
    assert report.support == 3 and report.left_out == () and report.main_weight == pytest.approx(1 / 3, abs=1e-6)


def test_weighted_rock_paper_scissors_matches_the_hand_computed_equilibrium() -> None:
    """Win rates a-b 0.4, a-c 0.8, b-c 0.3: the payoff A = P - 1/2 is [[0, -x, y], [x, 0, -z], [-y, z, 0]]
    with x = 0.1, y = 0.3, z = 0.2, and p = (z, y, x) / (x + y + z) = (1/3, 1/2, 1/6) makes every column
    of A^T p zero (column a: 0.3*0.1 - 0.1*0.3 = 0; b: -(1/3)0.1 + (1/6)0.2 = 0; c: (1/3)0.3 - (1/2)0.2 = 0).
    It is the only equilibrium: all three pure strategies are needed."""
    payoff = payoff_of({("a", "b"): 0.4, ("a", "c"): 0.8, ("b", "c"): 0.3})
    report = nash_of(payoff, ["a", "b", "c"])
    assert report.weights == pytest.approx({"a": 1 / 3, "b": 1 / 2, "c": 1 / 6}, abs=1e-5)
    assert report.entropy == pytest.approx(entropy([1 / 3, 1 / 2, 1 / 6]), abs=1e-5)
    assert report.main_weight is None  # no member called main


def test_a_member_without_games_is_left_out_not_weighed_zero() -> None:
    """`base` never played: a 0.5 for its pairs would invent results (and here give it weight)."""
    payoff = payoff_of(RPS)
    report = nash_of(payoff, ["rock", "paper", "scissors", "base"], main="base")
    assert report.left_out == ("base",)
    assert "base" not in report.weights and report.main_weight is None
    assert report.weights == pytest.approx(dict.fromkeys(["rock", "paper", "scissors"], 1 / 3), abs=1e-6)
    assert report.to_dict()["left_out"] == ["base"]


def test_the_minimum_of_games_is_configurable() -> None:
    payoff = payoff_of({("main", "bot:random"): 0.9}, games=3)
    payoff.update("main", "bot:dumbbot", 0.1)  # one game only
    report = nash_of(payoff, ["main", "bot:random", "bot:dumbbot"], min_games=3.0)
    assert report.left_out == ("bot:dumbbot",)
    assert report.weights == pytest.approx({"main": 1.0, "bot:random": 0.0}, abs=1e-6)
    assert report.main_weight == pytest.approx(1.0) and report.support == 1
    assert json.dumps(report.entropy) == "0.0"  # not "-0.0" in metrics.jsonl
    nothing = nash_of(Payoff(), ["main", "base"])
    assert nothing.weights == {} and nothing.left_out == ("main", "base") and nothing.support == 0


# ------------------------------------------------------------------------------------------ RPP
def test_population_value_by_hand() -> None:
    rock, paper, scissors = [0.5, 0.0, 1.0], [1.0, 0.5, 0.0], [0.0, 1.0, 0.5]
    assert population_value([[0.5]])[0] == pytest.approx(0.0)  # rock against rock
    assert population_value([rock])[0] == pytest.approx(-0.5)  # rock against all three: paper beats it
    assert population_value([[0.0]])[0] == pytest.approx(-0.5)  # rock against paper: always lost
    assert population_value([rock, paper, scissors])[0] == pytest.approx(0.0, abs=1e-9)
    # {rock, paper} against {rock, paper, scissors}: maximise min(p_P / 2, -p_R / 2, (p_R - p_P) / 2);
    # the last two meet at p_R = 1/3, value -1/6 (the row population lacks an answer to paper).
    value, p, q = population_value([rock, paper])
    assert value == pytest.approx(-1 / 6, abs=1e-9)
    assert p == pytest.approx([1 / 3, 2 / 3], abs=1e-6)
    assert q.sum() == pytest.approx(1.0)


def test_rpp_uses_measured_pairs_only() -> None:
    payoff = payoff_of({("main", "bot:random"): 0.9, ("main", "bot:dumbbot"): 0.3})
    rpp = relative_population_performance(
        ["main", "main@v5"], ["bot:random", "bot:dumbbot", "base"], payoff.win_rate, payoff.games, 1.0
    )
    assert rpp is not None
    assert rpp.current == ("main",) and rpp.past == ("bot:random", "bot:dumbbot")
    assert set(rpp.left_out) == {"main@v5", "base"}
    assert rpp.value == pytest.approx(0.3 - 0.5)  # main's worst measured opponent decides
    assert relative_population_performance(["x"], ["y"], payoff.win_rate, payoff.games, 1.0) is None


# ------------------------------------------------------------------------------------------ exploitability
def test_wilson_interval_by_hand() -> None:
    assert wilson_interval(0.0, 0.0) == (0.0, 1.0)
    low, high = wilson_interval(10.0, 20.0)
    assert low == pytest.approx(1 - high) and low == pytest.approx(0.299, abs=1e-3)
    assert wilson_interval(20.0, 20.0)[0] == pytest.approx(0.8389, abs=1e-3)
    with pytest.raises(ValueError):
        wilson_interval(3.0, 2.0)


def test_a_planted_always_winning_exploiter_bounds_exploitability_above_zero() -> None:
    ledger = ExploitLedger()
    for _ in range(20):
        ledger.record("main_exploiter#0", "main@v3", 1.0)
    bound = ledger.lower_bounds()["main@v3"]
    assert bound["lower_bound"] == pytest.approx(0.8389 - 0.5, abs=1e-3) and bound["lower_bound"] > 0.0
    assert bound["exploiter"] == "main_exploiter#0" and bound["games"] == 20


def test_two_copies_of_one_policy_give_an_interval_containing_a_half() -> None:
    """The hero and main are the same policy: the seven seats' centres are exchangeable."""
    rng = np.random.default_rng(0)
    ledger = ExploitLedger()
    powers = [f"P{i}" for i in range(7)]
    for _ in range(200):
        centres = {p: int(c) for p, c in zip(powers, rng.integers(0, 10, size=7), strict=True)}
        ledger.record("main_exploiter#0", "main@v1", hero_outcome(centres, "P0", powers[1:]))
    (estimate,) = ledger.estimates()
    assert estimate.low < 0.5 < estimate.high
    assert ledger.lower_bounds()["main@v1"]["lower_bound"] == 0.0


def test_the_running_maximum_over_exploiters_and_grouping() -> None:
    ledger = ExploitLedger()
    for _ in range(10):
        ledger.record("main_exploiter#0", "main@v1", 0.5)
        ledger.record("main_exploiter#1", "main@v2", 1.0)
        ledger.record("league_exploiter#0", "main@v2", 0.9)
    bounds = ledger.lower_bounds(group=lambda t: "main@v2")  # both versions counted under the snapshot v2
    assert list(bounds) == ["main@v2"] and bounds["main@v2"]["exploiter"] == "main_exploiter#1"
    assert bounds["main@v2"]["games"] == 10  # each exploiter's games are its own
    ledger.close("main_exploiter#0", "main@v2", 0.45, beaten=False, step=100)
    ledger.close("main_exploiter#0", "main@v2", 0.45, beaten=False, step=100)  # a retried call
    assert ExploitLedger.from_dict(ledger.to_dict()).to_dict() == ledger.to_dict()
    assert len(ledger.closed) == 1 and not ledger.closed[0]["beaten"]


# ------------------------------------------------------------------------------------------ best version, guards
def test_best_version_is_the_highest_lower_bound() -> None:
    best = BestVersion()
    assert best.observe(Score("main@v1", 10, 4.0, 3.5, 4.5))
    assert not best.observe(Score("main@v2", 20, 5.0, 3.0, 7.0))  # higher score, but not surely better
    assert best.observe(Score("main@v3", 30, 4.6, 4.2, 5.0))
    assert best.best is not None and best.best.version == "main@v3"
    assert BestVersion.from_dict(best.to_dict()).best == best.best


def test_the_held_out_main_of_issue_36_fires_the_support_guards() -> None:
    """0.56% of its orders supports, 87% of them void: two guards; a healthy mix fires none."""
    rates = BehaviourRates(hold_rate=0.3, support_rate=0.0056, void_support_rate=0.87, bad_completion_rate=0.0)
    faults = collapse_faults("main@v9", 90, rates, GuardConfig())
    assert [f.guard for f in faults] == ["support_rate", "void_support_rate"]
    assert faults[0].to_record()["fault"] == "collapse" and faults[0].version == "main@v9"
    healthy = BehaviourRates(0.2, 0.15, 0.2, 0.01, {"hold": 0.2, "move": 0.65, "support": 0.15})
    assert collapse_faults("main@v9", 90, healthy, GuardConfig()) == []
    assert collapse_faults("main@v9", 90, BehaviourRates(), GuardConfig()) == []  # nothing measured, nothing fired


def test_every_guard_fires() -> None:
    rates = BehaviourRates(0.95, 0.01, 0.7, 0.2, {"hold": 0.96, "move": 0.04})
    best = Score("main@v2", 20, 5.0, 4.5, 5.5)
    score = Score("main@v5", 50, 3.0, 2.5, 3.5)  # its upper bound is under the best's score
    faults = collapse_faults("main@v5", 50, rates, GuardConfig(), score, best)
    assert [f.guard for f in faults] == [
        "hold_rate",
        "support_rate",
        "void_support_rate",
        "bad_completion_rate",
        "kind_share/hold",
        "score",
    ]
    close = Score("main@v5", 50, 4.8, 4.0, 5.2)  # below the best, but within its interval
    assert collapse_faults("main@v5", 50, BehaviourRates(), GuardConfig(), close, best) == []


def test_rollback_decision() -> None:
    best = Score("main@v2", 20, 5.0, 4.5, 5.5)
    faults = collapse_faults("main@v5", 50, BehaviourRates(hold_rate=0.99), GuardConfig())
    decision = rollback_decision("main", "main@v5", 50, faults, best)
    assert decision is not None and decision.to == "main@v2" and decision.guards == ("hold_rate",)
    assert rollback_decision("main", "main@v5", 50, [], best) is None  # healthy
    assert rollback_decision("main", "main@v2", 50, faults, best) is None  # already the best
    assert rollback_decision("main", "main@v5", 50, faults, None) is None  # nothing to go back to


def test_config_ranges() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        HealthConfig(every_steps=0)
    with pytest.raises(ValueError, match="max_hold_rate"):
        GuardConfig(max_hold_rate=1.5)
