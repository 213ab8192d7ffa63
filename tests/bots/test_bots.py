"""Every bot plays only legal orders in every phase type; DumbBot is as strong as the spec says."""

from __future__ import annotations

from collections import Counter

import pytest

from diprl.bots import BOT_NAMES, UnknownBotError, make_agent
from diprl.bots.dumbbot import DumbBot, _cdiv, power_size
from diprl.game import DiplomacyGame, PhaseKind
from diprl.game.orders import SUPPORT, parse_order


def play(agent_names: dict[str, str], seed: int, max_year: int = 1935) -> tuple[DiplomacyGame, Counter[str]]:
    """Play a game, checking every bot's orders against the legal lists before stepping."""
    game = DiplomacyGame(max_year=max_year)
    agents = {p: make_agent(agent_names[p], seed=seed * 7 + i) for i, p in enumerate(game.powers)}
    kinds: Counter[str] = Counter()
    while not game.is_done:
        orders = {}
        for power in game.orderable_powers():
            legal = game.legal_orders(power)
            submitted = agents[power].orders(game, power)
            kinds[legal.kind.value] += 1
            assert len(submitted) == legal.n_required, (agent_names[power], legal.kind, submitted)
            sites = [parse_order(o).loc for o in submitted if o != "WAIVE"]
            assert len(sites) == len(set(sites)), f"two orders for one unit or site: {submitted}"
            for order in submitted:
                assert (order == "WAIVE" and legal.allows_waive) or order in legal.loc_of, (order, legal.phase)
            orders[power] = submitted
        record = game.step(orders)
        assert record.issues == (), record.issues
    return game, kinds


@pytest.mark.parametrize("name", BOT_NAMES)
def test_bot_plays_only_legal_orders_in_every_phase_type(name: str) -> None:
    kinds: Counter[str] = Counter()
    for seed in range(3):
        # Each bot plays against a mix so that retreats, builds and disbands all occur.
        mix = [name, "random", "dumbbot", name, "chaos", "territorial", name]
        _, k = play(dict(zip(DiplomacyGame().powers, mix, strict=True)), seed, max_year=1912)
        kinds.update(k)
    for kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND):
        assert kinds[kind.value] > 0, f"{name} never met a {kind.value} phase: {kinds}"


def test_unknown_bot_is_a_clear_error() -> None:
    with pytest.raises(UnknownBotError, match="known bots: random"):
        make_agent("dumbot")


def test_same_seed_same_game() -> None:
    names = dict.fromkeys(DiplomacyGame().powers, "dumbbot")
    a, _ = play(names, seed=3, max_year=1905)
    b, _ = play(names, seed=3, max_year=1905)
    assert [r.orders for r in a.history] == [r.orders for r in b.history]


def test_power_size_and_c_division_match_the_spec() -> None:
    assert power_size(0) == 16 and power_size(3) == 9 + 12 + 16
    assert _cdiv(7, 2) == 3 and _cdiv(-7, 2) == -3  # C truncates toward zero; Python's // would give -4


def test_choose_takes_the_best_when_the_gap_is_large() -> None:
    # gap*500/value = 900*500/1000 = 450 >= any rand()%100, so the walk never leaves the best.
    bot = DumbBot(seed=0)
    picks = Counter(bot.choose([(100, "worse"), (1000, "best")]) for _ in range(200))
    assert picks == Counter({"best": 200})


def test_choose_moves_on_about_half_the_time_between_equal_neighbours() -> None:
    # Values 1000 and 999: threshold 0, so the walk moves on exactly when the first draw is < 50.
    bot = DumbBot(seed=1)
    picks = Counter(bot.choose([(1000, "a"), (999, "b")]) for _ in range(2000))
    assert 0.45 < picks["b"] / 2000 < 0.55


def test_choose_collapses_equal_values_to_the_first_seen() -> None:
    bot = DumbBot(seed=2)
    picks = {bot.choose([(5, "first"), (5, "second"), (1, "low")]) for _ in range(300)}
    assert "second" not in picks and picks <= {"first", "low"}


def test_dumbbot_supports_only_its_own_units_and_they_match() -> None:
    """Loose ports support foreign units and their supports rarely match what the supported unit does
    (27% against 98% for the C++ rules, docs/dumbbot.md). A match: the supported unit was ordered to make
    exactly the supported move, or to stay put for a hold support."""
    game, _ = play(dict.fromkeys(DiplomacyGame().powers, "dumbbot"), seed=11, max_year=1910)
    supports = matched = 0
    for record in game.history:
        if not record.name.endswith("M"):
            continue
        for power, orders in record.orders.items():
            by_unit = {parse_order(o).unit: parse_order(o) for o in orders}
            for order in by_unit.values():
                if order.kind != SUPPORT:
                    continue
                supports += 1
                assert order.supported_unit in by_unit, f"{power} supports a foreign unit: {order.text}"
                supported = by_unit[order.supported_unit]
                if order.supports_move:
                    matched += supported.kind == "-" and supported.target[:3] == order.supported_target[:3]
                else:
                    matched += supported.kind != "-"
    assert supports > 50
    assert matched / supports > 0.95


def _hero_games(hero: str, opponents: str, n_games: int) -> list[tuple[str, DiplomacyGame]]:
    out = []
    for i in range(n_games):
        powers = DiplomacyGame().powers
        hero_power = powers[i % 7]
        game, _ = play({p: hero if p == hero_power else opponents for p in powers}, seed=1000 + i)
        out.append((hero_power, game))
    return out


def test_dumbbot_solos_against_six_random_bots() -> None:
    games = _hero_games("dumbbot", "random", 14)
    solos = sum(game.solo_winner() == hero for hero, game in games)
    assert solos / len(games) >= 0.9


def test_random_never_solos_against_six_dumbbots() -> None:
    games = _hero_games("random", "dumbbot", 14)
    assert all(game.solo_winner() != hero for hero, game in games)
    assert any(not game.is_eliminated(hero) for hero, game in games)  # some survive, as the spec expects


def test_a_style_bot_without_its_movement_style_cannot_be_made() -> None:
    from diprl.bots.simple import StyleBot

    class Styleless(StyleBot):
        name = "styleless"

    with pytest.raises(TypeError, match="abstract method movement"):
        Styleless(0)
