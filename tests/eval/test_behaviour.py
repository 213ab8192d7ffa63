"""Behavioural metrics on positions small enough to adjudicate by hand."""

from __future__ import annotations

import pytest

from diprl.eval.behaviour import BehaviourCounts, BehaviourTracker, merge
from diprl.game import DiplomacyGame
from tests.game.positions import position


def track(game: DiplomacyGame, hero: str, *phases: dict[str, list[str]], critical: bool = True) -> BehaviourCounts:
    tracker = BehaviourTracker(hero, len(game.centres(hero)), critical_supports=critical)
    for orders in phases:
        tracker.observe(game.step(orders))
    return tracker.finish(game)


def paris_marseilles_vs_munich() -> DiplomacyGame:
    return position({"FRANCE": ["A PAR", "A MAR"], "GERMANY": ["A MUN"]})


def test_a_support_that_decides_a_bounce_is_critical() -> None:
    # MAR - BUR with PAR's support (2) beats MUN - BUR (1); without it, 1 vs 1 bounces.
    counts = track(
        paris_marseilles_vs_munich(),
        "FRANCE",
        {"FRANCE": ["A MAR - BUR", "A PAR S A MAR - BUR"], "GERMANY": ["A MUN - BUR"]},
    )
    assert (counts.orders, counts.kinds["support"], counts.movement_phases) == (2, 1, 1)
    assert counts.verdicts["critical"] == 1 and sum(counts.verdicts.values()) == 1


def test_a_support_nobody_needed_is_redundant() -> None:
    counts = track(
        paris_marseilles_vs_munich(),
        "FRANCE",
        {"FRANCE": ["A MAR - BUR", "A PAR S A MAR - BUR"], "GERMANY": ["A MUN H"]},
    )
    assert counts.verdicts["redundant"] == 1


def test_a_support_for_a_move_not_made_is_void() -> None:
    game = paris_marseilles_vs_munich()
    counts = track(game, "FRANCE", {"FRANCE": ["A MAR H", "A PAR S A MAR - BUR"], "GERMANY": ["A MUN H"]})
    assert counts.verdicts["void"] == 1 and counts.kinds["support"] == 1
    # Without re-adjudication void is still read off the engine's results; critical cannot be known.
    cheap = track(
        paris_marseilles_vs_munich(),
        "FRANCE",
        {"FRANCE": ["A MAR H", "A PAR S A MAR - BUR"], "GERMANY": ["A MUN H"]},
        critical=False,
    )
    assert cheap.verdicts["void"] == 1 and cheap.verdicts["critical"] == 0


def test_the_order_kind_mix_counts_each_kind_of_the_heros_movement_orders() -> None:
    game = position({"FRANCE": ["A PAR", "A MAR", "A BUR", "F ENG"], "GERMANY": ["A MUN"]})
    orders = ["A MAR H", "A PAR S A BUR - PIC", "A BUR - PIC", "F ENG H"]
    counts = track(game, "FRANCE", {"FRANCE": orders, "GERMANY": ["A MUN H"]}, critical=False)
    assert counts.kinds == {"hold": 2, "move": 1, "support": 1, "convoy": 0}
    assert counts.kind_shares() == {"hold": 0.5, "move": 0.25, "support": 0.25, "convoy": 0.0}
    assert merge([counts, counts]).kinds["hold"] == 4 and BehaviourCounts().kind_shares() is None


def burgundy() -> DiplomacyGame:
    return position({"FRANCE": ["A BUR", "A PAR"], "GERMANY": ["A MUN", "A RUH"]})


SPRING_HELP = {"FRANCE": ["A BUR H", "A PAR H"], "GERMANY": ["A MUN S A BUR", "A RUH H"]}


def test_attacking_the_power_that_supported_you_last_turn_is_counted() -> None:
    counts = track(
        burgundy(), "FRANCE", SPRING_HELP, {"FRANCE": ["A BUR - MUN", "A PAR H"], "GERMANY": ["A MUN H", "A RUH H"]}
    )
    assert (counts.supporter_opportunities, counts.supporter_attacks, counts.supporter_attack_orders) == (1, 1, 1)


