"""DumbBot, the field's benchmark opponent, written clean-room from its specification (docs/dumbbot.md).

Win rates "vs DumbBot" only compare across projects when the bot is faithful to David Norman's
original rules; loose ports play near random level. The pieces below follow the specification
step by step: power sizes, attack/defence values of centres, ten rounds of proximity spreading
over the unit-position graph, strength/competition, and the randomised walk down the ranked
candidate list. Where the specification is silent the choice is documented at the spot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from diprl.bots.base import SeededAgent
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.game.mapgraph import MapGraph, map_graph
from diprl.game.orders import BUILD, DISBAND, RETREAT, WAIVE, parse_order

PROX_DEPTH = 10
W_SPRING = np.array([100, 1000, 30, 10, 6, 5, 4, 3, 2, 1], dtype=np.int64)
W_FALL = np.array([1000, 100, 30, 10, 6, 5, 4, 3, 2, 1], dtype=np.int64)
ATTACK_DEFENSE_WEIGHTS = {"S": (700, 300), "F": (600, 400), "W": (700, 300)}


def power_size(n_centres: int) -> int:
    return n_centres * n_centres + 4 * n_centres + 16


def _cdiv(a: int, b: int) -> int:
    """C integer division (truncation toward zero): the original is C++."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


@dataclass(frozen=True)
class _Groups:
    """Neighbour nodes grouped by province, flattened for numpy reductions."""

    nbr: np.ndarray  # neighbour node ids, sorted by (node, province)
    group_starts: np.ndarray  # start of each (node, province) group in `nbr`
    group_node: np.ndarray  # the node each group belongs to


_GROUPS: dict[str, _Groups] = {}


def _groups(graph: MapGraph) -> _Groups:
    if graph.name not in _GROUPS:
        nbr: list[int] = []
        starts: list[int] = []
        owner: list[int] = []
        for node, neighbours in enumerate(graph.neighbours):
            by_province: dict[str, list[int]] = {}
            for j in neighbours:
                by_province.setdefault(graph.node_province[j], []).append(j)
            for _, members in sorted(by_province.items()):
                starts.append(len(nbr))
                owner.append(node)
                nbr.extend(members)
        _GROUPS[graph.name] = _Groups(np.array(nbr), np.array(starts), np.array(owner))
    return _GROUPS[graph.name]


class Evaluation:
    """DumbBot's view of the board for one power in one phase: node values for moves and builds."""

    def __init__(self, game: DiplomacyGame, power: str) -> None:
        graph = map_graph(game.engine.map_name)
        self.graph = graph
        self.power = power
        season = game.season
        owner = {c: p for p in game.powers for c in game.centres(p)}
        n_unowned = sum(1 for c in graph.supply_centres if c not in owner)
        size = {p: power_size(len(game.centres(p))) for p in game.powers}
        neutral_size = power_size(n_unowned)

        # Who can reach each province: strength (mine) and competition (largest other power). The
        # original counts adjacencies, not units: a unit adds one for its own province and one per
        # adjacent node, so a fleet bordering two coasts of a province (F MAO or F POR for SPA, F CON
        # for BUL) adds two there.
        reach: dict[str, dict[str, int]] = {p: {} for p in game.powers}
        for p in game.powers:
            counts = reach[p]
            for unit in game.units(p):
                counts[unit[2:5]] = counts.get(unit[2:5], 0) + 1
                for j in graph.neighbours[graph.node_index[unit]]:
                    prov = graph.node_province[j]
                    counts[prov] = counts.get(prov, 0) + 1
        self.strength = reach[power]
        self.competition: dict[str, int] = {}
        for p, counts in reach.items():
            if p == power:
                continue
            for prov, n in counts.items():
                self.competition[prov] = max(self.competition.get(prov, 0), n)

        attack, defense = {}, {}
        for centre in graph.supply_centres:
            if owner.get(centre) == power:
                threats = [
                    size[p]
                    for p in game.powers
                    if p != power and any(centre in graph.reachable_provinces(u) for u in game.units(p))
                ]
                defense[centre] = max(threats, default=0)
            else:
                attack[centre] = size[owner[centre]] if centre in owner else neutral_size
        self.defense = defense

        aw, dw = ATTACK_DEFENSE_WEIGHTS[season]
        base = np.array(
            [attack.get(prov, 0) * aw + defense.get(prov, 0) * dw for prov in graph.node_province], dtype=np.int64
        )
        groups = _groups(graph)
        prox = np.empty((PROX_DEPTH, len(graph.nodes)), dtype=np.int64)
        prox[0] = base
        for k in range(1, PROX_DEPTH):
            best = np.maximum.reduceat(prox[k - 1][groups.nbr], groups.group_starts)
            spread = np.bincount(groups.group_node, weights=best, minlength=len(graph.nodes)).astype(np.int64)
            prox[k] = (spread + prox[k - 1]) // 5
        move_weights = W_FALL if season == "F" else W_SPRING
        comp = np.array([self.competition.get(p, 0) for p in graph.node_province], dtype=np.int64)
        strength = np.array([self.strength.get(p, 0) for p in graph.node_province], dtype=np.int64)
        defense_arr = np.array([defense.get(p, 0) for p in graph.node_province], dtype=np.int64)
        self.move_value = move_weights @ prox + 1000 * strength - 1000 * comp
        self.build_value = W_FALL @ prox + 1000 * defense_arr

    def node_move_value(self, node: str) -> int:
        return int(self.move_value[self.graph.node_index[node]])

    def node_build_value(self, node: str) -> int:
        return int(self.build_value[self.graph.node_index[node]])


