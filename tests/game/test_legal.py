"""Legal-order lists for every phase kind, on positions that can be checked against a map by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, compute_legal_orders

from .positions import POWERS, burgundy_retreat, position

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ movement
def test_opening_movement_lists() -> None:
    game = DiplomacyGame()
    legal = game.all_legal_orders()
    assert tuple(legal) == POWERS
    assert game.orderable_powers() == POWERS
    n_units = {"RUSSIA": 4}
    for power in POWERS:
        assert legal[power].kind is PhaseKind.MOVEMENT
        assert legal[power].phase == "S1901M"
        assert legal[power].n_required == n_units.get(power, 3)
    assert legal["FRANCE"].locs == ("BRE", "MAR", "PAR")
    assert legal["RUSSIA"].locs == ("MOS", "SEV", "STP", "WAR")
    # PAR borders BRE, BUR, GAS and PIC; it can support F BRE holding or moving to GAS/PIC, and
    # A MAR or A MUN into BUR, A MAR into GAS. Nothing else (no WAIVE, no foreign province).
    assert legal["FRANCE"].by_loc["PAR"] == (
        "A PAR - BRE",
        "A PAR - BUR",
        "A PAR - GAS",
        "A PAR - PIC",
        "A PAR H",
        "A PAR S A MAR - BUR",
        "A PAR S A MAR - GAS",
        "A PAR S A MUN - BUR",
        "A PAR S F BRE",
        "A PAR S F BRE - GAS",
        "A PAR S F BRE - PIC",
    )
    # The fleet in St Petersburg is on the south coast and its orders name the coast.
    assert legal["RUSSIA"].by_loc["STP"] == (
        "F STP/SC - BOT",
        "F STP/SC - FIN",
        "F STP/SC - LVN",
        "F STP/SC H",
        "F STP/SC S A MOS - LVN",
        "F STP/SC S A WAR - LVN",
    )


def test_lists_are_sorted_and_indexed() -> None:
    legal = DiplomacyGame().all_legal_orders()
    for power_orders in legal.values():
        assert list(power_orders.locs) == sorted(power_orders.locs)
        for loc, orders in power_orders.by_loc.items():
            assert list(orders) == sorted(orders)
            assert "WAIVE" not in orders
            assert all(power_orders.loc_of[o] == loc for o in orders)
        assert power_orders.num_orders() == len(power_orders.loc_of)
    assert legal["FRANCE"].num_orders() == 9 + 10 + 11  # BRE, MAR, PAR
    assert not legal["FRANCE"].allows_waive


def test_default_orders_are_holds_in_movement() -> None:
    legal = DiplomacyGame().all_legal_orders()
    assert legal["FRANCE"].default_order("PAR") == "A PAR H"
    assert legal["RUSSIA"].default_order("STP") == "F STP/SC H"


def test_convoy_orders_and_via_moves() -> None:
    game = position({"ENGLAND": ["F NTH", "A YOR"]})
    legal = game.legal_orders("ENGLAND")
    assert "F NTH C A YOR - NWY" in legal.by_loc["NTH"]
    assert "A YOR - NWY VIA" in legal.by_loc["YOR"]
    assert "A YOR - NWY" not in legal.by_loc["YOR"]  # YOR and NWY are not adjacent
    assert {"A YOR - EDI", "A YOR - EDI VIA"} <= set(legal.by_loc["YOR"])  # by land or by sea
    record = game.step({"ENGLAND": ["A YOR - NWY VIA", "F NTH C A YOR - NWY"]})
    assert record.issues == ()
    assert game.units("ENGLAND") == ("A NWY", "F NTH")


def test_powers_without_units_have_nothing_to_order() -> None:
    game = position({"ENGLAND": ["F NTH"]})
    assert game.orderable_powers() == ("ENGLAND",)
    for power in POWERS:
        if power != "ENGLAND":
            legal = game.legal_orders(power)
            assert (legal.kind, dict(legal.by_loc), legal.n_required) == (PhaseKind.NONE, {}, 0)


# ------------------------------------------------------------------- retreat
def test_only_the_dislodged_unit_is_orderable_in_a_retreat_phase() -> None:
    game = burgundy_retreat()
    assert game.orderable_powers() == ("FRANCE",)
    france = game.legal_orders("FRANCE")
    assert france.kind is PhaseKind.RETREAT
    assert france.n_required == 1
    # Not MUN (the attacker's origin), RUH and PAR (occupied) nor BEL (standoff).
    assert dict(france.by_loc) == {"BUR": ("A BUR D", "A BUR R GAS", "A BUR R MAR", "A BUR R PIC")}
    assert france.default_order("BUR") == "A BUR D"
    assert not france.allows_waive
    assert game.dislodged("FRANCE") == {"A BUR": ("GAS", "MAR", "PIC")}
    assert game.units("FRANCE") == ("A PAR",)  # the dislodged unit is not on the board
    # The attacker now stands in BUR and has no order to give.
    assert game.units("GERMANY") == ("A BUR", "A HOL", "A RUH")
    germany = game.legal_orders("GERMANY")
    assert (germany.kind, dict(germany.by_loc), germany.n_required) == (PhaseKind.NONE, {}, 0)
    assert game.dislodged("GERMANY") == {}


def test_dislodged_unit_with_no_retreat_is_destroyed_and_the_retreat_phase_skipped() -> None:
    # SYR borders only ARM, SMY (and the sea): the attack comes from SMY and ARM is occupied.
    game = position({"TURKEY": ["A SYR"], "RUSSIA": ["A SMY", "A ARM"]})
    record = game.step({"RUSSIA": ["A SMY - SYR", "A ARM S A SMY - SYR"], "TURKEY": ["A SYR H"]})
    assert record.results["A SYR"] == ("dislodged",)
    assert game.phase == "F1901M"
    assert game.units("TURKEY") == ()
    assert game.dislodged("TURKEY") == {}


# ------------------------------------------------------------------- builds
def test_builds_on_a_coasted_home_centre() -> None:
    # 5 centres, 2 units: 3 builds allowed, but only SEV and STP are vacant owned homes.
    game = position({"RUSSIA": ["A MOS", "A WAR"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR", "RUM"]}, phase="W1901A")
    assert game.orderable_powers() == ("RUSSIA",)
    russia = game.legal_orders("RUSSIA")
    assert russia.kind is PhaseKind.BUILD
    assert russia.n_required == 2  # min(3 builds, 2 sites)
    assert dict(russia.by_loc) == {
        "SEV": ("A SEV B", "F SEV B"),
        "STP": ("A STP B", "F STP/NC B", "F STP/SC B"),
    }
    assert russia.allows_waive
    assert russia.default_order("STP") == "WAIVE"


def test_builds_limited_by_sites() -> None:
    # 5 centres, 3 units: 2 builds allowed, STP is the only vacant home.
    game = position(
        {"RUSSIA": ["A MOS", "A WAR", "A SEV"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR", "RUM"]}, phase="W1901A"
    )
    russia = game.legal_orders("RUSSIA")
    assert (russia.kind, russia.n_required) == (PhaseKind.BUILD, 1)
    assert dict(russia.by_loc) == {"STP": ("A STP B", "F STP/NC B", "F STP/SC B")}


def test_builds_limited_by_centres() -> None:
    # 4 centres, 3 units (one outside home): 1 build, two vacant homes to choose from.
    game = position({"RUSSIA": ["A MOS", "A WAR", "A UKR"]}, {"RUSSIA": ["MOS", "SEV", "STP", "WAR"]}, phase="W1901A")
    russia = game.legal_orders("RUSSIA")
    assert (russia.kind, russia.n_required, russia.locs) == (PhaseKind.BUILD, 1, ("SEV", "STP"))


def test_no_build_on_a_lost_home_or_without_a_vacant_home() -> None:
    # WAR is vacant but German-owned: no build there.
    lost = position({"RUSSIA": ["A MOS"]}, {"RUSSIA": ["MOS", "SEV", "STP", "RUM"], "GERMANY": ["WAR"]}, phase="W1901A")
    assert lost.legal_orders("RUSSIA").locs == ("SEV", "STP")
    assert lost.legal_orders("RUSSIA").n_required == 2
    # A build is due but every home is occupied: nothing to order.
    full = position(
        {"RUSSIA": ["A MOS", "A STP", "A SEV", "A WAR", "A UKR"]},
        {"RUSSIA": ["MOS", "SEV", "STP", "WAR", "RUM", "SWE"]},
        phase="W1901A",
    )
    russia = full.legal_orders("RUSSIA")
    assert (russia.kind, dict(russia.by_loc), russia.n_required) == (PhaseKind.NONE, {}, 0)
    assert full.orderable_powers() == ()


# ------------------------------------------------------------------ disbands
def test_disbands() -> None:
    # 3 units, 2 centres (MUN lost): one disband, any unit may go.
    game = position({"GERMANY": ["A MUN", "A BER", "F KIE"]}, {"GERMANY": ["BER", "KIE"]}, phase="W1901A")
    germany = game.legal_orders("GERMANY")
    assert germany.kind is PhaseKind.DISBAND
    assert germany.n_required == 1
    assert dict(germany.by_loc) == {"BER": ("A BER D",), "KIE": ("F KIE D",), "MUN": ("A MUN D",)}
    assert not germany.allows_waive
    assert germany.default_order("MUN") == ""
    assert game.orderable_powers() == ("GERMANY",)


def test_disbands_of_a_coasted_fleet() -> None:
    game = position({"RUSSIA": ["A MOS", "A WAR", "F SEV", "F STP/SC"]}, {"RUSSIA": ["MOS", "WAR"]}, phase="W1901A")
    russia = game.legal_orders("RUSSIA")
    assert (russia.kind, russia.n_required) == (PhaseKind.DISBAND, 2)  # 4 units - 2 centres
    assert russia.by_loc["STP"] == ("F STP/SC D",)


def test_balanced_power_has_nothing_to_adjust() -> None:
    game = position({"FRANCE": ["A PAR", "A MAR", "F BRE"]}, phase="W1901A")
    assert game.legal_orders("FRANCE").kind is PhaseKind.NONE
    # Powers with home centres but no units build in their empty homes.
    assert game.legal_orders("ITALY").kind is PhaseKind.BUILD
    assert game.legal_orders("ITALY").n_required == 3


# -------------------------------------------------------------- hash seeds
_HASH_SCRIPT = """
import hashlib, random
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, compute_legal_orders
game, rng = DiplomacyGame(), random.Random(11)
ours, raw = hashlib.sha256(), hashlib.sha256()
while game.year <= 1902:
    legal = compute_legal_orders(game.engine)
    ours.update(repr(legal).encode())
    raw.update(repr(sorted(game.engine.get_all_possible_orders().items())).encode())
    orders = {}
    for power, po in legal.items():
        if po.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
            orders[power] = [rng.choice(v) for v in po.by_loc.values()]
        elif po.kind is not PhaseKind.NONE:
            orders[power] = [rng.choice(po.by_loc[loc]) for loc in rng.sample(sorted(po.by_loc), po.n_required)]
    game.step(orders)
