"""Support verdicts on hand-built positions around Burgundy.

The map facts used: BUR borders PAR, PIC, BEL, RUH, MUN, MAR and GAS; RUH borders BEL and HOL.
Strength of a move = 1 + supports; it dislodges a holder only if stronger than 1 + hold supports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from diprl.game import DiplomacyGame, PhaseRecord
from diprl.game.outcomes import SupportVerdict, classify_supports, moved, outcome

from .positions import position

C, R, F, V, X = (
    SupportVerdict.CRITICAL,
    SupportVerdict.REDUNDANT,
    SupportVerdict.FUTILE,
    SupportVerdict.VOID,
    SupportVerdict.CUT,
)


def _play(units: Mapping[str, Sequence[str]], orders: Mapping[str, Sequence[str]]) -> tuple[DiplomacyGame, PhaseRecord]:
    game = position(units)
    before = game.fork()
    record = game.step(orders)
    assert record.issues == (), record.issues  # every test position orders every unit legally
    return before, record


CASES = {
    # 2 v 1: the support is the difference.
    "critical": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"A RUH": C},
        {"A MUN": "success", "A BUR": "dislodged"},
    ),
    # 3 v 1: either support alone still makes 2 v 1.
    "redundant": (
        {"GERMANY": ["A MUN", "A RUH", "A BEL"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR", "A BEL S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"A RUH": R, "A BEL": R},
        {"A MUN": "success", "A BUR": "dislodged"},
    ),
    # 3 v 2: without either attacking support it is 2 v 2; the hold support did not save BUR.
    "two critical against a futile hold support": (
        {"GERMANY": ["A MUN", "A RUH", "A BEL"], "FRANCE": ["A BUR", "A MAR"]},
        {
            "GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR", "A BEL S A MUN - BUR"],
            "FRANCE": ["A BUR H", "A MAR S A BUR"],
        },
        {"A RUH": C, "A BEL": C, "A MAR": F},
        {"A MUN": "success", "A BUR": "dislodged"},
    ),
    # A MUN holds, so the support of a move MUN - BUR supports nothing.
    "void": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN H", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H"]},
        {"A RUH": V},
        {"A MUN": "success", "A RUH": "void", "A BUR": "success"},
    ),
    # A BEL attacks the supporter from a third province: the support is cut and MUN bounces 1 v 1.
    "cut": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A BEL"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H", "A BEL - RUH"]},
        {"A RUH": X},
        {"A MUN": "bounce", "A RUH": "cut", "A BEL": "bounce"},
    ),
    # The supporter is dislodged (2 v 1 into RUH): also cut.
    "cut by dislodgement": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A BEL", "A HOL"]},
        {
            "GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"],
            "FRANCE": ["A BUR H", "A BEL - RUH", "A HOL S A BEL - RUH"],
        },
        {"A RUH": X, "A HOL": C},
        {"A MUN": "bounce", "A RUH": "cut", "A BEL": "success"},
    ),
    # The attack on the supporter comes from the province the support is aimed at: no cut, 2 v 1.
    "not cut from the target": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR - RUH"]},
        {"A RUH": C},
        {"A MUN": "success", "A BUR": "bounce"},
    ),
    # 2 v 2: the move bounces despite the support; one hold support is exactly enough.
    "futile against a critical hold support": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A PAR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H", "A PAR S A BUR"]},
        {"A RUH": F, "A PAR": C},
        {"A MUN": "bounce", "A BUR": "success"},
    ),
    # 2 v 3: either hold support alone still makes 2 v 2.
    "futile against redundant hold supports": (
        {"GERMANY": ["A MUN", "A RUH"], "FRANCE": ["A BUR", "A PAR", "A MAR"]},
        {"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"], "FRANCE": ["A BUR H", "A PAR S A BUR", "A MAR S A BUR"]},
        {"A RUH": F, "A PAR": R, "A MAR": R},
        {"A MUN": "bounce", "A BUR": "success"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_support_verdicts(case: str) -> None:
    units, orders, verdicts, outcomes = CASES[case]
    before, record = _play(units, orders)
    assert classify_supports(before, record) == verdicts
    assert {unit: outcome(record.results, unit) for unit in outcomes} == outcomes


def test_classify_leaves_the_pre_state_alone() -> None:
    units, orders, _, _ = CASES["redundant"]
    before, record = _play(units, orders)
    classify_supports(before, record)
    assert (before.phase, before.history) == ("S1901M", ())
    assert before.units("GERMANY") == ("A BEL", "A MUN", "A RUH")
    assert before.units("FRANCE") == ("A BUR",)


def test_classify_needs_the_movement_pre_state() -> None:
    units, orders, _, _ = CASES["critical"]
    game = position(units)
    record = game.step(orders)
    with pytest.raises(ValueError, match="fork taken before"):
        classify_supports(game, record)  # `game` is now at S1901R


def test_no_supports_no_verdicts() -> None:
    before, record = _play({"GERMANY": ["A MUN"]}, {"GERMANY": ["A MUN - BUR"]})
    assert classify_supports(before, record) == {}


def test_outcome_and_moved() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": ["A PAR - BUR", "F BRE - MAO"], "GERMANY": ["A MUN - BUR"]})
    assert outcome(record.results, "A PAR") == "bounce"
    assert outcome(record.results, "F BRE") == "success"
    assert outcome(record.results, "A XXX") == "success"  # a unit without results did nothing wrong
    assert moved(record, "F BRE")
    assert not moved(record, "A PAR")  # bounced
    assert not moved(record, "A MAR")  # held
    assert not moved(record, "A XXX")


def test_classify_supports_can_be_limited_to_some_powers() -> None:
    """Only the named powers' supports are re-adjudicated (each costs a fork): the rest are absent."""
    game = DiplomacyGame()
    orders = {
        "FRANCE": ["A PAR S A MAR - BUR", "A MAR - BUR", "F BRE H"],
        "GERMANY": ["A MUN S A BER - KIE", "A BER - KIE", "F KIE - HOL"],
    }
    before = game.fork()
    record = game.step(orders)
    everyone = classify_supports(before, record)
    france = classify_supports(before, record, powers={"FRANCE"})
    assert set(everyone) == {"A PAR", "A MUN"} and set(france) == {"A PAR"}
    assert france["A PAR"] == everyone["A PAR"]
