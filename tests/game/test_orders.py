"""`parse_order` on every order kind of the engine's canonical syntax."""

from __future__ import annotations

import pytest

from diprl.game.orders import Order, OrderSyntaxError, parse_order


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A PAR H", Order(text="A PAR H", kind="H", unit="A PAR")),
        ("A PAR - BUR", Order(text="A PAR - BUR", kind="-", unit="A PAR", target="BUR")),
        ("F MAO - SPA/NC", Order(text="F MAO - SPA/NC", kind="-", unit="F MAO", target="SPA/NC")),
        ("A YOR - NWY VIA", Order(text="A YOR - NWY VIA", kind="-", unit="A YOR", target="NWY", via=True)),
        ("A MOS S F STP/SC", Order(text="A MOS S F STP/SC", kind="S", unit="A MOS", supported_unit="F STP/SC")),
        (
            "A RUH S A MUN - BUR",
            Order(text="A RUH S A MUN - BUR", kind="S", unit="A RUH", supported_unit="A MUN", supported_target="BUR"),
        ),
        (
            "F NTH C A YOR - NWY",
            Order(text="F NTH C A YOR - NWY", kind="C", unit="F NTH", supported_unit="A YOR", supported_target="NWY"),
        ),
        ("A BUR R PIC", Order(text="A BUR R PIC", kind="R", unit="A BUR", target="PIC")),
        ("A BUR D", Order(text="A BUR D", kind="D", unit="A BUR")),
        ("F STP/NC B", Order(text="F STP/NC B", kind="B", unit="F STP/NC")),
        ("WAIVE", Order(text="WAIVE", kind="WAIVE")),
    ],
)
def test_parse_every_order_kind(text: str, expected: Order) -> None:
    assert parse_order(text) == expected


def test_derived_fields() -> None:
    build = parse_order("F STP/NC B")
    assert (build.loc, build.unit) == ("STP", "F STP/NC")
    move = parse_order("F MAO - SPA/NC")
    assert (move.loc, move.target_province) == ("MAO", "SPA")
    support_move = parse_order("A RUH S A MUN - BUR")
    assert (support_move.supports_move, support_move.supports_hold) == (True, False)
    support_hold = parse_order("A MOS S F STP/SC")
    assert (support_hold.supports_move, support_hold.supports_hold) == (False, True)
    convoy = parse_order("F NTH C A YOR - NWY")
    assert (convoy.supports_move, convoy.supports_hold) == (False, False)
    assert parse_order("WAIVE").loc == ""


@pytest.mark.parametrize(
    "text",
    [
        "",
        "A PAR",  # no action
        "X PAR H",  # no unit type
        "PAR - BUR",  # unit type missing
        "A PAR - BUR FOO",  # junk after a move
        "A PAR H H",  # hold takes no argument
        "A PAR -",  # move without a target
        "F NTH C A YOR",  # a convoy needs a destination
        "A RUH S MUN - BUR",  # supported unit without its type
        "A RUH S A MUN BUR",  # missing '-'
        "A PAR X BUR",  # unknown action
        "waive",  # parse_order takes canonical (upper-case) text only
    ],
)
def test_syntax_errors(text: str) -> None:
    with pytest.raises(OrderSyntaxError):
        parse_order(text)


def test_syntax_error_is_a_value_error() -> None:
    assert issubclass(OrderSyntaxError, ValueError)