print(game.phase, ours.hexdigest(), raw.hexdigest())
"""


def _run_with_hash_seed(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_legal_lists_do_not_depend_on_the_hash_seed() -> None:
    phase_0, ours_0, raw_0 = _run_with_hash_seed("0")
    phase_1, ours_1, raw_1 = _run_with_hash_seed("1")
    assert phase_0 == phase_1 == "S1903M"
    assert ours_0 == ours_1
    # The engine's own lists do change with the seed: this is what the sorting is for.
    assert raw_0 != raw_1


def test_compute_legal_orders_matches_the_cached_lists() -> None:
    game = burgundy_retreat()
    assert compute_legal_orders(game.engine) == game.all_legal_orders()
    assert game.all_legal_orders() is game.all_legal_orders()  # computed once per phase


def test_power_orders_round_trip_through_plain_data() -> None:
    legal = DiplomacyGame().legal_orders("RUSSIA")
    restored = PowerOrders.from_dict(json.loads(json.dumps(legal.to_dict())))
    assert restored == legal and restored.signature == legal.signature


@pytest.mark.parametrize(
    "broken",
    [
        {},
        {"power": "RUSSIA", "phase": "S1901M", "kind": "dance", "n_required": 1, "by_loc": {"MOS": ["A MOS H"]}},
        {"power": "RUSSIA", "phase": "S1901M", "kind": "movement", "n_required": 3, "by_loc": {"MOS": ["A MOS H"]}},
        {"power": "RUSSIA", "phase": "S1901M", "kind": "movement", "n_required": 1, "by_loc": {"MOS": []}},
        {"power": "RUSSIA", "phase": "S1901M", "kind": "movement", "n_required": "x", "by_loc": {}},
    ],
)
def test_malformed_power_orders_payload_is_a_clear_error(broken: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="malformed legal-orders payload"):
        PowerOrders.from_dict(broken)
