"""`OrderConstraint`: which token ids may come next so that the completion is a legal order set.

The language a request may produce is, character by character:

    [reasoning text, optional, bounded] "<orders>\\n"    (only when reasoning is on; else primed in the prompt)
    ( ORDER "\\n" ) x n_required                           one order per unit, each unit or build site once,
                                                          WAIVE repeatable in build phases
    "</orders>" EOS

An `OrderGrammar` is a character trie over one power's legal orders, with a bitmask per node of
the orders that lie below it, so "may this prefix still become an order" is one integer AND with the
state's bitmask of orders still open: an order closes when its unit (or site) has one, and when it
would contradict one already written (below). Allowed tokens are found by walking the vocabulary's
character trie alongside the grammar, so any tokenization works: an order merged with its newline, a
tag split over tokens, a token that ends one order and starts the next. Results are memoised per
grammar state, and grammars are shared by every request with the same legal orders (all forks of a
decision state, all samples of a group), so per request there is nothing to build and most steps are
one dictionary lookup.

Own supports agree with their orders. A support of one of the power's own units says what that unit
does: `A VEN S A ROM - APU` that it moves to APU, `A VEN S A ROM` that it stays (holds, supports or
convoys). Once either side is written, the orders that disagree close: after `A ROM - VEN` no own
support of ROM moving elsewhere or staying, after `A VEN S A ROM - APU` no order of ROM but its moves to
APU (and no own support of ROM that asks for something else). A support its unit could never agree
with (a move it has no legal order for) is not offered. DumbBot never writes a contradicting own
support, so no teacher label is refused; supports of other powers' units are not touched.

The learner rebuilds exactly the same masks from the stored legal orders (`masks_for`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from diprl.game.legal import PhaseKind, PowerOrders
from diprl.game.orders import MOVE, SUPPORT, WAIVE
from diprl.policy.vocab import TokenTable

OPEN_TAG = "<orders>\n"
CLOSE_TAG = "</orders>"

# Grammar modes.
REASON, OPEN, LINE, CLOSE, EOS, DONE = range(6)


class ConstraintViolation(ValueError):
    """A token that the constraint does not allow at that point (the learner's data is inconsistent)."""


class State(NamedTuple):
    """A point in the grammar: `node` is a trie node (LINE) or a position in a tag (OPEN, CLOSE);
    `open` the bitmask of orders that may still be written (`OrderGrammar.orders` indexes it);
    `written` orders written; `spent` reasoning tokens used; `match` the length of the open tag
    matched at the end of reasoning."""

    mode: int
    node: int
    open: int
    written: int
    spent: int = 0
    match: int = 0


@dataclass(frozen=True)
class ReasoningOptions:
    """Free text before `<orders>`: off by default; `max_tokens` bounds it, then the tag is forced."""

    max_tokens: int = 256


class OrderGrammar:
    """The character-level grammar of one power's legal orders in one phase (shared, memoising)."""

    MEMO_LIMIT = 100_000

    def __init__(self, legal: PowerOrders, table: TokenTable) -> None:
        self.legal = legal
        self.table = table
        self.locs = legal.locs
        self.n_required = legal.n_required
        demands = _support_demands(legal)
        never = {order for order, demand in demands.items() if demand is None}
        # The orders the grammar offers, each unit's together: bit i of a state's `open` is orders[i].
        self.orders: list[str] = []
        spans: dict[str, range] = {}
        for loc in self.locs:
            start = len(self.orders)
            self.orders += [order for order in legal.by_loc[loc] if order not in never]
            spans[loc] = range(start, len(self.orders))
        self.waive_bit = 1 << len(self.orders) if legal.allows_waive else 0
        self.full_mask = (1 << len(self.orders)) - 1 | self.waive_bit
        # Closed once an order is written: the other orders of its unit, and those it contradicts.
        self.closes: list[int] = _closures(self.orders, spans, demands)
        self.children: list[dict[str, int]] = [{}]
        self.below: list[int] = [0]  # the orders below each node
        self.ends: list[int] = [-1]  # the index of the order ending at each node (-1: none; WAIVE: len(orders))
        for i, order in enumerate(self.orders):
            self._insert(order, i)
        if legal.allows_waive:
            self._insert(WAIVE, len(self.orders))
        self._allowed: OrderedDict[State, np.ndarray] = OrderedDict()
        self._reason_safe: np.ndarray | None = None

    def _insert(self, text: str, index: int) -> None:
        bit = 1 << index
        node = 0
        self.below[0] |= bit
        for ch in text:
            nxt = self.children[node].get(ch)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][ch] = nxt
                self.children.append({})
                self.below.append(0)
                self.ends.append(-1)
            node = nxt
            self.below[node] |= bit
        self.ends[node] = index

    # ----------------------------------------------------------- states
    def start(self, reasoning: ReasoningOptions | None) -> State:
        if reasoning is not None:
            return State(REASON, 0, self.full_mask, 0)
        return self._after_lines(0, self.full_mask)

    def _after_lines(self, count: int, open_: int) -> State:
        if count >= self.n_required:
            return State(CLOSE, 0, open_, count)
        return State(LINE, 0, open_, count)

    def step_char(self, s: State, ch: str) -> State | None:
        """The state after one more character, or None if the character is not allowed."""
        mode = s.mode
        if mode == LINE:
            if ch == "\n":
                index = self.ends[s.node]
                if index < 0 or not (1 << index) & s.open:
                    return None
                open_ = s.open if index == len(self.orders) else s.open & ~self.closes[index]
                return self._after_lines(s.written + 1, open_)
            nxt = self.children[s.node].get(ch)
            if nxt is None or not self.below[nxt] & s.open:
                return None
            return State(LINE, nxt, s.open, s.written)
        if mode == CLOSE:
            if CLOSE_TAG[s.node] != ch:
                return None
            return State(EOS, 0, s.open, s.written) if s.node + 1 == len(CLOSE_TAG) else s._replace(node=s.node + 1)
        if mode == OPEN:
            if OPEN_TAG[s.node] != ch:
                return None
            if s.node + 1 == len(OPEN_TAG):
                return self._after_lines(0, s.open)
            return s._replace(node=s.node + 1)
        if mode == REASON:
            match = _kmp_next(s.match, ch)
            if match == len(OPEN_TAG) - 1:  # "<orders>" seen in the text: the newline must follow
                return State(OPEN, len(OPEN_TAG) - 1, s.open, 0)
            return s._replace(match=match)
        return None

    def step_token(self, s: State, token_id: int, reasoning: ReasoningOptions | None = None) -> State | None:
        """The state after a whole token, or None if the token is not allowed there."""
        if s.mode == EOS:
            return State(DONE, 0, s.open, s.written) if token_id == self.table.eos_id else None
        text = self.table.text(token_id)
        if not text:
            return None
        if s.mode == REASON and reasoning is not None and s.spent >= reasoning.max_tokens:
            s = State(OPEN, s.match, s.open, 0)  # budget spent: only the open tag may follow
        start_mode = s.mode
        for ch in text:
            nxt = self.step_char(s, ch)
            if nxt is None:
                return None
            s = nxt
        if start_mode == REASON and s.mode == REASON:
            s = s._replace(spent=s.spent + 1)
        return s

    # ------------------------------------------------------ allowed ids
    def allowed(self, s: State, reasoning: ReasoningOptions | None = None) -> np.ndarray:
        """Sorted token ids allowed in state `s` (memoised: every request of this grammar shares it)."""
        if s.mode == REASON and reasoning is not None and s.spent >= reasoning.max_tokens:
            s = State(OPEN, s.match, s.open, 0)
        key = s._replace(spent=0) if s.mode == REASON else s
        hit = self._allowed.get(key)
        if hit is not None:
            return hit
        if s.mode == EOS:
            out = np.array([self.table.eos_id], dtype=np.int64)
        elif s.mode == DONE:
            out = np.zeros(0, dtype=np.int64)
        elif s.mode == REASON:
            out = self._allowed_in_reasoning(s)
        else:
            out = np.array(sorted(self._walk(s)), dtype=np.int64)
        self._allowed[key] = out
        if len(self._allowed) > self.MEMO_LIMIT:
            self._allowed.popitem(last=False)
        return out

    def _walk(self, s: State) -> list[int]:
        """Token ids whose whole text is a valid continuation from `s` (vocabulary trie walk)."""
        trie = self.table.trie
        out: list[int] = []
        stack = [(0, s)]
        while stack:
            vnode, state = stack.pop()
            for ch, vchild in trie.children[vnode].items():
                nxt = self.step_char(state, ch)
                if nxt is None:
                    continue
                out.extend(trie.ids_at[vchild])
                if trie.children[vchild]:
                    stack.append((vchild, nxt))
        return out

    def _allowed_in_reasoning(self, s: State) -> np.ndarray:
        """Reasoning may say anything but stop; a token that completes `<orders>` must fit the grammar."""
        if self._reason_safe is None:
            # Tokens without '>' can never complete the tag, whatever came before: always allowed.
            risky = set(self.table.close_candidates) | {self.table.eos_id}
            self._reason_safe = np.array(
                [i for i, t in enumerate(self.table.texts) if t and i not in risky], dtype=np.int64
            )
        fits = [i for i in self.table.close_candidates if self.step_token(s, i, None) is not None]
        return np.union1d(self._reason_safe, np.array(fits, dtype=np.int64))


