"""`DiplomacyGame.step`: validation, defaults, issues, phase progression and the year cap."""

from __future__ import annotations

import pytest

from diprl.game import (
    DiplomacyGame,
    GameOverError,
    IssueKind,
    OrderIssue,
    PhaseKind,
    PowerOrders,
    UnknownPowerError,
    validate_orders,
)

from .positions import HOMES, POWERS, burgundy_retreat, position


def _issues(record_issues: tuple[OrderIssue, ...], power: str) -> list[tuple[IssueKind, str, str]]:
    return [(i.kind, i.order, i.replacement) for i in record_issues if i.power == power]


# ------------------------------------------------------------------ movement
def test_record_of_a_movement_phase() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": ["A PAR - BUR", "A MAR H", "F BRE - MAO"], "GERMANY": ["A MUN - BUR"]})
    assert record.name == "S1901M"
    assert game.phase == "F1901M"
    assert game.history == (record,)
    assert record.orders["FRANCE"] == ("A MAR H", "A PAR - BUR", "F BRE - MAO")  # sorted, whatever the submission order
    assert record.results["A PAR"] == record.results["A MUN"] == ("bounce",)
    assert record.results["F BRE"] == ()
    assert game.units("FRANCE") == ("A MAR", "A PAR", "F MAO")
    # The record keeps the state before adjudication.
    assert record.state["name"] == "S1901M"
    assert sorted(record.state["units"]["FRANCE"]) == ["A MAR", "A PAR", "F BRE"]


def test_missing_orders_become_holds() -> None:
    game = DiplomacyGame()
    record = game.step({})
    assert len(record.issues) == 22  # one per unit on the opening board
    assert {i.kind for i in record.issues} == {IssueKind.MISSING}
    assert _issues(record.issues, "RUSSIA") == [
        (IssueKind.MISSING, "", "A MOS H"),
        (IssueKind.MISSING, "", "F SEV H"),
        (IssueKind.MISSING, "", "F STP/SC H"),
        (IssueKind.MISSING, "", "A WAR H"),
    ]
    assert record.orders["RUSSIA"] == ("A MOS H", "A WAR H", "F SEV H", "F STP/SC H")
    assert game.phase == "F1901M"
    for power in POWERS:
        assert game.units(power) == DiplomacyGame().units(power)


def test_lowercase_and_extra_whitespace_are_normalised() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": ["  a par   -  bur ", "a MAR h", "f  bre - mao"]})
    assert _issues(record.issues, "FRANCE") == []
    assert record.orders["FRANCE"] == ("A MAR H", "A PAR - BUR", "F BRE - MAO")  # sorted, whatever the submission order
    assert game.units("FRANCE") == ("A BUR", "A MAR", "F MAO")


def test_a_single_string_counts_as_one_order() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": "A PAR - BUR"})  # a str is a Sequence[str] too
    assert [i.kind for i in record.issues if i.power == "FRANCE"] == [IssueKind.MISSING, IssueKind.MISSING]
    assert "A BUR" in game.units("FRANCE")


def test_illegal_orders_are_replaced_by_holds() -> None:
    game = DiplomacyGame()
    orders = {"FRANCE": ["A PAR - MUN", "A MUN - BUR", "WAIVE", "A MAR H", "F BRE H"]}
    record = game.step(orders)
    assert _issues(record.issues, "FRANCE") == [
        (IssueKind.ILLEGAL, "A PAR - MUN", ""),  # not adjacent
        (IssueKind.ILLEGAL, "A MUN - BUR", ""),  # a German unit
        (IssueKind.ILLEGAL, "WAIVE", ""),  # only in build phases
        (IssueKind.MISSING, "", "A PAR H"),
    ]
    assert record.orders["FRANCE"] == ("A MAR H", "A PAR H", "F BRE H")
    assert game.units("FRANCE") == ("A MAR", "A PAR", "F BRE")
    assert game.units("GERMANY") == ("A BER", "A MUN", "F KIE")
    assert game.phase == "F1901M"


def test_second_order_for_a_unit_is_a_duplicate() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": ["A PAR - BUR", "A PAR - PIC", "A MAR H", "F BRE H"]})
    assert _issues(record.issues, "FRANCE") == [(IssueKind.DUPLICATE, "A PAR - PIC", "")]
    (issue,) = (i for i in record.issues if i.power == "FRANCE")
    assert issue.detail == "PAR already ordered: 'A PAR - BUR'"
    assert game.units("FRANCE") == ("A BUR", "A MAR", "F BRE")


