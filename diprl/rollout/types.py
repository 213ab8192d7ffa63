"""What rollouts produce and exchange: matches, training records, trajectory groups, match results.

Everything here is plain data (lists, dicts, str, float) so it crosses Ray's object store and
queues cheaply and can be written to JSON as it is. The learner sees only `TrainingRecord`s: it is
blind to game logic and rebuilds the decoding masks from the legal orders each record carries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BOT_PREFIX = "bot:"


def is_bot(ref: str) -> bool:
    """A `PolicyRef` is "bot:<name>" (a rule bot), "base", or an adapter version "<policy>@v<N>"."""
    return ref.startswith(BOT_PREFIX)


def bot_name(ref: str) -> str:
    if not is_bot(ref):
        raise ValueError(f"{ref!r} is not a bot reference ('bot:<name>')")
    return ref[len(BOT_PREFIX) :]


@dataclass(frozen=True)
class Match:
    """A game assignment: who plays each power, which power is trained (the hero), and the seed."""

    match_id: str
    seats: dict[str, str]  # power -> PolicyRef
    hero: str
    seed: int

    def __post_init__(self) -> None:
        if self.hero not in self.seats:
            raise ValueError(f"hero {self.hero!r} has no seat in match {self.match_id}")

    @property
    def trains(self) -> bool:
        """False when the hero is a rule bot: the match is played (and measured) but yields no group."""
        return not is_bot(self.seats[self.hero])


@dataclass
class TrainingRecord:
    """One completion the learner trains on, with everything needed to recompute its logprobs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # vLLM processed logprobs: masked and tempered
    legal: dict[str, Any]  # PowerOrders.to_dict(): the learner rebuilds the constraint masks from it
    advantages: list[float]  # one per completion token
    policy_version: str
    temperature: float
    power: str
    phase: str
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    order_rewards: dict[str, float] = field(default_factory=dict)  # order text -> its own reward


@dataclass
class TrajectoryGroup:
    """The G forks of one exact decision state: the unit of GRPO comparison, delivered exactly once."""

    group_id: str
    match_id: str
    hero: str
    phase: str
    policy_version: str
    records: list[TrainingRecord]
    returns: list[float]
    advantage_std: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MatchResult:
    """Centres and ranks of every seat at the horizon of one fork, and who played them."""

    match_id: str
    fork: int
    seats: dict[str, str]
    hero: str
    centres: dict[str, int]
    ranks: dict[str, int]
    final_phase: str
    solo: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