Demand = tuple[str, str] | None  # (the supported own unit's loc, the province it must end its order in)


# The two readings below split the engine's canonical text ("A VEN S A ROM - APU": type, unit, verb, ...)
# instead of calling `parse_order`: they run for every order of every fresh grammar, on the decode path.


def _intent(order: str) -> str:
    """The province a unit's order leaves it in: the destination of a move, else its own."""
    words = order.split(" ", 4)
    return words[3][:3] if words[2] == MOVE else words[1][:3]


def _support_demands(legal: PowerOrders) -> dict[str, Demand]:
    """Each support of one of the power's own units -> what it asks of that unit, or None when no legal
    order of the unit could agree (such a support is not offered)."""
    if legal.kind is not PhaseKind.MOVEMENT:
        return {}
    loc_of_province = {loc[:3]: loc for loc in legal.locs}
    intents: dict[str, set[str]] = {}
    demands: dict[str, Demand] = {}
    for orders in legal.by_loc.values():
        for order in orders:
            words = order.split(" ")  # "A VEN S A ROM - APU" or "A VEN S A ROM"
            if words[2] != SUPPORT:
                continue
            target = loc_of_province.get(words[4][:3])
            if target is None:
                continue  # another power's unit: its order is not ours to check
            wanted = words[6][:3] if len(words) > 6 else target[:3]
            if target not in intents:
                intents[target] = {_intent(o) for o in legal.by_loc[target]}
            demands[order] = (target, wanted) if wanted in intents[target] else None
    return demands