class DumbBot(SeededAgent):
    """David Norman's DumbBot semantics: never convoys, never supports foreign units."""

    name = "dumbbot"

    # ------------------------------------------------------------ choosing
    def _rand100(self) -> int:
        return self.rng.randrange(100)

    def choose(self, candidates: list[tuple[int, str]], ascending: bool = False) -> str | None:
        """Walk the ranked candidates: move on while rand%100 < 50 and rand%100 >= (cur - next)*500/cur.

        Candidates with equal values collapse to the first seen. `ascending` ranks lowest first
        (removals). The difference is signed, as in the original: walking upward (or from a negative
        value) makes the second term <= 0, so each step then moves on with probability 1/2 and a
        removal is not always the lowest-value unit.
        """
        if not candidates:
            return None
        ranked = sorted(candidates, key=lambda c: c[0], reverse=not ascending)  # stable: first seen wins ties
        distinct: list[tuple[int, str]] = []
        for value, item in ranked:
            if not distinct or distinct[-1][0] != value:
                distinct.append((value, item))
        i = 0
        while i + 1 < len(distinct):
            cur, nxt = distinct[i][0], distinct[i + 1][0]
            r1, r2 = self._rand100(), self._rand100()
            threshold = _cdiv((cur - nxt) * 500, cur) if cur != 0 else 0
            if r1 < 50 and r2 >= threshold:
                i += 1
            else:
                break
        return distinct[i][1]

    # -------------------------------------------------------------- phases
    def orders(self, game: DiplomacyGame, power: str) -> list[str]:
        legal = game.legal_orders(power)
        if legal.kind is PhaseKind.NONE:
            return []
        ev = Evaluation(game, power)
        if legal.kind is PhaseKind.MOVEMENT:
            return self._movement(game, power, legal, ev)
        if legal.kind is PhaseKind.RETREAT:
            return self._retreats(game, power, legal, ev)
        if legal.kind is PhaseKind.BUILD:
            return self._builds(legal, ev)
        return self._removals(game, power, legal, ev)

    def _movement(self, game: DiplomacyGame, power: str, legal: PowerOrders, ev: Evaluation) -> list[str]:
        graph = ev.graph
        units = list(game.units(power))
        self.rng.shuffle(units)
        at = {u[2:5]: u for u in units}
        legal_set = legal.loc_of
        plan: dict[str, str] = {}  # unit -> order text
        moving_into: dict[str, str] = {}  # province -> my unit moving there
        waiting_on: dict[str, str] = {}
        queue = deque(units)

        def is_moving(unit: str) -> bool:
            return parse_order(plan[unit]).kind == "-"

        while queue:
            unit = queue.popleft()
            here = unit[2:5]
            candidates = [(ev.node_move_value(unit) + 1, unit)]
            candidates += [
                (ev.node_move_value(graph.nodes[j]), graph.nodes[j]) for j in graph.neighbours[graph.node_index[unit]]
            ]
            postponed = False
            while candidates:
                node = self.choose(candidates)
                assert node is not None
                prov = node[2:5]
                if prov == here:
                    plan[unit] = f"{unit} H"
                    break
                occupant = at.get(prov)
                comp = ev.competition.get(prov, 0)
                order = None
                if occupant is not None and occupant not in plan:
                    if not self._waits_for(waiting_on, occupant, unit):
                        waiting_on[unit] = occupant
                        queue.insert(queue.index(occupant) + 1, unit)
                        postponed = True
                        break
                    # Two units that want each other's place would wait forever: choose again.
                elif occupant is not None and not is_moving(occupant):
                    if comp > 1:
                        order = f"{unit} S {occupant}"
                elif prov in moving_into:
                    if comp > 0:
                        order = self._support_move(unit, moving_into[prov], plan[moving_into[prov]], legal_set)
                else:
                    order = f"{unit} - {node[2:]}"
                    if order in legal_set:
                        moving_into[prov] = unit
                if order is not None and order in legal_set:
                    plan[unit] = order
                    break
                candidates = [c for c in candidates if c[1] != node]
            if not postponed and unit not in plan:
                plan[unit] = f"{unit} H"
            if unit in plan:
                waiting_on.pop(unit, None)

        self._convert_holds_to_supports(plan, ev, legal_set)
        return [plan[u] for u in sorted(plan)]

    @staticmethod
    def _waits_for(waiting_on: dict[str, str], start: str, target: str) -> bool:
        seen, cur = set(), start
        while cur in waiting_on and cur not in seen:
            seen.add(cur)
            cur = waiting_on[cur]
            if cur == target:
                return True
        return False

    @staticmethod
    def _support_move(unit: str, mover: str, move_order: str, legal_set: dict[str, str]) -> str | None:
        target = parse_order(move_order).target
        for dest in (target[:3], target):
            order = f"{unit} S {mover} - {dest}"
            if order in legal_set:
                return order
        return None

    def _convert_holds_to_supports(self, plan: dict[str, str], ev: Evaluation, legal_set: dict[str, str]) -> None:
        """Each holding unit instead supports its most valuable adjacent own move or threatened hold."""
        for unit in sorted(plan):
            if parse_order(plan[unit]).kind != "H":
                continue
            reachable = ev.graph.reachable_provinces(unit)
            best: tuple[int, str] | None = None
            for other, order_text in plan.items():
                if other == unit:
                    continue
                order = parse_order(order_text)
                if order.kind == "-":
                    prov = order.target[:3]
                    if prov in reachable and ev.competition.get(prov, 0) > 0:
                        support = self._support_move(unit, other, order_text, legal_set)
                        value = ev.node_move_value(f"{other[0]} {order.target}")
                        if support and (best is None or value > best[0]):
                            best = (value, support)
                else:
                    prov = other[2:5]
                    support = f"{unit} S {other}"
                    if prov in reachable and ev.competition.get(prov, 0) > 1 and support in legal_set:
                        value = ev.node_move_value(other)
                        if best is None or value > best[0]:
                            best = (value, support)
            if best is not None:
                plan[unit] = best[1]

    def _retreats(self, game: DiplomacyGame, power: str, legal: PowerOrders, ev: Evaluation) -> list[str]:
        taken: set[str] = set()
        out = []
        locs = list(legal.locs)
        self.rng.shuffle(locs)
        for loc in locs:
            options = legal.by_loc[loc]
            retreats = [parse_order(o) for o in options if parse_order(o).kind == RETREAT]
            candidates = [(ev.node_move_value(f"{r.unit[0]} {r.target}"), r.text) for r in retreats]
            choice = None
            while candidates:
                pick = self.choose(candidates)
                assert pick is not None
                if parse_order(pick).target[:3] not in taken:
                    choice = pick
                    break
                candidates = [c for c in candidates if c[1] != pick]
            if choice is None:
                choice = next(o for o in options if parse_order(o).kind == DISBAND)
            else:
                taken.add(parse_order(choice).target[:3])
            out.append(choice)
        return out

    def _builds(self, legal: PowerOrders, ev: Evaluation) -> list[str]:
        candidates = []
        for orders in legal.by_loc.values():
            for text in orders:
                order = parse_order(text)
                if order.kind == BUILD:
                    candidates.append((ev.node_build_value(order.unit), text))
        out = []
        for _ in range(legal.n_required):
            pick = self.choose(candidates)
            if pick is None:
                out.append(WAIVE)
                continue
            out.append(pick)
            site = parse_order(pick).loc
            candidates = [c for c in candidates if parse_order(c[1]).loc != site]
        return out

    def _removals(self, game: DiplomacyGame, power: str, legal: PowerOrders, ev: Evaluation) -> list[str]:
        candidates = []
        for orders in legal.by_loc.values():
            text = orders[0]
            candidates.append((ev.node_build_value(parse_order(text).unit), text))
        out = []
        for _ in range(legal.n_required):
            pick = self.choose(candidates, ascending=True)
            if pick is None:
                break
            out.append(pick)
            candidates = [c for c in candidates if c[1] != pick]
        return out
