"""The map graph against facts of the standard map and the engine's own legal moves."""

from __future__ import annotations

from diprl.game import DiplomacyGame
from diprl.game.mapgraph import map_graph
from diprl.game.orders import MOVE, parse_order

from .positions import HOMES


def test_nodes() -> None:
    g = map_graph()
    assert map_graph() is g  # built once per process
    nodes = set(g.nodes)
    assert {"A STP", "F STP/NC", "F STP/SC", "A PAR", "F BRE", "F NTH"} <= nodes
    assert not {"F STP", "F SPA", "A NTH", "F MUN", "F PAR"} & nodes  # coasts only; no armies at sea, no inland fleets
    assert len(g.supply_centres) == 34
    assert len(g.provinces) == 76  # the 75 playable provinces and impassable Switzerland
    assert (g.province_type["SWI"], g.province_nodes["SWI"]) == ("SHUT", ())
    assert g.home_centres["RUSSIA"] == HOMES["RUSSIA"]
    assert g.node_province[g.node_index["F STP/NC"]] == "STP"
    assert {g.nodes[i] for i in g.province_nodes["SPA"]} == {"A SPA", "F SPA/NC", "F SPA/SC"}


def test_reachable_provinces() -> None:
    g = map_graph()
    assert g.reachable_provinces("A PAR") == {"BRE", "BUR", "GAS", "PIC"}
    assert g.reachable_provinces("F STP/NC") == {"BAR", "NWY"}
    assert g.reachable_provinces("F STP/SC") == {"BOT", "FIN", "LVN"}
    assert g.reachable_provinces("F BRE") == {"ENG", "GAS", "MAO", "PIC"}  # not PAR: inland


def test_distances() -> None:
    g = map_graph()
    assert g.distance_to("A PAR", frozenset({"PAR"})) == 0
    assert g.distance_to("A PAR", frozenset({"MUN"})) == 2  # PAR - BUR - MUN
    assert g.distance_to("A PAR", frozenset({"MUN", "BUR"})) == 1
    assert g.distance_to("A PAR", frozenset({"NTH"})) == 99  # armies never reach the sea
    assert g.distance_to("F STP/NC", frozenset({"BOT"})) > g.distance_to("F STP/SC", frozenset({"BOT"})) == 1


def test_edges_match_the_engine_on_the_opening_board() -> None:
    g = map_graph()
    game = DiplomacyGame()
    for power in game.powers:
        for orders in game.legal_orders(power).by_loc.values():
            parsed = [parse_order(o) for o in orders]
            unit = parsed[0].unit
            targets = {o.target_province for o in parsed if o.kind == MOVE and not o.via}
            assert targets == g.reachable_provinces(unit), unit