def test_moving_elsewhere_after_help_is_not_an_attack() -> None:
    counts = track(
        burgundy(), "FRANCE", SPRING_HELP, {"FRANCE": ["A BUR - PIC", "A PAR H"], "GERMANY": ["A MUN H", "A RUH H"]}
    )
    assert (counts.supporter_opportunities, counts.supporter_attacks) == (1, 0)


def test_a_void_support_or_none_creates_no_debt() -> None:
    # Germany "supports" BUR into PIC, but BUR holds: void, so the attack next turn is no betrayal.
    void_help = {"FRANCE": ["A BUR H", "A PAR H"], "GERMANY": ["A MUN S A BUR - PIC", "A RUH H"]}
    fall = {"FRANCE": ["A BUR - MUN", "A PAR H"], "GERMANY": ["A MUN H", "A RUH H"]}
    assert track(burgundy(), "FRANCE", void_help, fall).supporter_opportunities == 0
    no_help = {"FRANCE": ["A BUR H", "A PAR H"], "GERMANY": ["A MUN H", "A RUH H"]}
    assert track(burgundy(), "FRANCE", no_help, fall).supporter_opportunities == 0


def test_attacking_a_supporters_empty_home_centre_counts() -> None:
    # After Germany's help, Munich is empty (the army moved to KIE) but still a German centre.
    fall = {"FRANCE": ["A BUR - MUN", "A PAR H"], "GERMANY": ["A MUN - KIE", "A RUH H"]}
    assert track(burgundy(), "FRANCE", SPRING_HELP, fall).supporter_attacks == 1


def test_centres_gained_per_year() -> None:
    # France (3 home centres) takes BEL and HOL in 1901 and the game stops after 1901: +2 in one year.
    game = position({"FRANCE": ["A BUR", "A PIC"]}, max_year=1901)
    tracker = BehaviourTracker("FRANCE", len(game.centres("FRANCE")))
    tracker.observe(game.step({"FRANCE": ["A BUR - BEL", "A PIC H"]}))
    tracker.observe(game.step({"FRANCE": ["A BEL - HOL", "A PIC - BEL"]}))
    while not game.is_done:  # the winter adjustments (builds left to the game layer's defaults)
        tracker.observe(game.step({}))
    counts = tracker.finish(game)
    assert (counts.start_centres, counts.final_centres, counts.years) == (3, 5, 1)
    assert counts.centres_gained_per_year == pytest.approx(2.0)


def test_waived_builds_are_counted_against_build_slots() -> None:
    # France takes BEL and HOL in 1901: 5 centres, 2 units, three empty home centres to build on.
    game = position({"FRANCE": ["A BUR", "A PIC"], "GERMANY": ["A MUN"]})
    tracker = BehaviourTracker("FRANCE", len(game.centres("FRANCE")))
    tracker.observe(game.step({"FRANCE": ["A BUR - BEL", "A PIC H"], "GERMANY": ["A MUN H"]}))
    tracker.observe(game.step({"FRANCE": ["A BEL - HOL", "A PIC - BEL"], "GERMANY": ["A MUN H"]}))
    assert game.phase.endswith("A")
    tracker.observe(game.step({"FRANCE": ["A PAR B", "WAIVE", "WAIVE"], "GERMANY": ["WAIVE"]}))
    counts = tracker.finish(game)
    assert (counts.builds, counts.waived_builds) == (1, 2)  # Germany's WAIVE is not the hero's
    assert merge([counts, counts]).waived_builds == 4


def test_merge_adds_counts() -> None:
    a = BehaviourCounts(orders=4, start_centres=3, final_centres=5, years=2)
    a.kinds.update(hold=1, move=1, support=2)
    a.verdicts["void"] = 1
    total = merge([a, a])
    assert (total.orders, total.kinds["support"], total.verdicts["void"], total.years) == (8, 4, 2, 4)
    assert BehaviourCounts.from_dict(a.to_dict()) == a
    # Counts written before `kinds` (one field per kind) read back into it.
    legacy = {k: v for k, v in a.to_dict().items() if k != "kinds"} | {"holds": 1, "moves": 1, "supports": 2}
    assert BehaviourCounts.from_dict(legacy) == a