def contradicted_supports(legal: PowerOrders, orders: Sequence[str]) -> list[str]:
    """The own supports in `orders` that the constraint would refuse beside the rest: their unit's order
    in `orders` contradicts them, or no legal order of that unit could agree."""
    demands = _support_demands(legal)
    order_of = {legal.loc_of[o]: o for o in orders if o in legal.loc_of}
    out = []
    for order in orders:
        if order not in demands:
            continue
        demand = demands[order]
        if demand is None or (demand[0] in order_of and _intent(order_of[demand[0]]) != demand[1]):
            out.append(order)
    return out


def _closures(orders: Sequence[str], spans: Mapping[str, range], demands: Mapping[str, Demand]) -> list[int]:
    """For each order, the bitmask of orders that writing it closes: its unit's (itself included) and
    those it contradicts (an own support and its unit's order disagreeing, or two own supports of one
    unit asking for different things). Symmetric, so the order in which units are written is free.
    `spans` gives each unit's indices in `orders` (the grammar's indexing)."""
    closes = [0] * len(orders)
    for span in spans.values():
        closes[span.start : span.stop] = [((1 << len(span)) - 1) << span.start] * len(span)
    if not demands:
        return closes
    index = {order: i for i, order in enumerate(orders)}
    # Per supported own unit: its supports by what they ask (indices and bits).
    asked: dict[str, dict[str, list[int]]] = {}
    for order, demand in demands.items():
        if demand is not None:
            asked.setdefault(demand[0], {}).setdefault(demand[1], []).append(index[order])
    for target, by_wanted in asked.items():
        wanted_bits = {wanted: sum(1 << i for i in supports) for wanted, supports in by_wanted.items()}
        all_supports = sum(wanted_bits.values())
        unit = ((1 << len(spans[target])) - 1) << spans[target].start
        by_intent: dict[str, int] = {}
        for i in spans[target]:
            intent = _intent(orders[i])
            by_intent[intent] = by_intent.get(intent, 0) | 1 << i
            closes[i] |= all_supports & ~wanted_bits.get(intent, 0)
        for wanted, supports in by_wanted.items():
            clash = (unit & ~by_intent.get(wanted, 0)) | (all_supports & ~wanted_bits[wanted])
            for i in supports:
                closes[i] |= clash
    return closes


