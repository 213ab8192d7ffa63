"""The unconstrained parser: what it accepts, the reason it gives for everything else, and round trips."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.policy.parser import ParsedOrders, RejectReason, legal_complete, normalise_line, parse_orders

from .states import random_step

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def position(units: Mapping[str, Sequence[str]], centres: Mapping[str, Sequence[str]], phase: str) -> DiplomacyGame:
    """A game with exactly these units and centres (powers not named have none)."""
    state = {
        "name": phase,
        "units": {p: list(units.get(p, ())) for p in POWERS},
        "centers": {p: list(centres.get(p, ())) for p in POWERS},
    }
    game = DiplomacyGame.from_state(state)
    assert not game.engine.error, game.engine.error
    return game


def parse(text: str, legal: PowerOrders) -> ParsedOrders:
    return parse_orders(text, legal)


def reasons(parsed: ParsedOrders) -> list[str]:
    return [r.reason for r in parsed.rejected]


@pytest.fixture(scope="module")
def france() -> PowerOrders:
    """FRANCE at S1901M: A MAR, A PAR, F BRE."""
    return DiplomacyGame().legal_orders("FRANCE")


@pytest.fixture(scope="module")
def coasts() -> DiplomacyGame:
    """F MAO reaches both coasts of SPA; F WES only the south one; F STP/NC reaches BAR and NWY."""
    return position(
        {"FRANCE": ["F MAO", "F WES", "A GAS"], "RUSSIA": ["F STP/NC"]},
        {"FRANCE": ["BRE", "MAR", "PAR"], "RUSSIA": ["MOS", "SEV", "STP", "WAR"]},
        "S1901M",
    )


@pytest.fixture(scope="module")
def builds() -> PowerOrders:
    """RUSSIA in W1901A: 5 centres, 3 units away from home, so 2 builds at 4 vacant sites."""
    game = position({"RUSSIA": ["A RUM", "A UKR", "A LVN"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR", "RUM"]}, "W1901A")
    legal = game.legal_orders("RUSSIA")
    assert legal.kind is PhaseKind.BUILD and legal.n_required == 2 and legal.locs == ("MOS", "SEV", "STP", "WAR")
    return legal


@pytest.fixture(scope="module")
def disbands() -> PowerOrders:
    """FRANCE in W1901A: 1 centre, 2 units, so 1 disband."""
    game = position({"FRANCE": ["A PAR", "A MAR"]}, {"FRANCE": ["PAR"]}, "W1901A")
    legal = game.legal_orders("FRANCE")
    assert legal.kind is PhaseKind.DISBAND and legal.n_required == 1
    return legal


# ------------------------------------------------------------------------------------- accepted
def test_canonical_completion(france: PowerOrders) -> None:
    parsed = parse("A PAR - BUR\nF BRE - MAO\nA MAR H\n</orders>", france)
    assert parsed.orders == ["A PAR - BUR", "F BRE - MAO", "A MAR H"]
    assert parsed.rejected == [] and parsed.missing == [] and parsed.closed
    assert legal_complete(parsed, france)


@pytest.mark.parametrize(
    ("line", "canonical"),
    [
        ("a par  -  bur", "A PAR - BUR"),
        ("A PAR-BUR", "A PAR - BUR"),
        ("A PAR -> BUR", "A PAR - BUR"),
        ("A PAR->BUR", "A PAR - BUR"),
        ("A PAR HOLD", "A PAR H"),
        ("A PAR HOLDS", "A PAR H"),
        ("a par holds", "A PAR H"),
        ("A PAR S A MAR-BUR", "A PAR S A MAR - BUR"),
        ("A PAR SUPPORTS A MAR - BUR", "A PAR S A MAR - BUR"),
        ("1. A PAR - BUR", "A PAR - BUR"),
        ("2) A PAR - BUR", "A PAR - BUR"),
        ("- A PAR - BUR", "A PAR - BUR"),
        ("* A PAR - BUR", "A PAR - BUR"),
        ("   A PAR - BUR.  ", "A PAR - BUR"),
        ("\tA PAR\t-\tBUR", "A PAR - BUR"),
    ],
)
def test_common_variants_map_to_canonical(france: PowerOrders, line: str, canonical: str) -> None:
    parsed = parse(f"<orders>\n{line}\n</orders>", france)
    assert parsed.orders == [canonical], parsed.rejected
    assert parsed.rejected == []


def test_normalise_line_alone() -> None:
    assert normalise_line("  3. f stp/nc->bar ") == "F STP/NC - BAR"
    assert normalise_line("") == ""


def test_blank_lines_are_ignored(france: PowerOrders) -> None:
    parsed = parse("\n\nA PAR - BUR\n   \n\nF BRE H\n\nA MAR H\n\n</orders>", france)
    assert parsed.orders == ["A PAR - BUR", "F BRE H", "A MAR H"] and parsed.rejected == []
    assert legal_complete(parsed, france)


def test_text_before_the_open_tag_is_ignored(france: PowerOrders) -> None:
    text = "Let me think. A PAR - PIC looks weak.\nA MAR - MUN\n<orders>\nA PAR - BUR\nF BRE H\nA MAR H\n</orders>"
    parsed = parse(text, france)
    assert parsed.orders == ["A PAR - BUR", "F BRE H", "A MAR H"] and parsed.rejected == []
    assert legal_complete(parsed, france)


def test_reasoning_that_mentions_the_tag_is_ignored(france: PowerOrders) -> None:
    text = (
        "<think>\nI will write <orders> then A MAR - MUN.\n</think>\n\n<orders>\nA PAR H\nF BRE H\nA MAR H\n</orders>"
    )
    parsed = parse(text, france)
    assert parsed.orders == ["A PAR H", "F BRE H", "A MAR H"] and parsed.rejected == []


def test_tags_on_the_same_line_as_orders(france: PowerOrders) -> None:
    parsed = parse("<ORDERS>A PAR - BUR\nF BRE H\nA MAR H</orders>", france)
    assert parsed.orders == ["A PAR - BUR", "F BRE H", "A MAR H"] and parsed.closed and parsed.rejected == []


def test_without_tags_every_line_is_read(france: PowerOrders) -> None:
    parsed = parse("A PAR - BUR\nF BRE H\nA MAR H", france)
    assert parsed.orders == ["A PAR - BUR", "F BRE H", "A MAR H"] and parsed.rejected == []
    assert not parsed.closed
    assert not legal_complete(parsed, france)


def test_chat_end_markers_after_the_close_are_not_content(france: PowerOrders) -> None:
    parsed = parse("A PAR H\nF BRE H\nA MAR H\n</orders><|im_end|>\n<|endoftext|>", france)
    assert parsed.rejected == [] and legal_complete(parsed, france)


# ------------------------------------------------------------------------------------- rejected
def test_not_an_order(france: PowerOrders) -> None:
    parsed = parse("Here are my orders:\nA PAR - BUR\nA PAR attacks BUR!\n</orders>", france)
    assert parsed.orders == ["A PAR - BUR"]
    assert [(r.line, r.reason) for r in parsed.rejected] == [
        ("Here are my orders:", "not_an_order"),
        ("A PAR attacks BUR!", "not_an_order"),
    ]


def test_illegal_distinguishes_no_unit_from_a_bad_order_for_the_unit(france: PowerOrders) -> None:
    lines = ["A MUN - RUH", "A BUR - PAR", "F PAR - BUR", "A PAR - MUN", "A PAR S A MAR - PIE", "F BRE C A PAR - LON"]
    parsed = parse("\n".join(lines), france)
    assert parsed.orders == []
    assert reasons(parsed) == ["illegal"] * len(lines)
    messages = [r.message for r in parsed.rejected]
    assert messages[0] == "no unit of FRANCE at MUN"
    assert messages[1] == "no unit of FRANCE at BUR"
    assert messages[2] == "FRANCE's unit at PAR is A PAR, not F PAR"
    assert messages[3] == "A PAR cannot move to MUN"
    assert messages[4] == "not a legal order for A PAR in S1901M"
    assert messages[5] == "not a legal order for F BRE in S1901M"
    assert [r.line for r in parsed.rejected] == lines


def test_order_of_the_wrong_phase_type(france: PowerOrders, disbands: PowerOrders) -> None:
    parsed = parse("A PAR R GAS\nA PAR B\n", france)
    assert reasons(parsed) == ["illegal", "illegal"]
    assert "a retreat order is not allowed in a movement phase" in parsed.rejected[0].message
    assert "a build order is not allowed in a movement phase" in parsed.rejected[1].message
    parsed = parse("A PAR H\n", disbands)
    assert reasons(parsed) == ["illegal"]
    assert "a hold order is not allowed in a disband phase" in parsed.rejected[0].message


def test_duplicate(france: PowerOrders) -> None:
    parsed = parse("A PAR - BUR\nA PAR H\nA PAR - BUR\nF BRE H\nA MAR H\n</orders>", france)
    assert parsed.orders == ["A PAR - BUR", "F BRE H", "A MAR H"]
    assert [(r.line, r.reason) for r in parsed.rejected] == [("A PAR H", "duplicate"), ("A PAR - BUR", "duplicate")]
    assert "PAR already ordered: 'A PAR - BUR'" in parsed.rejected[0].message
    assert not legal_complete(parsed, france)


def test_excess_in_adjustments(builds: PowerOrders, disbands: PowerOrders) -> None:
    parsed = parse("A MOS B\nA WAR B\nA SEV B\nWAIVE\n</orders>", builds)
    assert parsed.orders == ["A MOS B", "A WAR B"]
    assert [(r.line, r.reason) for r in parsed.rejected] == [("A SEV B", "excess"), ("WAIVE", "excess")]
    assert "takes 2 build order(s)" in parsed.rejected[0].message
    parsed = parse("A MAR D\nA PAR D\n</orders>", disbands)
    assert parsed.orders == ["A MAR D"] and reasons(parsed) == ["excess"]


def test_duplicate_is_reported_before_excess(builds: PowerOrders) -> None:
    parsed = parse("A MOS B\nA WAR B\nA MOS B\n</orders>", builds)
    assert reasons(parsed) == ["duplicate"]


def test_after_close(france: PowerOrders) -> None:
    parsed = parse("A PAR H\nF BRE H\nA MAR H\n</orders>\nA PAR - BUR\n\nThat is all.", france)
    assert parsed.orders == ["A PAR H", "F BRE H", "A MAR H"]
    assert [(r.line, r.reason) for r in parsed.rejected] == [
        ("A PAR - BUR", "after_close"),
        ("That is all.", "after_close"),
    ]
    assert not legal_complete(parsed, france)


def test_every_reason_code_is_a_plain_string(france: PowerOrders) -> None:
    assert {r.value for r in RejectReason} == {
        "not_an_order", "illegal", "ambiguous_coast", "duplicate", "excess", "after_close"
    }  # fmt: skip
    parsed = parse("hello\n</orders>", france)
    assert parsed.rejected[0].reason == "not_an_order"


# ---------------------------------------------------------------------------------------- coasts
def test_coast_omitted_when_only_one_is_legal(coasts: DiplomacyGame) -> None:
    france = coasts.legal_orders("FRANCE")
    assert "F WES - SPA/SC" in france.by_loc["WES"] and "F WES - SPA/NC" not in france.by_loc["WES"]
    parsed = parse("F WES - SPA\n", france)
    assert parsed.orders == ["F WES - SPA/SC"] and parsed.rejected == []


def test_coast_omitted_when_both_are_legal_is_ambiguous(coasts: DiplomacyGame) -> None:
    france = coasts.legal_orders("FRANCE")
    assert {"F MAO - SPA/NC", "F MAO - SPA/SC"} <= set(france.by_loc["MAO"])
    parsed = parse("F MAO - SPA\nF MAO - SPA/NC\n", france)
    assert parsed.orders == ["F MAO - SPA/NC"]
    assert reasons(parsed) == ["ambiguous_coast"]
    assert "F MAO - SPA/NC or F MAO - SPA/SC" in parsed.rejected[0].message


def test_wrong_coast_is_illegal(coasts: DiplomacyGame) -> None:
    parsed = parse("F WES - SPA/NC\n", coasts.legal_orders("FRANCE"))
    assert reasons(parsed) == ["illegal"]


def test_exact_support_without_coast_is_kept_as_written(coasts: DiplomacyGame) -> None:
    """The engine lists both 'S F MAO - SPA' and the coasted forms: the written one is taken as is."""
    parsed = parse("A GAS S F MAO - SPA\n", coasts.legal_orders("FRANCE"))
    assert parsed.orders == ["A GAS S F MAO - SPA"] and parsed.rejected == []


def test_unit_coast_omitted(coasts: DiplomacyGame) -> None:
    russia = coasts.legal_orders("RUSSIA")
    parsed = parse("f stp - bar\n</orders>", russia)
    assert parsed.orders == ["F STP/NC - BAR"] and legal_complete(parsed, russia)
    parsed = parse("F STP/SC - BAR\n", russia)
    assert reasons(parsed) == ["illegal"]
    assert parsed.rejected[0].message == "RUSSIA's unit at STP is F STP/NC, not F STP/SC"


def test_build_fleet_without_coast_is_ambiguous(builds: PowerOrders) -> None:
    parsed = parse("F STP B\nF STP/NC B\n</orders>", builds)
    assert reasons(parsed) == ["ambiguous_coast"]
    assert parsed.orders == ["F STP/NC B"]


# ----------------------------------------------------------------------------------------- WAIVE
def test_waive_rejected_in_movement(france: PowerOrders) -> None:
    parsed = parse("WAIVE\nA PAR H\n", france)
    assert parsed.orders == ["A PAR H"]
    assert reasons(parsed) == ["illegal"] and "WAIVE is only for builds" in parsed.rejected[0].message


def test_waive_rejected_in_disbands(disbands: PowerOrders) -> None:
    parsed = parse("WAIVE\n", disbands)
    assert reasons(parsed) == ["illegal"]


def test_waive_accepted_in_builds(builds: PowerOrders) -> None:
    parsed = parse("waive\nF SEV B\n</orders>", builds)
    assert parsed.orders == ["WAIVE", "F SEV B"] and parsed.rejected == []
    assert legal_complete(parsed, builds)
    parsed = parse("WAIVE\nWAIVE\n</orders>", builds)
    assert parsed.orders == ["WAIVE", "WAIVE"] and legal_complete(parsed, builds)


# -------------------------------------------------------------------------------- completeness
def test_missing_units(france: PowerOrders) -> None:
    parsed = parse("A PAR - BUR\n</orders>", france)
    assert parsed.missing == ["BRE", "MAR"] and parsed.n_missing == 2
    assert not legal_complete(parsed, france)


def test_missing_in_adjustments_only_while_short(builds: PowerOrders, disbands: PowerOrders) -> None:
    parsed = parse("A MOS B\n</orders>", builds)
    assert parsed.n_missing == 1 and parsed.missing == ["SEV", "STP", "WAR"]
    assert not legal_complete(parsed, builds)
    parsed = parse("A MOS B\nA WAR B\n</orders>", builds)
    assert parsed.n_missing == 0 and parsed.missing == [] and legal_complete(parsed, builds)
    parsed = parse("</orders>", disbands)
    assert parsed.missing == ["MAR", "PAR"] and not legal_complete(parsed, disbands)
    assert legal_complete(parse("A PAR D\n</orders>", disbands), disbands)


def test_legal_complete_cases(france: PowerOrders) -> None:
    full = "A PAR - BUR\nF BRE - MAO\nA MAR H\n"
    assert legal_complete(parse(full + "</orders>", france), france)
    assert not legal_complete(parse(full, france), france)  # never closed
    assert not legal_complete(parse(full + "junk\n</orders>", france), france)  # a rejected line
    assert not legal_complete(parse("A PAR - BUR\nF BRE - MAO\n</orders>", france), france)  # a unit missing
    assert not legal_complete(parse("", france), france)


def test_power_with_nothing_to_order() -> None:
    game = position({"FRANCE": ["A PAR"], "RUSSIA": ["A MOS"]}, {"FRANCE": ["PAR"], "RUSSIA": ["MOS", "WAR"]}, "W1901A")
    legal = game.legal_orders("FRANCE")  # as many units as centres: nothing to adjust
    assert legal.kind is PhaseKind.NONE
    assert legal_complete(parse("</orders>", legal), legal)
    parsed = parse("A PAR H\n</orders>", legal)
    assert reasons(parsed) == ["illegal"] and "nothing to order" in parsed.rejected[0].message


# ------------------------------------------------------------------------------------ round trip
@lru_cache(maxsize=1)
def decision_states() -> tuple[PowerOrders, ...]:
    """Every orderable (power, phase) of a few seeded random games: all four phase kinds occur."""
    states: list[PowerOrders] = []
    for seed in range(4):
        rng = random.Random(seed)
        game = DiplomacyGame(max_year=1912)
        while not game.is_done:
            states += [lo for lo in game.all_legal_orders().values() if lo.kind is not PhaseKind.NONE]
            random_step(game, rng)
    kinds = {lo.kind for lo in states}
    assert {PhaseKind.MOVEMENT, PhaseKind.BUILD, PhaseKind.DISBAND} <= kinds, kinds
    # Random play rarely dislodges: add the retreats of further seeds so every kind is covered.
    seed = 100
    while PhaseKind.RETREAT not in kinds:
        rng, game = random.Random(seed), DiplomacyGame(max_year=1912)
        while not game.is_done and PhaseKind.RETREAT not in kinds:
            retreats = [lo for lo in game.all_legal_orders().values() if lo.kind is PhaseKind.RETREAT]
            states += retreats
            kinds |= {lo.kind for lo in retreats}
            random_step(game, rng)
        seed += 1
    return tuple(states)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_of_random_legal_completions(data: st.DataObject) -> None:
    states = decision_states()
    legal = states[data.draw(st.integers(0, len(states) - 1), label="state")]
    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        locs = data.draw(st.permutations(legal.locs), label="unit order")
    else:
        pool = list(legal.locs) + (["WAIVE"] * legal.n_required if legal.allows_waive else [])
        locs = data.draw(st.permutations(pool), label="sites")[: legal.n_required]
    orders = [loc if loc == "WAIVE" else data.draw(st.sampled_from(legal.by_loc[loc]), label=loc) for loc in locs]
    parsed = parse_orders("\n".join(orders) + "\n</orders>", legal)
    assert parsed.orders == orders
    assert parsed.rejected == [] and parsed.missing == [] and parsed.closed
    assert legal_complete(parsed, legal)


def test_round_trip_states_cover_every_phase_kind() -> None:
    assert {lo.kind for lo in decision_states()} == {
        PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND
    }  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_through_accepted_variants(data: st.DataObject) -> None:
    """Lower case, list numbering, arrows and extra spaces change nothing about what is read."""
    states = [lo for lo in decision_states() if lo.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT)]
    legal = states[data.draw(st.integers(0, len(states) - 1), label="state")]
    orders = [data.draw(st.sampled_from(legal.by_loc[loc]), label=loc) for loc in legal.locs]
    lines = []
    for i, order in enumerate(orders, 1):
        line = order.replace(" - ", data.draw(st.sampled_from([" - ", "-", " -> ", "  -  "]), label="arrow"))
        line = line.lower() if data.draw(st.booleans(), label="lower") else line
        lines.append(data.draw(st.sampled_from(["", f"{i}. ", "- ", "* "]), label="bullet") + line)
    parsed = parse_orders("<orders>\n" + "\n".join(lines) + "\n</orders>", legal)
    assert parsed.orders == orders and parsed.rejected == []
    assert legal_complete(parsed, legal)
