"""The typed messages that cross a Ray boundary, and the one parser of `PolicyRef` strings.

Every actor boundary speaks these types on both sides: rollout workers send `GenerationRequest`s to
the PolicyServer and get `Generation`s back, the league hands out `Match`es and takes `MatchResult`s,
rollout workers deliver `TrajectoryGroup`s (of `TrainingRecord`s) through the ledger into a learner's
queue, a worker reports each match it played as a `MatchReport`, a learner each step as a `StepReport`
(its faults and quarantined records typed as well: `StepFault`, `GroupRestart`, `QuarantinedRecord`),
and the evaluator each evaluation as an `EvaluationResult`. Plain dataclasses of plain values:
they pickle cheaply through Ray's object store and become JSON with their `to_dict` (the HTTP route,
quarantine files, traces, the learner's pending batch), which writes every `PolicyRef` as its text.

A `PolicyRef` names who plays a seat, as a string: `bot:<name>` (a rule bot), `base` (the bare base
model), `<policy>@v<N>` (an immutable adapter version) or `zoo:<name>` (a policy shipped in the
repository's `zoo/`, with the model preset it plays on). `PolicyRef.parse` is the only code that
reads that grammar; everything else asks the parsed object (a match's seats hold parsed refs, made
text again only where JSON is written: `seat_texts`, `to_dict`; a record's, a group's and a step
report's versions are parsed refs too). Adapter paths are built from its
validated parts only, so no string that reaches a server can name a file.

This module is the bottom layer: it imports nothing of diprl.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Literal, NamedTuple

BOT_PREFIX = "bot:"
ZOO_PREFIX = "zoo:"
BASE = "base"
"""The PolicyRef of the bare base model: no adapter, and never a valid policy name."""

POLICY_PATTERN = r"[a-z][a-z0-9_-]{0,47}"
VERSION_PATTERN = r"[1-9][0-9]{0,8}"
MAX_VERSION = 999_999_999
_BOT_RE = re.compile(r"[a-z][a-z0-9_]{0,31}", re.ASCII)
_ZOO_RE = re.compile(r"[a-z][a-z0-9_-]{0,47}", re.ASCII)
_ADAPTER_RE = re.compile(rf"(?P<policy>{POLICY_PATTERN})@v(?P<version>{VERSION_PATTERN})", re.ASCII)
REF_FORMS = (
    "'bot:<name>' (a rule bot), 'base' (the base model), or '<policy>@v<N>' (an adapter version: policy is "
    "1-48 characters of lowercase ASCII letters, digits, '_' or '-' starting with a letter, N a version number "
    "from 1 without leading zeros, e.g. 'main@v3'), or 'zoo:<name>' (a shipped policy, e.g. 'zoo:best')"
)


class UnknownPolicyRef(ValueError):
    """A string that is not a PolicyRef, or one that names nobody here (an unknown bot, an unpublished version)."""


class RefKind(StrEnum):
    BOT = "bot"
    BASE = "base"
    ADAPTER = "adapter"
    ZOO = "zoo"


@dataclass(frozen=True, order=True)
class PolicyRef:
    """A parsed PolicyRef. Build one with `PolicyRef.parse(text)`, `PolicyRef.bot_ref(name)`,
    `PolicyRef.adapter(policy, n)` or `BASE_REF`; `str(ref)` gives the string back exactly."""

    kind: RefKind
    name: str = ""  # the bot's name, the adapter's policy or the zoo entry's; "" for base
    version: int = 0  # the adapter version number; 0 for bots and base

    @staticmethod
    def parse(text: object) -> PolicyRef:
        """The one parser of the PolicyRef grammar; `UnknownPolicyRef` for anything else.

        Versions start at 1 and have no leading zeros, so a version has exactly one spelling (`p@v01` and
        `p@v1` cannot become two cache entries for one adapter).
        """
        if not isinstance(text, str):
            raise UnknownPolicyRef(f"a PolicyRef must be a string, got {type(text).__name__}; use {REF_FORMS}")
        if text == BASE:
            return BASE_REF
        if text.startswith(BOT_PREFIX):
            name = text[len(BOT_PREFIX) :]
            if _BOT_RE.fullmatch(name) is None:
                raise UnknownPolicyRef(f"malformed bot reference {text[:80]!r}; use {REF_FORMS}")
            return PolicyRef(RefKind.BOT, name)
        if text.startswith(ZOO_PREFIX):
            name = text[len(ZOO_PREFIX) :]
            if _ZOO_RE.fullmatch(name) is None:
                raise UnknownPolicyRef(f"malformed zoo reference {text[:80]!r}; use {REF_FORMS}")
            return PolicyRef(RefKind.ZOO, name)
        match = _ADAPTER_RE.fullmatch(text)
        if match is None or match["policy"] == BASE:
            raise UnknownPolicyRef(f"unknown PolicyRef {text[:80]!r}; use {REF_FORMS}")
        return PolicyRef(RefKind.ADAPTER, match["policy"], int(match["version"]))

    @staticmethod
    def parse_adapter(text: object) -> PolicyRef:
        """`PolicyRef.parse` for where only a trained policy's version `<policy>@v<N>` makes sense (a learner's
        publish, a replica's refusal): `UnknownPolicyRef` for a bot, `base` or a zoo entry too."""
        try:
            ref = PolicyRef.parse(text)
        except UnknownPolicyRef as exc:
            raise UnknownPolicyRef(f"invalid adapter name for a trained policy's version: {exc}") from None
        if not ref.is_adapter:
            what = {RefKind.BASE: "the base model", RefKind.BOT: "a rule bot"}.get(ref.kind, "a zoo entry")
            raise UnknownPolicyRef(f"{text!r} is {what}, not a version of a trained policy")
        return ref

    @staticmethod
    def bot_ref(name: str) -> PolicyRef:
        return PolicyRef.parse(f"{BOT_PREFIX}{name}")

    @staticmethod
    def adapter(policy: str, version: int) -> PolicyRef:
        if isinstance(version, bool) or not isinstance(version, int):
            raise UnknownPolicyRef(f"an adapter version must be an int, got {version!r}; use {REF_FORMS}")
        return PolicyRef.parse(f"{policy}@v{version}")

    @property
    def is_bot(self) -> bool:
        return self.kind is RefKind.BOT

    @property
    def is_base(self) -> bool:
        return self.kind is RefKind.BASE

    @property
    def is_adapter(self) -> bool:
        return self.kind is RefKind.ADAPTER

    @property
    def is_zoo(self) -> bool:
        return self.kind is RefKind.ZOO

    @property
    def is_llm(self) -> bool:
        """Played by the PolicyServer (the base model or an adapter version), not by a rule bot."""
        return self.kind is not RefKind.BOT

    @property
    def policy(self) -> str:
        """The trained policy an adapter version belongs to ("main@v3" -> "main"); "" for base and bots."""
        return self.name if self.is_adapter else ""

    def __str__(self) -> str:
        if self.kind is RefKind.BOT:
            return f"{BOT_PREFIX}{self.name}"
        if self.kind is RefKind.BASE:
            return BASE
        if self.kind is RefKind.ZOO:
            return f"{ZOO_PREFIX}{self.name}"
        return f"{self.name}@v{self.version}"


