"""Teacher decisions, tokenized exactly as the policy would see and write them.

Behaviour cloning is only a warm start for RL if what is cloned is the policy's own action space:
the same prompt ids the PolicyServer tokenizes (`build_prompt(game, power).text` through the
model's tokenizer) and a completion the constrained decoder could have produced. So each teacher
decision is written as its order lines in a fixed order (the constraint accepts any order; a fixed
one gives the model one target instead of n! equally good ones), then `</orders>`, then the EOS the
constraint requires, and every token is replayed through `OrderConstraint.masks_for`: a completion
the decoder could never write raises instead of becoming a silent training target.

The teacher labels every seat of its games. In a game against other bots (`opponents`), the teacher
plays one seat and the others are played by the opponent, but the teacher is still asked what it
would order in their place: those states (a power played badly, surrounded by chaos) are the ones a
weak policy meets, which a teacher playing all seven seats never visits (the idea of DAgger, with a
fixed stand-in for the learner).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diprl.bots import BOT_NAMES, make_agent
from diprl.bots.base import Agent, seat_seed
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, validate_orders
from diprl.game.orders import CONVOY, HOLD, SUPPORT, WAIVE, parse_order
from diprl.messages import PolicyRef, TrainingRecord, UnknownPolicyRef
from diprl.policy.constraint import CLOSE_TAG, ConstraintViolation, OrderConstraint, contradicted_supports
from diprl.policy.prompt import DEFAULT_PROMPT_OPTIONS, PromptOptions, build_prompt
from diprl.policy.vocab import TokenTable

GAME_SEED_STRIDE = 100003
"""Game `i` of a run seeded `s` has seed `s * stride + i` (the arena's scheme, so runs do not share games)."""

PHASE_KINDS = ("movement", "retreat", "build", "disband")
"""The phase kinds that have orders: agreement is reported for each."""

PHASE_CLASSES = ("movement", "retreat", "adjustment")
"""Strata of the kept decisions: builds and disbands share a class (both are rare)."""

_CLASS_OF = {
    PhaseKind.MOVEMENT: "movement",
    PhaseKind.RETREAT: "retreat",
    PhaseKind.BUILD: "adjustment",
    PhaseKind.DISBAND: "adjustment",
}


class TeacherError(ValueError):
    """Bad teacher configuration, or teacher output the policy could not have produced."""


def teacher_bot(teacher: str) -> str:
    """The bot name of `dumbbot` or `bot:dumbbot`; anything else (an unknown bot, an adapter) lists the bots."""
    try:
        ref = PolicyRef.parse(teacher)
        if not ref.is_bot:
            ref = PolicyRef.bot_ref(teacher)
    except UnknownPolicyRef:
        try:
            ref = PolicyRef.bot_ref(teacher)
        except UnknownPolicyRef:
            ref = None
    if ref is None or ref.name not in BOT_NAMES:
        raise TeacherError(
            f"unknown bot {teacher!r}: teachers and opponents are rule bots, one of {', '.join(BOT_NAMES)}"
        )
    return ref.name


def phase_class(kind: PhaseKind) -> str:
    """Movement, retreat or adjustment."""
    try:
        return _CLASS_OF[kind]
    except KeyError:
        raise TeacherError(f"phase kind {kind.value!r} has no orders to imitate") from None


def game_seed(base_seed: int, index: int) -> int:
    return base_seed * GAME_SEED_STRIDE + index


@dataclass
class TeacherExample:
    """One teacher decision, ready for the learner (`to_training_record`) and the agreement metric.

    `opponent` names who played the seats the teacher did not (the teacher itself in all-teacher
    games); `played` says whether these orders were played or only asked for (a seat of the opponent).
    """

    game: int
    game_seed: int
    split: str
    power: str
    phase: str
    kind: str  # PhaseKind value
    prompt_ids: list[int]
    completion_ids: list[int]
    legal: dict[str, Any]  # PowerOrders.to_dict()
    orders: list[str]  # the teacher's orders, in completion order
    teacher: str
    opponent: str
    played: bool

    @property
    def stratum(self) -> tuple[str, str]:
        return self.power, phase_class(PhaseKind(self.kind))

    @property
    def state(self) -> tuple[int, str]:
        """The game state this decision was taken in: every power's decision of one phase of one game shares it."""
        return self.game, self.phase

    def token_weights(self, table: TokenTable, support_weight: float) -> list[float]:
        """One loss weight per completion token: `support_weight` on every token of a support's line (its
        newline included), 1 elsewhere (other orders, the close tag, EOS). A token is counted in the line it
        starts in; `orders` are in completion order, one line each."""
        is_support = [parse_order(order).kind == SUPPORT for order in self.orders]
        weights, line = [], 0
        for token_id in self.completion_ids:
            text = table.text(token_id) or ""
            weights.append(support_weight if line < len(is_support) and is_support[line] else 1.0)
            line += text.count("\n")
        return weights

    def to_training_record(self, weights: Sequence[float] | None = None) -> TrainingRecord:
        """The teacher is deterministic as far as the learner knows: logprobs 0 and advantage 1 per token
        (behaviour cloning ignores both; GRPO code would see well-formed data). `weights` (one per
        completion token, `token_weights`) ride in the advantages for a weighted pretraining loss."""
        n = len(self.completion_ids)
        return TrainingRecord(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            behaviour_logprobs=[0.0] * n,
            legal=self.legal,
            advantages=[1.0] * n if weights is None else [float(w) for w in weights],
            policy_version=PolicyRef.bot_ref(self.teacher),
            temperature=1.0,
            power=self.power,
            phase=self.phase,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TeacherExample:
        try:
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise TeacherError(f"teacher example without field {exc}") from None


# ------------------------------------------------------------------------------ completions


# The fixed orders a teacher's lines are written in (`TeacherConfig.completion_order`). "province": by province
# (the shipped bases' recipe). "moves_first": moves, retreats and builds, then convoys, holds and supports last,
# each by province: a support is written after the move it backs, as DumbBot decides them (moves first, then
# idle units support), so the student can condition its supports on the moves it wrote (docs/results.md,
# 2026-12-02: more supports, but half of them still void).
COMPLETION_ORDERS = ("province", "moves_first")
_WRITTEN_LAST = {CONVOY: 1, HOLD: 2, SUPPORT: 3}


def ordered_lines(legal: PowerOrders, orders: Sequence[str], completion_order: str = "province") -> list[str]:
    """The teacher's orders in the fixed completion order (`COMPLETION_ORDERS`), WAIVEs last. Raises for
    orders the teacher should never give."""
    if completion_order not in COMPLETION_ORDERS:
        raise TeacherError(f"unknown completion_order {completion_order!r}; one of {COMPLETION_ORDERS}")
    accepted, issues = validate_orders(legal, list(orders))
    if issues:
        detail = "; ".join(f"{i.kind.value} {i.order!r}: {i.detail}" for i in issues)
        raise TeacherError(f"teacher orders for {legal.power} in {legal.phase} are not a legal set: {detail}")
    contradicted = contradicted_supports(legal, accepted)
    if contradicted:
        raise TeacherError(
            f"teacher orders for {legal.power} in {legal.phase} support their own units against those units' "
            f"orders ({', '.join(contradicted)} beside {', '.join(o for o in accepted if o not in contradicted)}): "
            "the order constraint never writes that, so it cannot be imitated; DumbBot's supports always agree"
        )
    rank = {loc: i for i, loc in enumerate(legal.locs)}

    def key(order: str) -> tuple[bool, int, int]:
        if order == WAIVE:
            return (True, 0, 0)
        kind = _WRITTEN_LAST.get(parse_order(order).kind, 0) if completion_order == "moves_first" else 0
        return (False, kind, rank.get(legal.loc_of.get(order, ""), len(rank)))

    return sorted(accepted, key=key)


def completion_text(lines: Sequence[str]) -> str:
    """What the decoder writes after the primed `<orders>\\n`: one line per order, then the close tag."""
    return "".join(f"{line}\n" for line in lines) + CLOSE_TAG


def teacher_completion(legal: PowerOrders, orders: Sequence[str], tokenizer: Any, table: TokenTable) -> list[int]:
    """Token ids of the teacher's orders as the constrained decoder would write them, EOS included.

    Every token is stepped through the `OrderConstraint` (which raises on a token the constraint
    forbids), and the completion must leave the constraint done. Stepping checks exactly what
    `masks_for` would, without computing each position's allowed set, which took half of the time
    of making the data; the learner rebuilds the masks anyway.
    """
    ids = [int(i) for i in tokenizer.encode(completion_text(ordered_lines(legal, orders)), add_special_tokens=False)]
    ids.append(table.eos_id)
    constraint = OrderConstraint(legal, table)
    try:
        for token in ids:
            constraint.advance(token)
    except ConstraintViolation as exc:
        raise TeacherError(
            f"teacher completion for {legal.power} in {legal.phase} breaks the constraint: {exc}"
        ) from exc
    if not constraint.done:
        raise TeacherError(f"teacher completion for {legal.power} in {legal.phase} does not finish the constraint")
    return ids


def completion_orders(completion_ids: Sequence[int], table: TokenTable) -> list[str]:
    """The order lines of a constrained completion (text before `</orders>`, EOS dropped)."""
    text = "".join(table.text(i) or "" for i in completion_ids if i != table.eos_id)
    body = text.split(CLOSE_TAG, 1)[0]
    return [line for line in body.split("\n") if line]


# ------------------------------------------------------------------------------------ games


@dataclass(frozen=True)
class Decision:
    """One labelled decision of a teacher game, before tokenization."""

    game: int
    game_seed: int
    power: str
    phase: str
    kind: str
    prompt: str
    legal: PowerOrders
    orders: tuple[str, ...]
    played: bool

    @property
    def state_key(self) -> str:
        """What makes two decisions the same state for the held-out split: the power and its prompt."""
        return hashlib.blake2b(f"{self.power}\n{self.prompt}".encode(), digest_size=16).hexdigest()


def game_opponent(teacher: str, opponents: Sequence[str], index: int) -> str:
    """Who plays the teacher's rivals in game `index`: the opponents in turn (the teacher itself if none)."""
    return opponents[index % len(opponents)] if opponents else teacher


def play_teacher_game(
    teacher: str,
    opponent: str,
    index: int,
    seed: int,
    max_year: int,
    prompt_options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> list[Decision]:
    """Every decision of one game, each labelled with the teacher's orders (seeded per seat), its prompt written
    with `prompt_options`.

    Against itself the teacher plays all seven powers. Against another bot it plays one power (the
    game index, rotated over the seven) and labels the other seats with what it would have ordered
    there, from a labelling copy with its own seat seed: the opponent's orders are played.
    """
    gseed = game_seed(seed, index)
    game = DiplomacyGame(max_year=max_year)
    hero = game.powers[index % len(game.powers)]
    players: dict[str, Agent] = {}
    labellers: dict[str, Agent] = {}
    for seat, power in enumerate(game.powers):
        if opponent == teacher or power == hero:
            players[power] = labellers[power] = make_agent(teacher, seat_seed(gseed, seat))
        else:
            players[power] = make_agent(opponent, seat_seed(gseed, seat))
            labellers[power] = make_agent(teacher, seat_seed(gseed, seat + len(game.powers)))
    decisions: list[Decision] = []
    while not game.is_done:
        orders: dict[str, list[str]] = {}
        for power in game.orderable_powers():
            played = players[power] is labellers[power]
            decision = label_decision(game, power, labellers[power], index, gseed, played, prompt_options)
            decisions.append(decision)
            orders[power] = list(decision.orders) if played else list(players[power].orders(game, power))
        game.step(orders)
    return decisions


def label_decision(
    game: DiplomacyGame,
    power: str,
    teacher: Agent,
    index: int,
    gseed: int,
    played: bool,
    prompt_options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> Decision:
    """What `teacher` orders for `power` in the game's current phase, as decision `index` of the game seeded
    `gseed` (`played`: whether these orders are the ones the game goes on with)."""
    legal = game.legal_orders(power)
    return Decision(
        game=index,
        game_seed=gseed,
        power=power,
        phase=legal.phase,
        kind=legal.kind.value,
        prompt=build_prompt(game, power, prompt_options).text,
        legal=legal,
        orders=tuple(teacher.orders(game, power)),
        played=played,
    )


def tokenize(
    decision: Decision,
    split: str,
    teacher: str,
    opponent: str,
    tokenizer: Any,
    table: TokenTable,
    max_prompt_tokens: int,
    completion_order: str = "province",
) -> TeacherExample | None:
    """The decision as an example: prompt and teacher completion tokenized (None if the prompt is too long)."""
    # Same call the PolicyServer makes on the prompt text (no BOS for Qwen; chat markup parsed as specials).
    prompt_ids = [int(i) for i in tokenizer.encode(decision.prompt)]
    if len(prompt_ids) > max_prompt_tokens:
        return None
    lines = ordered_lines(decision.legal, decision.orders, completion_order)
    return TeacherExample(
        game=decision.game,
        game_seed=decision.game_seed,
        split=split,
        power=decision.power,
        phase=decision.phase,
        kind=decision.kind,
        prompt_ids=prompt_ids,
        completion_ids=teacher_completion(decision.legal, lines, tokenizer, table),
        legal=decision.legal.to_dict(),
        orders=lines,
        teacher=teacher,
        opponent=opponent,
        played=decision.played,
    )