def test_malformed_orders_are_reported_and_replaced() -> None:
    game = DiplomacyGame()
    record = game.step({"FRANCE": [None, 42, "", "   ", ["A PAR - BUR"]]})  # type: ignore[list-item]
    assert _issues(record.issues, "FRANCE") == [
        (IssueKind.MALFORMED, "None", ""),
        (IssueKind.MALFORMED, "42", ""),
        (IssueKind.MALFORMED, "''", ""),
        (IssueKind.MALFORMED, "'   '", ""),
        (IssueKind.MALFORMED, "['A PAR - BUR']", ""),
        (IssueKind.MISSING, "", "F BRE H"),
        (IssueKind.MISSING, "", "A MAR H"),
        (IssueKind.MISSING, "", "A PAR H"),
    ]
    assert game.units("FRANCE") == ("A MAR", "A PAR", "F BRE")
    assert game.phase == "F1901M"


def test_unknown_power_raises_before_anything_changes() -> None:
    game = DiplomacyGame()
    with pytest.raises(UnknownPowerError, match="FRANKIA"):
        game.step({"FRANCE": ["A PAR - BUR"], "FRANKIA": ["A PAR H"]})
    assert (game.phase, game.history) == ("S1901M", ())
    with pytest.raises(UnknownPowerError):
        game.units("FRANKIA")
    with pytest.raises(UnknownPowerError):
        game.legal_orders("FRANKIA")
    assert issubclass(UnknownPowerError, ValueError)
    game.step({"FRANCE": ["A PAR - BUR"]})  # the game is still usable
    assert game.units("FRANCE") == ("A BUR", "A MAR", "F BRE")


# ------------------------------------------------------------------- retreat
def test_retreat_is_played() -> None:
    game = burgundy_retreat()
    record = game.step({"FRANCE": ["A BUR R PIC"]})
    assert record.name == "S1901R"
    assert record.issues == ()
    assert game.phase == "F1901M"
    assert game.units("FRANCE") == ("A PAR", "A PIC")
    assert game.dislodged("FRANCE") == {}


@pytest.mark.parametrize("bad", ["A BUR R MUN", "A BUR R PAR", "A BUR R BEL", "A BUR - PIC", "A BUR H"])
def test_illegal_retreat_becomes_a_disband(bad: str) -> None:
    game = burgundy_retreat()
    record = game.step({"FRANCE": [bad]})
    assert _issues(record.issues, "FRANCE") == [(IssueKind.ILLEGAL, bad, ""), (IssueKind.MISSING, "", "A BUR D")]
    assert record.orders["FRANCE"] == ("A BUR D",)
    assert game.phase == "F1901M"
    assert game.units("FRANCE") == ("A PAR",)


def test_missing_retreat_becomes_a_disband() -> None:
    game = burgundy_retreat()
    record = game.step({})
    assert record.issues == (OrderIssue("FRANCE", IssueKind.MISSING, "", "no order for BUR", "A BUR D"),)
    assert game.units("FRANCE") == ("A PAR",)


def test_orders_from_a_power_with_nothing_to_order_are_reported() -> None:
    game = burgundy_retreat()
    record = game.step({"GERMANY": ["A BUR H"], "FRANCE": ["A BUR R GAS"]})
    assert _issues(record.issues, "GERMANY") == [(IssueKind.UNORDERABLE, "A BUR H", "")]
    assert _issues(record.issues, "FRANCE") == []
    assert game.units("FRANCE") == ("A GAS", "A PAR")
    assert game.units("GERMANY") == ("A BUR", "A HOL", "A RUH")


def test_a_power_with_only_a_dislodged_unit_is_not_eliminated() -> None:
    game = position({"FRANCE": ["A BUR"], "GERMANY": ["A MUN", "A RUH"]}, {"GERMANY": HOMES["GERMANY"]})
    game.step({"GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR"]})
    assert game.phase == "S1901R"
    assert game.units("FRANCE") == ()
    assert not game.is_eliminated("FRANCE")
    game.step({"FRANCE": ["A BUR D"]})
    assert game.is_eliminated("FRANCE")


