"""`random_power_orders`: the one definition of random play (RandomBot, the engine benchmark, tests)."""

from __future__ import annotations

import random
from collections import Counter

from diprl.bench import engine as engine_bench
from diprl.bots import RandomBot
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, random_orders, random_power_orders

from .positions import position


def test_random_play_is_legal_and_complete_in_every_phase_kind() -> None:
    game = DiplomacyGame(max_year=1915)
    rng = random.Random(4)
    kinds: Counter[PhaseKind] = Counter()
    while not game.is_done:
        legal = game.all_legal_orders()
        orders = random_orders(legal, rng)
        assert set(orders) == set(game.orderable_powers())
        for power, chosen in orders.items():
            kinds[legal[power].kind] += 1
            assert len(chosen) == legal[power].n_required
            assert all(order in legal[power].loc_of for order in chosen)  # never a voluntary WAIVE
            assert len({legal[power].loc_of[order] for order in chosen}) == len(chosen)
        assert game.step(orders).issues == ()
    assert set(kinds) == {PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND}


def test_disbands_and_build_sites_are_uniform() -> None:
    # Three units, two centres: each unit is the one disbanded a third of the time.
    game = position({"GERMANY": ["A MUN", "A BER", "F KIE"]}, {"GERMANY": ["BER", "KIE"]}, phase="W1901A")
    legal = game.legal_orders("GERMANY")
    rng = random.Random(0)
    picks = Counter(random_power_orders(legal, rng)[0] for _ in range(3000))
    assert set(picks) == {"A MUN D", "A BER D", "F KIE D"}
    assert all(900 < n < 1100 for n in picks.values())
    # Two builds due and two vacant homes (MOS and WAR are occupied): both sites, every time.
    russia = position({"RUSSIA": ["A MOS", "A WAR"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR"]}, phase="W1901A")
    builds = russia.legal_orders("RUSSIA")
    assert builds.n_required == 2
    sites = Counter(builds.loc_of[o] for _ in range(1000) for o in random_power_orders(builds, rng))
    assert sites == Counter({"SEV": 1000, "STP": 1000})


def test_a_power_with_nothing_to_order_draws_nothing() -> None:
    rng = random.Random(7)
    state = rng.getstate()
    none = PowerOrders(power="ITALY", phase="S1901M", kind=PhaseKind.NONE)
    assert random_power_orders(none, rng) == []
    assert rng.getstate() == state


def test_random_bot_and_the_engine_benchmark_play_by_it() -> None:
    game = DiplomacyGame()
    for seed in range(5):
        for power in game.powers:
            expected = random_power_orders(game.legal_orders(power), random.Random(seed))
            assert RandomBot(seed).orders(game, power) == expected
    assert engine_bench.random_power_orders is random_power_orders
    assert engine_bench.random_orders is random_orders
