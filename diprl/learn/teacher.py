"""Teacher data for imitation: a bot's decisions, tokenized exactly as the policy would see and write them.

Behaviour cloning is only a warm start for RL if what is cloned is the policy's own action space:
the same prompt ids the PolicyServer tokenizes (`build_prompt(game, power).text` through the
model's tokenizer) and a completion the constrained decoder could have produced. So each teacher
decision is written as its order lines in a fixed order (the constraint accepts any order; a fixed
one gives the model one target instead of n! equally good ones), then `</orders>`, then the EOS the
constraint requires, and every token is replayed through `OrderConstraint.masks_for`: a completion
the decoder could never write raises instead of becoming a silent training target.

Bot games are dominated by movement phases and by the powers that survive longest, so the kept
decisions are stratified over (power, phase class) with a water-filling quota (`allocate`), and
held-out states come from whole held-out games: positions of one game are strongly correlated,
and a split by state would leak them into the evaluation. Different games still meet the same states
(every game opens on the same board, and bots play the same openings), so a held-out decision whose
state (power and prompt) also occurs in a training game is dropped too: held out by game and by state.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from diprl.bots import BOT_NAMES, make_agent
from diprl.bots.base import seat_seed
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, validate_orders
from diprl.game.orders import WAIVE
from diprl.messages import BOT_PREFIX, PolicyRef, TrainingRecord, UnknownPolicyRef
from diprl.policy.constraint import CLOSE_TAG, OrderConstraint
from diprl.policy.prompt import build_prompt
from diprl.policy.vocab import TokenTable

SPLITS = ("train", "heldout")
TEACHER_DIR = "teacher"
MANIFEST = "manifest.json"
SHARD_FORMAT = 1
GAME_SEED_STRIDE = 100003
"""Game `i` of a run seeded `s` has seed `s * stride + i` (the arena's scheme, so runs do not share games)."""

PHASE_CLASSES = ("movement", "retreat", "adjustment")
_CLASS_OF = {
    PhaseKind.MOVEMENT: "movement",
    PhaseKind.RETREAT: "retreat",
    PhaseKind.BUILD: "adjustment",
    PhaseKind.DISBAND: "adjustment",
}


class TeacherError(ValueError):
    """Bad teacher configuration, or teacher output the policy could not have produced."""


def teacher_bot(teacher: str) -> str:
    """The bot name of `dumbbot` or `bot:dumbbot`; an unknown name lists the known ones."""
    try:
        ref = PolicyRef.parse(teacher if teacher.startswith(BOT_PREFIX) else f"{BOT_PREFIX}{teacher}")
    except UnknownPolicyRef:
        ref = None
    name = ref.name if ref is not None else teacher
    if ref is None or name not in BOT_NAMES:
        raise TeacherError(f"unknown teacher {teacher!r}: a teacher is a rule bot, one of {', '.join(BOT_NAMES)}")
    return name


def phase_class(kind: PhaseKind) -> str:
    """Movement, retreat or adjustment (builds and disbands share a class: both are rare)."""
    try:
        return _CLASS_OF[kind]
    except KeyError:
        raise TeacherError(f"phase kind {kind.value!r} has no orders to imitate") from None


@dataclass
class TeacherConfig:
    """Which games to play and which decisions to keep.

    `train_examples` / `heldout_examples` cap the kept decisions per split (None keeps all); the
    cap is shared over the 7 x 3 (power, phase class) strata by `class_weights`, equally over
    powers, and what a small stratum cannot use goes to the others.
    """

    teacher: str = "dumbbot"
    games: int = 20
    heldout_games: int | None = None  # default: a fifth of the games, at least 1
    max_year: int = 1905
    seed: int = 0
    train_examples: int | None = None
    heldout_examples: int | None = 200
    class_weights: dict[str, float] = field(
        default_factory=lambda: {"movement": 0.5, "retreat": 0.2, "adjustment": 0.3}
    )
    max_prompt_tokens: int = 1536
    shard_size: int = 256

    def __post_init__(self) -> None:
        teacher_bot(self.teacher)
        problems = []
        if self.games < 2:
            problems.append(f"games must be >= 2 (one to train on, one held out), got {self.games}")
        if self.heldout_games is not None and not 1 <= self.heldout_games < self.games:
            problems.append(f"heldout_games must be in [1, games), got {self.heldout_games} of {self.games}")
        if self.max_year < 1901:
            problems.append(f"max_year must be >= 1901, got {self.max_year}")
        for name in ("train_examples", "heldout_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be positive or null, got {value}")
        unknown = sorted(set(self.class_weights) - set(PHASE_CLASSES))
        if unknown or any(w < 0 for w in self.class_weights.values()) or not any(self.class_weights.values()):
            problems.append(f"class_weights needs non-negative weights over {PHASE_CLASSES}, got {self.class_weights}")
        if self.shard_size < 1:
            problems.append(f"shard_size must be positive, got {self.shard_size}")
        if problems:
            raise TeacherError("teacher config: " + "; ".join(problems))

    @property
    def n_heldout_games(self) -> int:
        return self.heldout_games if self.heldout_games is not None else max(1, self.games // 5)


@dataclass
class TeacherExample:
    """One teacher decision, ready for the learner (`to_training_record`) and the agreement metric."""

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

    @property
    def stratum(self) -> tuple[str, str]:
        return self.power, phase_class(PhaseKind(self.kind))

    def to_training_record(self) -> TrainingRecord:
        """The teacher is deterministic, so its logprobs are 0 and every token has advantage 1
        (behaviour cloning ignores both; GRPO code sees well-formed data)."""
        n = len(self.completion_ids)
        return TrainingRecord(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            behaviour_logprobs=[0.0] * n,
            legal=self.legal,
            advantages=[1.0] * n,
            policy_version=str(PolicyRef.bot_ref(self.teacher)),
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


def ordered_lines(legal: PowerOrders, orders: Sequence[str]) -> list[str]:
    """The teacher's orders in the fixed completion order: by province as `legal.locs` lists them
    (sorted), WAIVEs last. Raises for orders the teacher should never give."""
    accepted, issues = validate_orders(legal, list(orders))
    if issues:
        detail = "; ".join(f"{i.kind.value} {i.order!r}: {i.detail}" for i in issues)
        raise TeacherError(f"teacher orders for {legal.power} in {legal.phase} are not a legal set: {detail}")
    rank = {loc: i for i, loc in enumerate(legal.locs)}
    return sorted(accepted, key=lambda o: (o == WAIVE, rank.get(legal.loc_of.get(o, ""), len(rank))))


def completion_text(lines: Sequence[str]) -> str:
    """What the decoder writes after the primed `<orders>\\n`: one line per order, then the close tag."""
    return "".join(f"{line}\n" for line in lines) + CLOSE_TAG


def teacher_completion(legal: PowerOrders, orders: Sequence[str], tokenizer: Any, table: TokenTable) -> list[int]:
    """Token ids of the teacher's orders as the constrained decoder would write them, EOS included.

    Every token is checked against `OrderConstraint.masks_for` (which raises on a token the
    constraint forbids), and the completion must leave the constraint done.
    """
    ids = [int(i) for i in tokenizer.encode(completion_text(ordered_lines(legal, orders)), add_special_tokens=False)]
    ids.append(table.eos_id)
    constraint = OrderConstraint(legal, table)
    try:
        constraint.masks_for(ids)
    except ValueError as exc:
        raise TeacherError(
            f"teacher completion for {legal.power} in {legal.phase} breaks the constraint: {exc}"
        ) from exc
    if not constraint.done:
        raise TeacherError(f"teacher completion for {legal.power} in {legal.phase} does not finish the constraint")
    return ids


# ---------------------------------------------------------------------------- stratification


def allocate(available: Mapping[Any, int], weights: Mapping[Any, float], total: int) -> dict[Any, int]:
    """Split `total` over strata in proportion to `weights`, never above what a stratum has.

    Water-filling: a stratum that cannot take its share keeps all it has, and the rest is shared
    again over the others, so the total is met whenever enough examples exist. Shares are
    rounded down and the remainder goes, one each, to the strata with the largest fractional
    parts (ties by key order), which makes the result deterministic.
    """
    out = {key: 0 for key in available}
    open_keys = [k for k in sorted(available) if available[k] > 0 and weights.get(k, 0.0) > 0]
    left = min(total, sum(available[k] for k in open_keys))
    while left > 0 and open_keys:
        weight = sum(weights[k] for k in open_keys)
        shares = {k: left * weights[k] / weight for k in open_keys}
        full = [k for k in open_keys if shares[k] >= available[k] - out[k]]
        if full:
            for k in full:
                left -= available[k] - out[k]
                out[k] = available[k]
            open_keys = [k for k in open_keys if k not in full]
            continue
        floors = {k: int(shares[k]) for k in open_keys}
        for k in open_keys:
            out[k] += floors[k]
        rest = left - sum(floors.values())
        for k in sorted(open_keys, key=lambda k: (-(shares[k] - floors[k]), open_keys.index(k)))[:rest]:
            out[k] += 1
        left = 0
    return out


def stratified_sample(
    candidates: Sequence[TeacherExample], limit: int | None, class_weights: Mapping[str, float], rng: random.Random
) -> list[TeacherExample]:
    """Up to `limit` candidates, spread over (power, phase class) strata by `allocate`."""
    if limit is None or limit >= len(candidates):
        return list(candidates)
    by_stratum: dict[tuple[str, str], list[TeacherExample]] = {}
    for example in candidates:
        by_stratum.setdefault(example.stratum, []).append(example)
    powers = sorted({p for p, _ in by_stratum})
    weights = {(p, c): class_weights.get(c, 0.0) / max(len(powers), 1) for p, c in by_stratum}
    quota = allocate({k: len(v) for k, v in by_stratum.items()}, weights, limit)
    kept: list[TeacherExample] = []
    for key in sorted(by_stratum):
        kept.extend(rng.sample(by_stratum[key], quota[key]))
    return sorted(kept, key=lambda e: (e.game, _phase_order(e.phase), e.power))


def _phase_order(phase: str) -> tuple[int, int]:
    """Chronological key of a phase name such as S1901M / F1901R / W1901A."""
    season = {"S": 0, "F": 1, "W": 2}.get(phase[:1], 3)
    sub = {"M": 0, "R": 1, "A": 2}.get(phase[-1:], 3)
    return int(phase[1:5]) if phase[1:5].isdigit() else 0, season * 3 + sub


def strata_counts(examples: Iterable[TeacherExample]) -> dict[str, int]:
    """`"POWER/class" -> n`, for manifests and reports."""
    counts = Counter(f"{p}/{c}" for p, c in (e.stratum for e in examples))
    return dict(sorted(counts.items()))


# ------------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class _Decision:
    game: int
    game_seed: int
    power: str
    phase: str
    kind: str
    prompt: str
    legal: PowerOrders
    orders: tuple[str, ...]


def game_seed(base_seed: int, index: int) -> int:
    return base_seed * GAME_SEED_STRIDE + index


def play_teacher_game(bot: str, index: int, seed: int, max_year: int) -> list[_Decision]:
    """Every decision of one game in which the teacher plays all seven powers (seeded per seat)."""
    gseed = game_seed(seed, index)
    game = DiplomacyGame(max_year=max_year)
    agents = {power: make_agent(bot, seat_seed(gseed, seat)) for seat, power in enumerate(game.powers)}
    decisions: list[_Decision] = []
    while not game.is_done:
        orders: dict[str, list[str]] = {}
        for power in game.orderable_powers():
            legal = game.legal_orders(power)
            orders[power] = list(agents[power].orders(game, power))
            decisions.append(
                _Decision(
                    game=index,
                    game_seed=gseed,
                    power=power,
                    phase=legal.phase,
                    kind=legal.kind.value,
                    prompt=build_prompt(game, power).text,
                    legal=legal,
                    orders=tuple(orders[power]),
                )
            )
        game.step(orders)
    return decisions


def heldout_game_indices(config: TeacherConfig) -> list[int]:
    """Which games are held out: a seeded choice, so neither split is biased to early or late seeds."""
    rng = random.Random(f"heldout:{config.seed}")
    return sorted(rng.sample(range(config.games), config.n_heldout_games))


@dataclass
class TeacherData:
    """The examples of both splits and what was generated (written to the manifest)."""

    train: list[TeacherExample]
    heldout: list[TeacherExample]
    summary: dict[str, Any]

    def split(self, name: str) -> list[TeacherExample]:
        if name not in SPLITS:
            raise TeacherError(f"unknown split {name!r}; splits are {SPLITS}")
        return self.train if name == "train" else self.heldout


def generate(config: TeacherConfig, tokenizer: Any, table: TokenTable, progress: Any = None) -> TeacherData:
    """Play `config.games` teacher games and turn the kept decisions into examples.

    `progress`, if given, is called once per finished game (e.g. a progress bar's `update`).
    Prompts over `max_prompt_tokens` are skipped and counted (the PolicyServer refuses them).
    """
    bot = teacher_bot(config.teacher)
    heldout = set(heldout_game_indices(config))
    pools: dict[str, list[_Decision]] = {split: [] for split in SPLITS}
    for index in range(config.games):
        decisions = play_teacher_game(bot, index, config.seed, config.max_year)
        pools["heldout" if index in heldout else "train"].extend(decisions)
        if progress is not None:
            progress(1)
    train_states = {(d.power, d.prompt) for d in pools["train"]}
    unseen = [d for d in pools["heldout"] if (d.power, d.prompt) not in train_states]
    seen_in_train = len(pools["heldout"]) - len(unseen)
    pools["heldout"] = unseen
    rng = random.Random(f"sample:{config.seed}")
    out: dict[str, list[TeacherExample]] = {}
    skipped = 0
    for split in SPLITS:
        limit = config.train_examples if split == "train" else config.heldout_examples
        # Stratify over cheap placeholders first, so only the kept decisions are tokenized.
        placeholders = [_placeholder(d, split, bot) for d in pools[split]]
        index_of = {id(p): i for i, p in enumerate(placeholders)}
        chosen = stratified_sample(placeholders, limit, config.class_weights, rng)
        examples = []
        for placeholder in chosen:
            decision = pools[split][index_of[id(placeholder)]]
            example = _tokenize(placeholder, decision, tokenizer, table, config.max_prompt_tokens)
            if example is None:
                skipped += 1
                continue
            examples.append(example)
        out[split] = examples
    summary = {
        "teacher": bot,
        "games": config.games,
        "heldout_games": sorted(heldout),
        "decisions": {split: len(pools[split]) for split in SPLITS},
        "heldout_seen_in_train": seen_in_train,  # held-out decisions dropped: their state is in a training game
        "examples": {split: len(out[split]) for split in SPLITS},
        "skipped_too_long": skipped,
        "strata": {split: strata_counts(out[split]) for split in SPLITS},
        "config": asdict(config),
    }
    return TeacherData(train=out["train"], heldout=out["heldout"], summary=summary)


def _placeholder(decision: _Decision, split: str, bot: str) -> TeacherExample:
    """The example without its tokens: what stratified sampling needs, at no tokenizer cost."""
    return TeacherExample(
        game=decision.game,
        game_seed=decision.game_seed,
        split=split,
        power=decision.power,
        phase=decision.phase,
        kind=decision.kind,
        prompt_ids=[],
        completion_ids=[],
        legal={},
        orders=list(decision.orders),
        teacher=bot,
    )


def _tokenize(
    placeholder: TeacherExample, decision: _Decision, tokenizer: Any, table: TokenTable, max_prompt_tokens: int
) -> TeacherExample | None:
    """The kept placeholder with its prompt and teacher completion tokenized (None if the prompt is too long)."""
    # Same call the PolicyServer makes on the prompt text (no BOS for Qwen; chat markup parsed as specials).
    prompt_ids = [int(i) for i in tokenizer.encode(decision.prompt)]
    if len(prompt_ids) > max_prompt_tokens:
        return None
    lines = ordered_lines(decision.legal, decision.orders)
    return replace(
        placeholder,
        prompt_ids=prompt_ids,
        completion_ids=teacher_completion(decision.legal, lines, tokenizer, table),
        legal=decision.legal.to_dict(),
        orders=lines,
    )


# ------------------------------------------------------------------------------------ shards


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_shards(data: TeacherData, run_dir: Path | str, shard_size: int = 256) -> Path:
    """Write `<run_dir>/teacher/<split>-<NNNNN>.jsonl` and a manifest (written last: its presence
    means every shard is complete). Returns the teacher directory."""
    directory = Path(run_dir) / TEACHER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.jsonl"):
        stale.unlink()
    (directory / MANIFEST).unlink(missing_ok=True)
    shards: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        examples = data.split(split)
        shards[split] = []
        for n, start in enumerate(range(0, len(examples), shard_size)):
            chunk = examples[start : start + shard_size]
            name = f"{split}-{n:05d}.jsonl"
            _write_text_atomic(directory / name, "".join(json.dumps(asdict(e)) + "\n" for e in chunk))
            shards[split].append({"file": name, "examples": len(chunk)})
    manifest = {"format": SHARD_FORMAT, "shards": shards, **data.summary}
    _write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return directory


def read_shards(run_dir: Path | str) -> TeacherData:
    """Read back what `write_shards` wrote; a missing manifest or shard, or a count that does not
    match the manifest, is a clear error (a killed write is never read as a smaller data set)."""
    directory = Path(run_dir) / TEACHER_DIR
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise TeacherError(f"no teacher data in {directory} (no {MANIFEST})") from None
    if manifest.get("format") != SHARD_FORMAT:
        raise TeacherError(f"{directory / MANIFEST}: unsupported format {manifest.get('format')!r}")
    out: dict[str, list[TeacherExample]] = {}
    for split in SPLITS:
        out[split] = []
        for shard in manifest["shards"][split]:
            path = directory / shard["file"]
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                raise TeacherError(f"teacher shard {path} is missing") from None
            if len(lines) != shard["examples"]:
                raise TeacherError(
                    f"teacher shard {path} has {len(lines)} examples, the manifest says {shard['examples']}"
                )
            out[split].extend(TeacherExample.from_dict(json.loads(line)) for line in lines)
    summary = {k: v for k, v in manifest.items() if k not in ("format", "shards")}
    return TeacherData(train=out["train"], heldout=out["heldout"], summary=summary)