BASE_REF = PolicyRef(RefKind.BASE)


def parse_seats(texts: Mapping[str, str]) -> dict[str, PolicyRef]:
    """Power -> PolicyRef from power -> text (a config, a league's saved state, a JSON file)."""
    return {power: PolicyRef.parse(text) for power, text in texts.items()}


def seat_texts(seats: Mapping[str, PolicyRef]) -> dict[str, str]:
    """Power -> text, for JSON: the one place refs become strings again."""
    return {power: str(ref) for power, ref in seats.items()}


def validate_policy_name(policy: object) -> str:
    """`policy` if it can name adapter versions (`<policy>@v1` parses), else `UnknownPolicyRef`."""
    if not isinstance(policy, str) or "@" in policy or policy == BASE:
        raise UnknownPolicyRef(f"invalid policy name {policy!r}; use {REF_FORMS}")
    PolicyRef.parse(f"{policy}@v1")
    return policy


# ------------------------------------------------------------------------------------- generation
LegalOrders = Mapping[str, Any]
"""`diprl.game.legal.PowerOrders.to_dict()`: power, phase, kind, n_required, by_loc. The game layer owns
the conversion both ways (`PowerOrders.from_dict` checks it), so this layer need not know the engine."""


@dataclass(frozen=True)
class GenerationRequest:
    """One LLM seat's decision: who answers, the prompt, the legal orders that constrain the answer."""

    policy: str  # a PolicyRef played by the server: base or <policy>@v<N>
    prompt: str | tuple[int, ...] | list[int]
    legal: LegalOrders | None = None  # None: free text (no constraint)
    temperature: float = 1.0
    max_tokens: int = 384
    sample_seed: int | None = None  # seeded sampling in our logits processor (reproducible evaluation)
    reasoning_max_tokens: int | None = None
    request_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire form (the HTTP route's JSON): fields left at None are omitted."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if isinstance(out["prompt"], tuple):
            out["prompt"] = list(out["prompt"])
        return out


@dataclass(frozen=True)
class Generation:
    """The server's answer to one request; a failed request has `error` set and nothing else to trust."""

    policy: str | None
    error: str | None = None
    request_id: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # processed (masked, tempered) logprobs of token_ids
    text: str = ""
    finish_reason: str | None = None
    orders: list[str] = field(default_factory=list)  # parsed from text against the legal orders
    complete: bool = False  # every unit ordered with a legal order
    rejected: list[list[str]] = field(default_factory=list)  # [line, reason] of each unparsed line

    @property
    def trainable(self) -> bool:
        """A completion the learner can use: no error, and the ids it needs to recompute logprobs."""
        return self.error is None and bool(self.token_ids) and bool(self.prompt_ids)

    @property
    def bad(self) -> bool:
        """Failed, or not a complete legal order set (the game layer filled in defaults)."""
        return self.error is not None or not self.complete

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def failed(policy: str | None, error: str, request_id: str | None = None) -> Generation:
        return Generation(policy=policy, error=error, request_id=request_id)


# ------------------------------------------------------------------------------------------ matches
@dataclass(frozen=True)
class Match:
    """A game assignment from the league: who plays each power, the hero, the seed, and which seats train.

    `train` lists the powers whose decisions become groups for their policy's learner: the hero, and
    (with `rollout.train_seats=learners`) every other seat the league filled with a learner's current
    version. Seats played by snapshots, `base` or bots are never trained. `start` names a stored start
    state (`diprl.rollout.start_states`) the game begins from instead of spring 1901 ("" for 1901).
    """

    match_id: str
    seats: Mapping[str, PolicyRef]  # power -> who plays it
    hero: str
    seed: int
    train: tuple[str, ...] = ()
    start: str = ""

    def __post_init__(self) -> None:
        _check_seats(self.seats, self.match_id)
        if self.hero not in self.seats:
            raise ValueError(f"hero {self.hero!r} has no seat in match {self.match_id}")
        for power in self.train:
            if power not in self.seats:
                raise ValueError(f"trained seat {power!r} has no seat in match {self.match_id}")
            if not self.seats[power].is_adapter:
                raise ValueError(f"seat {power} of match {self.match_id} plays {self.seats[power]}: nothing to train")

    def ref(self, power: str) -> PolicyRef:
        return self.seats[power]

    @property
    def trains(self) -> bool:
        return bool(self.train)


@dataclass(frozen=True)
class MatchResult:
    """Centres and ranks of every seat at the horizon of one fork, and who played them (weight 1/G each)."""

    match_id: str
    fork: int
    seats: Mapping[str, PolicyRef]
    hero: str
    centres: Mapping[str, int]
    ranks: Mapping[str, int]
    final_phase: str
    solo: str | None
    forks: int = 1  # G: the league weighs each fork's result 1/G

    def __post_init__(self) -> None:
        _check_seats(self.seats, self.match_id)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seats": seat_texts(self.seats)}


def _check_seats(seats: Mapping[str, PolicyRef], match_id: str) -> None:
    for power, ref in seats.items():
        _check_ref(ref, f"seat {power} of match {match_id}")


def _check_ref(ref: object, what: str) -> None:
    """A ref given as text (or anything else) is a caller that skipped the parser: said at once, by name."""
    if not isinstance(ref, PolicyRef):
        raise TypeError(f"{what} must be a PolicyRef, got {ref!r:.80} (PolicyRef.parse)")


# ------------------------------------------------------------------------------------------ training
@dataclass
class TrainingRecord:
    """One completion the learner trains on, with everything needed to recompute its logprobs.

    The learner is blind to game logic: it rebuilds the constraint masks from `legal`.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # vLLM processed logprobs: masked and tempered
    legal: LegalOrders
    advantages: list[float]  # one per completion token
    policy_version: PolicyRef  # who sampled it (the teacher's bot for imitation data)
    temperature: float
    power: str
    phase: str
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    order_rewards: dict[str, float] = field(default_factory=dict)  # order text -> its own reward

    def __post_init__(self) -> None:
        _check_ref(self.policy_version, f"policy_version of record {self.power} {self.phase}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the version as text (`from_dict` reads it back)."""
        return {**asdict(self), "policy_version": str(self.policy_version)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> TrainingRecord:
        """A record from `to_dict`'s JSON, the text form every record on disk has (a pending batch)."""
        return TrainingRecord(**{**data, "policy_version": PolicyRef.parse(data["policy_version"])})


@dataclass
class TrajectoryGroup:
    """The G forks of one exact decision state for one seat: the unit of GRPO comparison.

    `group_id` is `<match_id>/<phase>/<power>` (`#<k>` added for a match's later fork points): the ledger
    delivers each id once.
    """

    group_id: str
    match_id: str
    power: str
    phase: str
    policy_version: PolicyRef  # who sampled it
    records: list[TrainingRecord]
    returns: list[float]
    advantage_std: float
    hero: bool = True  # the seat the league asked about (the others are trained too)

    def __post_init__(self) -> None:
        _check_ref(self.policy_version, f"policy_version of group {self.group_id}")

    @property
    def policy(self) -> str:
        """The trained policy whose queue takes this group; "" for base, a bot or a zoo entry (unroutable)."""
        return self.policy_version.policy

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the versions as text (`from_dict` reads it back)."""
        return {
            **asdict(self),
            "policy_version": str(self.policy_version),
            "records": [r.to_dict() for r in self.records],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> TrajectoryGroup:
        """A group from `to_dict`'s JSON (the learner's pending batch)."""
        records = [TrainingRecord.from_dict(r) for r in data["records"]]
        return TrajectoryGroup(
            **{**data, "policy_version": PolicyRef.parse(data["policy_version"]), "records": records}
        )


def group_id(match_id: str, phase: str, power: str, point: int = 0) -> str:
    """`<match>/<phase>/<power>` for a match's first fork point; later ones (`episode.fork_points`) add `#<k>`."""
    return f"{match_id}/{phase}/{power}" + (f"#{point}" if point else "")


class GroupSeat(NamedTuple):
    match: str
    power: str
    point: int  # which of the match's fork points (0: the first)


def group_seat(gid: str) -> GroupSeat:
    """(match, power, fork point) of a `group_id`: a match yields at most one group per power at each of its
    fork points.

    A replayed match whose sampling went another way forks at another phase; its k-th group is still the
    same seat's. An id not made by `group_id` is its own seat.
    """
    parts = gid.rsplit("/", 2)
    if len(parts) != 3:
        return GroupSeat(gid, "", 0)
    power, _, point = parts[2].partition("#")
    if point.isdigit() and int(point) > 0:
        return GroupSeat(parts[0], power, int(point))
    return GroupSeat(parts[0], parts[2], 0)


# The seconds in `MatchReport.timings`: the match's own wall time (`play`, `deliver`) and its worker's
# lockstep loop since the worker's previous report (`inference`, `engine`, `bots`), so that summed over
# reports each second of a loop that plays many matches at once counts once.
MATCH_STAGES = ("play", "deliver", "inference", "engine", "bots")


@dataclass
class PlayCounts:
    """What playing one match counted: the episode tallies it and the worker's report carries it whole."""

    phases: int = 0  # fork-phases stepped (each fork's phase counts once)
    completions: int = 0  # LLM decisions (every seat, phase and fork)
    hero_completions: int = 0  # the hero seat's LLM decisions
    bad_completions: int = 0  # malformed: the game layer played defaults for what they missed
    untrainable_completions: int = 0  # with an error or no tokens: left out of their group, never fatal
    failed_requests: int = 0  # LLM requests the server answered with an error
    first_error: str | None = None  # the first of them, as the server said it
    skipped_zero_variance: int = 0  # trained seats whose forks all scored the same (no comparison)


@dataclass
class MatchReport:
    """What a rollout worker tells the driver about one match it played (groups went to the ledger)."""

    match_id: str
    results: list[MatchResult]
    groups: list[str]  # ids of the groups the ledger accepted from this match
    counts: PlayCounts = field(default_factory=PlayCounts)
    undelivered: int = 0  # groups of this attempt the ledger refused (the run is stopping)
    group_records: int = 0
    hero_returns: list[float] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds (`MATCH_STAGES`)
    trace: str | None = None  # path of the trace written for this match, if any
    worker_pid: int = 0

    def hero_centres(self) -> float | None:
        """The hero's mean centres over the forks' horizons (None with no result)."""
        if not self.results:
            return None
        return sum(r.centres[r.hero] for r in self.results) / len(self.results)


# ------------------------------------------------------------------------------------------ learner
StepFaultKind = Literal["publish_failed", "checkpoint_failed", "nonfinite_gradients"]


@dataclass(frozen=True)
class StepFault:
    """Something a learner step went on without: a publish or checkpoint that failed (a full disk; tried
    again after the next step, `error` says why) or an update skipped on non-finite gradients (no error)."""

    fault: StepFaultKind
    step: int  # the step it happened at (for a skipped update, the step that was not taken)
    error: str | None = None

    def record(self) -> dict[str, Any]:
        """The JSON of a `fault` line in the run's metrics (the driver adds who reported it)."""
        out: dict[str, Any] = {"fault": self.fault, "step": self.step}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class GroupRestart:
    """A learner group rebuilt after a rank failed: every rank restarted from the newest checkpoint.

    `replayed_step` is the step trained again on the restored group (None when it was not: the rank
    raised, which is not retried in place, or the checkpoint already held the step)."""

    fault: ClassVar[Literal["learner_group_restarted"]] = "learner_group_restarted"
    rank: int  # the rank that failed first
    cause: Literal["rank_lost", "rank_error"]  # its process died, or it raised
    error: str
    step_before: int
    restored_step: int
    time: float  # when, as `time.time()`
    replayed_step: int | None = None

    def record(self) -> dict[str, Any]:
        """The JSON of a `fault` line in the run's metrics (the driver adds who reported it)."""
        out: dict[str, Any] = {"fault": self.fault, **asdict(self)}
        if self.replayed_step is None:
            del out["replayed_step"]
        return out


LearnerFault = StepFault | GroupRestart


@dataclass(frozen=True)
class QuarantinedRecord:
    """Why one record of a step was quarantined and where it came from, without the record (the learner's
    quarantine file keeps it whole). The version is text: a malformed record may hold anything there."""

    reason: str  # a `BadRecord` reason (nonfinite, constraint, too_long, ...), nonfinite_loss or learner_error
    error: str
    group_id: str | None  # None for records handed in without their groups (`train_records`)
    policy_version: str | None
    index: int | None = None  # the record's index in the step (None: a whole group)

    def record(self) -> dict[str, Any]:
        """The JSON of its `quarantined` fault line in the run's metrics (the driver adds who reported it)."""
        out = asdict(self)
        if self.index is None:
            del out["index"]
        return out


@dataclass
class StepReport:
    """What a learner tells the driver about one `train_step` (taken or not).

    `trained` is False when nothing was left to train on (every group stale, every record bad, or
    non-finite gradients skipped the update): then `step` is unchanged. `metrics` holds the numbers
    the run's metrics log keeps (loss parts, ratios, clip fractions, entropy, times, token counts).
    """

    policy: str
    step: int
    trained: bool
    version: PolicyRef | None  # the learner's latest version
    published: PolicyRef | None = None  # the version this step published, if any
    checkpoint: str | None = None  # the checkpoint this step wrote, if any
    faults: list[LearnerFault] = field(default_factory=list)  # failed publish/checkpoint, skipped updates, restarts
    quarantined: list[QuarantinedRecord] = field(default_factory=list)  # reason and origin of each bad record
    metrics: dict[str, Any] = field(default_factory=dict)
    pid: int = 0

    def __post_init__(self) -> None:
        for name in ("version", "published"):
            if getattr(self, name) is not None:
                _check_ref(getattr(self, name), f"StepReport.{name} of {self.policy}")

    def record(self) -> dict[str, Any]:
        """The metrics-log line of this step (faults and quarantined records are logged on their own)."""
        return {
            "step": self.step,
            "trained": int(self.trained),
            "version": _text(self.version),
            "published": _text(self.published),
            "checkpoint": self.checkpoint,
            **self.metrics,
        }


def _text(ref: PolicyRef | None) -> str | None:
    return None if ref is None else str(ref)


# ---------------------------------------------------------------------------------------- evaluator
@dataclass(frozen=True)
class OpponentResult:
    """The hero's figures against one opponent of an evaluation: what the training driver logs."""

    opponent: str  # the PolicyRef in the six other seats
    games: int
    mean_centres: float  # the hero's mean supply centres at the end
    centres_ci95: tuple[float, float]  # its 95% interval (seeded percentile bootstrap)
    solo_rate: float


@dataclass(frozen=True)
class EvaluationResult:
    """What the evaluator actor returns for one evaluation; the full report (every suite's categories,
    behaviour, per-game records) stays on disk as JSON at `report`."""

    tag: str
    policy: str
    report: str  # path of the evaluation's report.json
    opponents: tuple[OpponentResult, ...]
