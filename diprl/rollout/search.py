"""One-ply search at a seat: the policy proposes, the same policy predicts the others, the engine judges.

A searched seat does not play its policy's first answer. In a movement phase it asks its policy for its
greedy order set (the seat's normal request) and `candidates` more sampled ones, and asks the SAME policy
what each other power would order, `opponent_samples` joint samples of all of them. Every distinct
candidate is adjudicated by the engine against every sampled joint profile (a fork of the game per pair)
and scored by `position_value`; the candidate with the best mean is chosen, the greedy one on a tie. With
`improve_rounds`, the choice is then improved one unit at a time (`PendingSearch.improve`) against the
same profiles. Retreats and adjustments are played as the policy answers them.

Nothing here looks at who actually sits in the other seats: the opponents are modelled by the seat's own
policy, never by the bots it meets, so a searched policy that beats DumbBot beats it without asking it.
All the requests of a searched seat go into the lockstep's one generation call per phase, beside every
other seat of every game, so search costs batch width, not calls.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, replace

from diprl.game import DiplomacyGame
from diprl.game.legal import PhaseKind
from diprl.game.mapgraph import map_graph
from diprl.game.orders import HOLD, MOVE, SUPPORT, Order, parse_order
from diprl.messages import Generation, GenerationRequest
from diprl.policy.prompt import build_prompt

IMPROVE_POOLS = ("policy", "centres")
"""Where `improve` looks for a unit's alternatives: the orders the candidates gave it, or those plus every
legal hold, move onto a centre the power does not own, and support of its own unit onto one."""

OPPONENT_STREAM = 1_000
"""Sample streams of the opponent model's requests start here; the candidates' take 1..candidates."""


@dataclass
class SearchConfig:
    """How a searched seat decides a movement phase (`candidates` 0: no search, the policy's answer).

    Each decision costs 1 + `candidates` + `opponent_samples` x (other powers) requests in the phase's one
    generation call, and up to (1 + `candidates`) x `opponent_samples` adjudications of ~5 ms each, plus
    `opponent_samples` for each alternative order of each unit in each round of improvement.
    `unit_weight` prices a unit against a centre in `position_value`, `reach_weight` a centre one move
    away (`centres_in_reach`): the spring move that prepares a fall capture.
    """

    candidates: int = 0  # sampled order sets besides the greedy one; 0: no search
    opponent_samples: int = 4  # joint samples of the other powers' orders, from the seat's own policy
    temperature: float = 1.0  # of the sampled candidates and of the opponent model's samples
    unit_weight: float = 0.3  # a unit's worth in centres in the position's value
    reach_weight: float = 0.0  # a centre in reach (one move from a free unit) in centres; 0: unseen
    improve_rounds: int = 0  # rounds of unit-by-unit improvement of the chosen set (`improve`); 0: none
    improve_pool: str = "policy"  # a unit's alternatives there: "policy" (its orders in the candidates) or "centres"

    def __post_init__(self) -> None:
        for name in ("candidates", "opponent_samples", "improve_rounds"):
            value = getattr(self, name)
            low = 1 if name == "opponent_samples" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"search.{name} must be an integer >= {low}, got {value!r}")
        for name in ("temperature", "unit_weight", "reach_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"search.{name} must be a finite number >= 0, got {value!r}")
        if self.improve_pool not in IMPROVE_POOLS:
            pools = ", ".join(IMPROVE_POOLS)
            raise ValueError(f"search.improve_pool must be one of {pools}, got {self.improve_pool!r}")

    @property
    def enabled(self) -> bool:
        return self.candidates > 0

    @classmethod
    def strongest(cls, candidates: int) -> SearchConfig:
        """The setting the strength bench measured strongest, with `candidates` (docs/results.md, 2026-12-04:
        reach 0.5, two rounds of improvement from the centres' pool)."""
        return cls(candidates=candidates, reach_weight=0.5, improve_rounds=2, improve_pool="centres")


def derived_seed(seed: int, stream: int) -> int:
    """A sampling seed of its own for stream `stream` of the request seeded `seed` (63 bits, stable)."""
    digest = hashlib.sha256(f"search:{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _province(unit: str) -> str:
    """'F STP/SC' -> 'STP'."""
    return unit.split()[1].split("/")[0]


def position_value(game: DiplomacyGame, power: str, unit_weight: float, reach_weight: float = 0.0) -> float:
    """The centres `power` would own if units stayed where they stand, plus `unit_weight` a unit and
    `reach_weight` a centre in reach (`centres_in_reach`).

    A centre counts when `power` owns it and no other power's unit stands on it, or when a unit of
    `power` stands on it: after a fall move that is the next count exactly (dislodged units stand
    nowhere); after a spring move, what the fall would confirm if nobody moved.
    """
    standing = {_province(unit): other for other in game.powers for unit in game.units(other)}
    owned = set(game.centres(power))
    held = {centre for centre in owned if standing.get(centre, power) == power}
    taken = {centre for centre in map_graph().supply_centres - owned if standing.get(centre) == power}
    value = len(held) + len(taken) + unit_weight * len(game.units(power))
    if reach_weight:
        value += reach_weight * centres_in_reach(game, power, counted=held | taken)
    return value


def centres_in_reach(game: DiplomacyGame, power: str, counted: set[str]) -> int:
    """How many centres outside `counted` `power`'s free units could each step onto at the next move,
    one centre a unit (a maximum matching of units to centres).

    A unit is free unless it stands on a centre `power` does not own yet: that one must stay for the
    capture to count. What a one-phase value cannot see otherwise is exactly this: a spring move next
    to a neutral centre scores nothing until the fall move onto it.
    """
    graph = map_graph()
    capturing = graph.supply_centres - set(game.centres(power))  # a unit standing on one of these is pinned
    targets = graph.supply_centres - counted
    options = [
        sorted(graph.reachable_provinces(unit) & targets)
        for unit in game.units(power)
        if _province(unit) not in capturing
    ]
    match: dict[str, int] = {}  # centre -> the option row (unit) it is matched to

    def augment(i: int, visited: set[str]) -> bool:
        for centre in options[i]:
            if centre not in visited:
                visited.add(centre)
                if centre not in match or augment(match[centre], visited):
                    match[centre] = i
                    return True
        return False

    return sum(augment(i, set()) for i in range(len(options)))


@dataclass(frozen=True)
class SearchOutcome:
    """What a search chose: the answer played, how many distinct candidates it weighed, and whether it
    played something else than the greedy answer."""

    answer: Generation
    candidates: int
    changed: bool


@dataclass(frozen=True)
class PendingSearch:
    """One searched seat's requests in the phase's call; `choose` turns their answers into the decision."""

    game: DiplomacyGame
    power: str
    config: SearchConfig
    requests: tuple[GenerationRequest, ...]
    others: tuple[str, ...]  # the powers modelled, in the order of their samples in `requests`

    def choose(self, answers: Sequence[Generation]) -> SearchOutcome:
        """The candidate with the best mean value over the sampled profiles (the greedy one first on ties),
        then, with `improve_rounds`, improved unit by unit (`improve`)."""
        if len(answers) != len(self.requests):
            raise ValueError(f"a search needs {len(self.requests)} answers, got {len(answers)}")
        n = 1 + self.config.candidates
        greedy = answers[0]
        candidates: list[Generation] = []
        seen: set[tuple[str, ...]] = set()
        for answer in answers[:n]:
            key = tuple(sorted(answer.orders))
            if answer.error is None and key not in seen:
                seen.add(key)
                candidates.append(answer)
        profiles: list[dict[str, list[str]]] = [{} for _ in range(self.config.opponent_samples)]
        samples = iter(answers[n:])
        for other in self.others:
            for profile in profiles:
                profile[other] = list(next(samples).orders)  # a failed sample holds (the game's defaults)
        if not candidates or (len(candidates) < 2 and not self.config.improve_rounds):
            chosen = candidates[0] if candidates else greedy  # nothing to weigh
            return SearchOutcome(chosen, len(candidates), chosen is not greedy)
        values: dict[tuple[str, ...], float] = {}

        def value(orders: Sequence[str]) -> float:
            """The mean `position_value` after `orders` against every profile (each order set once)."""
            key = tuple(sorted(orders))
            if key not in values:
                total = 0.0
                for profile in profiles:
                    fork = self.game.fork()
                    fork.step({**profile, self.power: list(orders)})
                    total += position_value(fork, self.power, self.config.unit_weight, self.config.reach_weight)
                values[key] = total / len(profiles)
            return values[key]

        best, best_value = candidates[0], -math.inf
        for candidate in candidates:
            mean = value(candidate.orders)
            if mean > best_value + 1e-9:
                best, best_value = candidate, mean
        if self.config.improve_rounds:
            best = self.improve(best, candidates, value)
        # A failed greedy answer is never a candidate: whatever is played then is a change.
        changed = greedy.error is not None or sorted(best.orders) != sorted(greedy.orders)
        return SearchOutcome(best, len(candidates), changed)

    def improve(
        self, chosen: Generation, candidates: Sequence[Generation], value: Callable[[Sequence[str]], float]
    ) -> Generation:
        """`chosen`, with each unit's order replaced by the alternative that raises `value` most, unit
        after unit, for up to `improve_rounds` rounds (until a round changes nothing).

        A unit's alternatives are the orders the candidates gave it ("policy": the policy proposes
        each order, search composes them) or those and every legal hold, move onto a centre the power
        does not own and support of its own unit's move onto one ("centres"). A composed set is an
        answer the policy did not write: it keeps `chosen`'s prompt but no completion ids, so nothing
        trains on it as the policy's own.
        """
        legal = self.game.legal_orders(self.power)
        current = {loc: legal.default_order(loc) for loc in legal.locs}
        pools: dict[str, dict[str, None]] = {loc: {} for loc in legal.locs}  # insertion-ordered sets
        # An order that is not legal here (a client's bad answer) is what the game would do with it: the
        # unit's default; it is never tried.
        for order in chosen.orders:
            if order in legal.loc_of:
                current[legal.loc_of[order]] = order
        for candidate in candidates:
            for order in candidate.orders:
                if order in legal.loc_of:
                    pools[legal.loc_of[order]][order] = None
        if self.config.improve_pool == "centres":
            wanted = map_graph().supply_centres - set(self.game.centres(self.power))
            own = {_province(unit) for unit in self.game.units(self.power)}
            for loc, orders in legal.by_loc.items():
                for order in orders:
                    if _towards(parse_order(order), wanted, own):
                        pools[loc][order] = None
        best_value = value(list(current.values()))
        for _ in range(self.config.improve_rounds):
            improved = False
            for loc, pool in pools.items():
                for order in pool:
                    if order != current[loc]:
                        trial = {**current, loc: order}
                        trial_value = value(list(trial.values()))
                        if trial_value > best_value + 1e-9:
                            current, best_value, improved = trial, trial_value, True
            if not improved:
                break
        composed = list(current.values())
        if sorted(composed) == sorted(chosen.orders):
            return chosen
        text = "\n".join(composed)
        return replace(chosen, orders=composed, text=text, token_ids=[], logprobs=[], finish_reason="search")


def _towards(order: Order, wanted: Set[str], own: Set[str]) -> bool:
    """A hold, a move onto a province in `wanted`, or a support of a unit standing in `own` moving onto one."""
    if order.kind == HOLD:
        return True
    if order.kind == MOVE:
        return order.target.split("/")[0] in wanted
    if order.kind == SUPPORT and order.supported_target:
        return _province(order.supported_unit) in own and order.supported_target.split("/")[0] in wanted
    return False


def plan_search(
    game: DiplomacyGame, power: str, greedy: GenerationRequest, config: SearchConfig
) -> PendingSearch | None:
    """The requests of a search of `power`'s decision, its own request `greedy` first; None where the
    phase is not a movement phase (the seat then plays its request's answer)."""
    if not config.enabled or game.legal_orders(power).kind is not PhaseKind.MOVEMENT:
        return None

    def seeded(stream: int) -> int | None:
        return None if greedy.sample_seed is None else derived_seed(greedy.sample_seed, stream)

    sampled = replace(greedy, temperature=config.temperature)
    requests = [greedy] + [replace(sampled, sample_seed=seeded(j)) for j in range(1, 1 + config.candidates)]
    others = tuple(p for p in game.orderable_powers() if p != power)
    for i, other in enumerate(others):
        model = replace(sampled, prompt=build_prompt(game, other).text, legal=game.legal_orders(other).to_dict())
        first = OPPONENT_STREAM + i * config.opponent_samples
        requests += [replace(model, sample_seed=seeded(first + j)) for j in range(config.opponent_samples)]
    return PendingSearch(game, power, config, tuple(requests), others)
