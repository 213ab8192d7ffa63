"""The map as a graph of unit positions, built once per process for bots and prompts.

Nodes are unit positions ("A PAR", "F BRE", and for coasted provinces only the coasts:
"F SPA/NC", "F SPA/SC"). Edges are same-unit-type moves, as the engine's adjacency defines them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from diplomacy import Map


@dataclass(frozen=True)
class MapGraph:
    name: str
    provinces: tuple[str, ...]
    supply_centres: frozenset[str]
    home_centres: dict[str, tuple[str, ...]]
    nodes: tuple[str, ...]
    node_index: dict[str, int]
    node_province: tuple[str, ...]
    neighbours: tuple[tuple[int, ...], ...]
    province_nodes: dict[str, tuple[int, ...]]
    province_type: dict[str, str]

    def reachable_provinces(self, unit: str) -> frozenset[str]:
        """Provinces a unit could move into (its own excluded)."""
        return _reachable(self.name, unit)

    def distance_to(self, unit: str, targets: frozenset[str]) -> int:
        """Fewest moves for `unit` to reach any province in `targets` (large if unreachable)."""
        return _distance(self.name, unit, targets)


@lru_cache(maxsize=8)
def map_graph(name: str = "standard") -> MapGraph:
    m = Map(name)
    locs = sorted({loc.upper() for loc in m.locs})
    nodes = [f"{t} {loc}" for loc in locs for t in ("A", "F") if m.is_valid_unit(f"{t} {loc}")]
    index = {n: i for i, n in enumerate(nodes)}
    neighbours: list[tuple[int, ...]] = []
    for node in nodes:
        unit_type, loc = node[0], node[2:]
        adjacent = set()
        for dest in m.dest_with_coasts[loc]:
            dest = dest.upper()
            other = f"{unit_type} {dest}"
            if other in index and m.abuts(unit_type, loc, "-", dest):
                adjacent.add(index[other])
        neighbours.append(tuple(sorted(adjacent)))
    provinces = sorted({loc[:3] for loc in locs})
    province_nodes = {p: tuple(i for i, n in enumerate(nodes) if n[2:5] == p) for p in provinces}
    return MapGraph(
        name=name,
        provinces=tuple(provinces),
        supply_centres=frozenset(sc.upper() for sc in m.scs),
        home_centres={p.upper(): tuple(sorted(h.upper() for h in hs)) for p, hs in m.homes.items()},
        nodes=tuple(nodes),
        node_index=index,
        node_province=tuple(n[2:5] for n in nodes),
        neighbours=tuple(neighbours),
        province_nodes=province_nodes,
        province_type={p: str(m.area_type(p)) for p in provinces},
    )


@lru_cache(maxsize=4096)
def _reachable(name: str, unit: str) -> frozenset[str]:
    g = map_graph(name)
    return frozenset(g.node_province[j] for j in g.neighbours[g.node_index[unit]])


@lru_cache(maxsize=65536)
def _distance(name: str, unit: str, targets: frozenset[str]) -> int:
    g = map_graph(name)
    start = g.node_index[unit]
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        node, d = queue.popleft()
        if g.node_province[node] in targets:
            return d
        for j in g.neighbours[node]:
            if j not in seen:
                seen.add(j)
                queue.append((j, d + 1))
    return 99