def _kmp_next(matched: int, ch: str) -> int:
    """Length of the longest suffix that is a prefix of "<orders>" after appending `ch`."""
    tag = OPEN_TAG[:-1]
    while True:
        if matched < len(tag) and tag[matched] == ch:
            return matched + 1
        if matched == 0:
            return 0
        # "<orders>" has no proper border: any mismatch restarts (and '<' may start a new match).
        matched = 0


_GRAMMARS: OrderedDict[tuple[int, tuple[object, ...]], OrderGrammar] = OrderedDict()
GRAMMAR_CACHE_SIZE = 512


def grammar_for(legal: PowerOrders, table: TokenTable) -> OrderGrammar:
    """The shared grammar for these legal orders (every fork and sample of a state reuses it)."""
    key = (id(table), legal.signature)
    grammar = _GRAMMARS.get(key)
    if grammar is None:
        grammar = OrderGrammar(legal, table)
        _GRAMMARS[key] = grammar
        if len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
            _GRAMMARS.popitem(last=False)
    else:
        _GRAMMARS.move_to_end(key)
    return grammar


class OrderConstraint:
    """One request's constraint: after any prefix of generated ids, the ids allowed next.

    Deterministic: the answer depends only on the legal orders, the tokenizer and the prefix.
    Calls with a growing prefix advance incrementally; any other prefix replays from the start.
    """

    def __init__(self, legal: PowerOrders, table: TokenTable, reasoning: ReasoningOptions | None = None) -> None:
        if legal.kind is PhaseKind.NONE:
            raise ValueError(f"{legal.power} has nothing to order in {legal.phase}: no request should be made")
        self.legal = legal
        self.table = table
        self.reasoning = reasoning
        self.grammar = grammar_for(legal, table)
        self._start = self.grammar.start(reasoning)
        self._state = self._start
        self._consumed: list[int] = []

    @property
    def state(self) -> State:
        return self._state

    @property
    def done(self) -> bool:
        return self._state.mode == DONE

    def reset(self) -> None:
        self._state, self._consumed = self._start, []

    def advance(self, token_id: int) -> None:
        nxt = self.grammar.step_token(self._state, int(token_id), self.reasoning)
        if nxt is None:
            text = self.table.text(int(token_id))
            raise ConstraintViolation(
                f"token {token_id} ({text!r}) is not allowed after {len(self._consumed)} tokens "
                f"for {self.legal.power} in {self.legal.phase}"
            )
        self._state = nxt
        self._consumed.append(int(token_id))

    def allowed_token_ids(self, generated: Sequence[int] = ()) -> np.ndarray:
        """Sorted ids allowed after `generated` (the ids produced so far for this request)."""
        n = len(self._consumed)
        if len(generated) < n or list(generated[:n]) != self._consumed:
            self.reset()
            n = 0
        for token_id in generated[n:]:
            self.advance(token_id)
        return self.grammar.allowed(self._state, self.reasoning)

    def masks_for(self, completion: Sequence[int]) -> list[np.ndarray]:
        """The allowed set before each token of a completion (what the learner masks with)."""
        self.reset()
        out = []
        for token_id in completion:
            out.append(self.grammar.allowed(self._state, self.reasoning))
            self.advance(token_id)
        return out