# ------------------------------------------------------------------- builds
def _russia_two_builds() -> DiplomacyGame:
    # 5 centres, 2 units, vacant homes SEV and STP: two builds.
    return position({"RUSSIA": ["A MOS", "A WAR"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR", "RUM"]}, phase="W1901A")


def test_builds_are_played() -> None:
    game = _russia_two_builds()
    record = game.step({"RUSSIA": ["f stp/nc b", "A SEV B"]})
    assert record.issues == ()
    assert game.phase == "S1902M"
    assert game.units("RUSSIA") == ("A MOS", "A SEV", "A WAR", "F STP/NC")


def test_second_build_on_one_site_is_a_duplicate_and_the_missing_build_a_waive() -> None:
    game = _russia_two_builds()
    record = game.step({"RUSSIA": ["A STP B", "F STP/NC B"]})
    assert _issues(record.issues, "RUSSIA") == [
        (IssueKind.DUPLICATE, "F STP/NC B", ""),
        (IssueKind.MISSING, "", "WAIVE"),
    ]
    assert game.units("RUSSIA") == ("A MOS", "A STP", "A WAR")


def test_excess_build_orders_are_reported() -> None:
    game = _russia_two_builds()
    record = game.step({"RUSSIA": ["F SEV B", "A STP B", "WAIVE", "F STP/SC B"]})
    # A second order at STP is a DUPLICATE (the more specific reason) even past the build count.
    assert _issues(record.issues, "RUSSIA") == [
        (IssueKind.EXCESS, "WAIVE", ""),
        (IssueKind.DUPLICATE, "F STP/SC B", ""),
    ]
    assert game.units("RUSSIA") == ("A MOS", "A STP", "A WAR", "F SEV")


def test_waive_builds_nothing() -> None:
    game = _russia_two_builds()
    record = game.step({"RUSSIA": ["WAIVE", "A STP B"]})
    assert record.issues == ()
    assert game.units("RUSSIA") == ("A MOS", "A STP", "A WAR")
    assert game.phase == "S1902M"


def test_illegal_builds() -> None:
    game = _russia_two_builds()
    # MOS is occupied, RUM is not a home centre, BER is Germany's.
    record = game.step({"RUSSIA": ["A MOS B", "A RUM B", "A BER B", "A SEV - UKR"]})
    assert [(i.kind, i.order) for i in record.issues] == [
        (IssueKind.ILLEGAL, "A MOS B"),
        (IssueKind.ILLEGAL, "A RUM B"),
        (IssueKind.ILLEGAL, "A BER B"),
        (IssueKind.ILLEGAL, "A SEV - UKR"),
        (IssueKind.MISSING, ""),
        (IssueKind.MISSING, ""),
    ]
    assert game.units("RUSSIA") == ("A MOS", "A WAR")


# ------------------------------------------------------------------ disbands
def _germany_one_disband() -> DiplomacyGame:
    return position({"GERMANY": ["A MUN", "A BER", "F KIE"]}, {"GERMANY": ["BER", "KIE"]}, phase="W1901A")


def test_disband_is_played() -> None:
    game = _germany_one_disband()
    record = game.step({"GERMANY": ["A MUN D"]})
    assert record.issues == ()
    assert game.units("GERMANY") == ("A BER", "F KIE")


def test_excess_and_illegal_disbands() -> None:
    game = _germany_one_disband()
    record = game.step({"GERMANY": ["A BER H", "WAIVE", "F KIE D", "A MUN D"]})
    assert _issues(record.issues, "GERMANY") == [
        (IssueKind.ILLEGAL, "A BER H", ""),
        (IssueKind.ILLEGAL, "WAIVE", ""),  # no waiving a disband
        (IssueKind.EXCESS, "A MUN D", ""),
    ]
    assert game.units("GERMANY") == ("A BER", "A MUN")


def test_missing_disbands_are_reported_and_the_engine_removes_units() -> None:
    # 4 units, 2 centres: two disbands are due and none is ordered.
    game = position({"RUSSIA": ["A MOS", "A WAR", "F SEV", "F STP/SC"]}, {"RUSSIA": ["MOS", "WAR"]}, phase="W1901A")
    record = game.step({})
    # The engine's civil-disorder rule removes the units farthest from home, fleets first on a tie:
    # all four are at home, so both fleets go. The record and the issues name them.
    assert game.phase == "S1902M"
    assert game.units("RUSSIA") == ("A MOS", "A WAR")
    assert record.orders["RUSSIA"] == ("F SEV D", "F STP/SC D")
    assert _issues(record.issues, "RUSSIA") == [
        (IssueKind.MISSING, "", "F SEV D"),
        (IssueKind.MISSING, "", "F STP/SC D"),
    ]


def test_a_partly_ordered_disband_records_both_disbands() -> None:
    game = position({"RUSSIA": ["A MOS", "A WAR", "F SEV", "F STP/SC"]}, {"RUSSIA": ["MOS", "WAR"]}, phase="W1901A")
    record = game.step({"RUSSIA": ["A WAR D"]})
    assert game.units("RUSSIA") == ("A MOS", "F STP/SC")  # F SEV: a fleet, at home like the rest
    assert record.orders["RUSSIA"] == ("A WAR D", "F SEV D")
    assert _issues(record.issues, "RUSSIA") == [(IssueKind.MISSING, "", "F SEV D")]
    assert record.results == {"A WAR": (), "F SEV": ()}


def test_waives_are_recorded_and_have_no_result() -> None:
    game = _russia_two_builds()
    record = game.step({"RUSSIA": ["WAIVE", "A STP B"]})
    assert record.orders["RUSSIA"] == ("A STP B", "WAIVE")
    assert record.results == {"A STP": ()}  # the engine's 'void' entries under a pseudo-unit "WAIVE" are gone
    # A build left out is a WAIVE too, recorded like one ordered.
    game = _russia_two_builds()
    record = game.step({})
    assert record.orders["RUSSIA"] == ("WAIVE", "WAIVE")
    assert _issues(record.issues, "RUSSIA") == [(IssueKind.MISSING, "", "WAIVE")] * 2


# -------------------------------------------------------------- end of game
def test_year_cap_with_a_winter() -> None:
    game = DiplomacyGame(max_year=1901)
    game.step({})
    assert (game.phase, game.is_done) == ("F1901M", False)
    game.step({"RUSSIA": ["F SEV - RUM"]})
    # Russia took RUM and left SEV empty: one build in winter 1901, still inside the cap.
    assert (game.phase, game.is_done) == ("W1901A", False)
    assert game.legal_orders("RUSSIA").locs == ("SEV",)
    game.step({"RUSSIA": ["F SEV B"]})
    assert (game.phase, game.year, game.is_done) == ("S1902M", 1902, True)
    with pytest.raises(GameOverError):
        game.step({})
    assert (game.phase, len(game.history)) == ("S1902M", 3)


def test_year_cap_without_a_winter() -> None:
    game = DiplomacyGame(max_year=1901)
    game.step({})
    game.step({})  # nobody gains or loses a centre: the engine skips winter 1901
    assert (game.phase, game.is_done) == ("S1902M", True)
    assert DiplomacyGame().max_year == 1935


def test_solo_ends_the_game() -> None:
    eighteen = [*HOMES["FRANCE"], "BEL", "HOL", "SPA", "POR", "LON", "LVP", "EDI", "MUN"]
    eighteen += ["KIE", "BER", "DEN", "NWY", "SWE", "TUN", "ROM"]
    assert len(set(eighteen)) == 18
    game = position({"FRANCE": ["A PAR"], "ITALY": ["A VEN"]}, {"FRANCE": eighteen, "ITALY": ["VEN"]})
    assert game.solo_winner() == "FRANCE"
    assert game.is_done
    with pytest.raises(GameOverError):
        game.step({})
    game = position({"FRANCE": ["A PAR"], "ITALY": ["A VEN"]}, {"FRANCE": eighteen[:17], "ITALY": ["VEN"]})
    assert (game.solo_winner(), game.is_done) == (None, False)


def test_second_order_at_a_site_is_a_duplicate_even_with_one_build_due() -> None:
    legal = PowerOrders(
        power="RUSSIA",
        phase="W1901A",
        kind=PhaseKind.BUILD,
        by_loc={"STP": ("A STP B", "F STP/NC B", "F STP/SC B")},
        n_required=1,
    )
    accepted, issues = validate_orders(legal, ["A STP B", "F STP/NC B", "A MOS B", "WAIVE"])
    assert accepted == ["A STP B"]
    assert [(i.kind, i.order) for i in issues] == [
        (IssueKind.DUPLICATE, "F STP/NC B"),
        (IssueKind.ILLEGAL, "A MOS B"),
        (IssueKind.EXCESS, "WAIVE"),
    ]


def test_a_position_with_a_unit_the_engine_does_not_accept_is_refused() -> None:
    with pytest.raises(ValueError, match="not accepted"):
        position({"FRANCE": ["F PAR"]})  # a fleet inland
    game = position({"FRANCE": ["A PAR"]})
    assert game.units("FRANCE") == ("A PAR",) and game.centres("FRANCE") == ("BRE", "MAR", "PAR")
