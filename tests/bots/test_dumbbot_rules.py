"""DumbBot rules that earlier versions got wrong, each pinned on a hand-built position (docs/dumbbot.md)."""

from __future__ import annotations

from collections import Counter

from diprl.bots.dumbbot import DumbBot, Evaluation
from tests.game.positions import position


# -------------------------------------------------------- the choosing rule's signed difference
def test_walking_upward_moves_on_half_the_time() -> None:
    # Removals rank lowest first. With the signed difference (100 - 1000)*500/100 < 0, so the second
    # draw always passes and each step moves on exactly when the first draw is < 50: a, b, c are
    # picked 1/2, 1/4, 1/4 of the time. Taking the gap as a magnitude (450 here) never moves on.
    bot = DumbBot(seed=0)
    picks = Counter(bot.choose([(1000, "c"), (100, "a"), (500, "b")], ascending=True) for _ in range(4000))
    assert 0.46 < picks["a"] / 4000 < 0.54
    assert 0.21 < picks["b"] / 4000 < 0.29
    assert 0.21 < picks["c"] / 4000 < 0.29


def test_walking_down_from_a_negative_value_moves_on_half_the_time() -> None:
    # Movement values go negative when competition outweighs the rest: (-500 - -1500)*500/-500 =
    # -1000, so again only the first draw decides.
    bot = DumbBot(seed=1)
    picks = Counter(bot.choose([(-500, "best"), (-1500, "next")]) for _ in range(4000))
    assert 0.46 < picks["next"] / 4000 < 0.54


def test_removal_is_not_always_the_lowest_value_unit() -> None:
    """W1901A: Russia owns MOS and WAR but has three armies, so one must go.

    Germany's A SIL borders WAR, yet WAR ends up with the lowest build value and FIN (next to the
    neutral centres SWE and STP's coasts) with the highest; the values are far apart (a magnitude
    rule would always disband A WAR). Walking upward, A WAR goes half the time, A MOS and A FIN a
    quarter each.
    """
    game = position(
        {"RUSSIA": ["A MOS", "A WAR", "A FIN"], "GERMANY": ["A SIL"]},
        {"RUSSIA": ["MOS", "WAR"], "GERMANY": ["BER", "KIE", "MUN"]},
        phase="W1901A",
    )
    ev = Evaluation(game, "RUSSIA")
    ranked = sorted(game.units("RUSSIA"), key=ev.node_build_value)
    assert ranked == ["A WAR", "A MOS", "A FIN"]
    low, mid = ev.node_build_value("A WAR"), ev.node_build_value("A MOS")
    assert (mid - low) * 500 // low >= 100  # the magnitude rule's threshold: it could never move on

    n = 800
    disbanded = Counter(DumbBot(seed).orders(game, "RUSSIA")[0] for seed in range(n))
    assert set(disbanded) == {"A WAR D", "A MOS D", "A FIN D"}
    assert 0.42 < disbanded["A WAR D"] / n < 0.58
    assert 0.18 < disbanded["A MOS D"] / n < 0.32
    assert 0.18 < disbanded["A FIN D"] / n < 0.32


# ------------------------------------------------- strength and competition count adjacencies
def test_a_fleet_bordering_two_coasts_counts_twice() -> None:
    # England's F MAO borders SPA/NC and SPA/SC, Turkey's F CON borders BUL/EC and BUL/SC: two each.
    # France's A SPA counts one for its own province and A GAS one for bordering SPA.
    game = position({"FRANCE": ["A SPA", "A GAS"], "ENGLAND": ["F MAO"], "TURKEY": ["F CON"]})
    france = Evaluation(game, "FRANCE")
    assert france.strength["SPA"] == 2
    assert france.strength["GAS"] == 2  # A GAS in it, A SPA next to it
    assert france.competition["SPA"] == 2  # F MAO, both coasts
    assert france.competition["BUL"] == 2  # F CON, both coasts
    assert france.competition["POR"] == 1  # F MAO, one coast
    assert france.competition["MAO"] == 1  # F MAO itself
    england = Evaluation(game, "ENGLAND")
    assert england.strength["SPA"] == 2
    assert england.competition["SPA"] == 2  # France: A SPA in it, A GAS next to it


def test_two_coast_threat_makes_dumbbot_support_its_hold() -> None:
    """S1901M: France's A SPA and A GAS face England's lone F MAO.

    F MAO borders both coasts of SPA, so competition there is 2 and a holding A GAS supports A SPA
    (support-hold needs competition > 1). Counting the fleet once (competition 1) never does.
    """
    game = position({"FRANCE": ["A SPA", "A GAS"], "ENGLAND": ["F MAO"]})
    plays = Counter(tuple(DumbBot(seed).orders(game, "FRANCE")) for seed in range(100))
    assert plays[("A GAS S A SPA", "A SPA H")] > 20
