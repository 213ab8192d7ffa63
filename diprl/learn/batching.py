"""From training records to padded micro-batches: masks rebuilt, lengths packed under a token budget.

The learner is blind to game logic: each record carries its legal orders, and the constraint masks
are rebuilt here with the same `OrderConstraint` the sampler used, so the trainer's distribution is
the sampled one (masked, then tempered). A record whose completion the constraint rejects was not
produced by our sampler and is refused with a clear error rather than trained on; the error is a
`BadRecord` carrying a short reason code, so the learner can quarantine that one record and train the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from diprl.game.legal import PowerOrders
from diprl.learn.prefix import PrefixLayout, build_tree, pack_shared, packed_layout
from diprl.messages import PolicyRef, TrainingRecord
from diprl.policy.constraint import ConstraintViolation, OrderConstraint
from diprl.policy.vocab import TokenTable

MIN_TEMPERATURE = 1e-5
"""vLLM treats a temperature below this as greedy decoding (`vllm.sampling_params._SAMPLING_EPS`)."""


class BadRecord(ValueError):
    """A training record the learner must not train on; `reason` is a short code for counting and quarantine.

    Reasons: `malformed` (missing or mistyped fields, empty ids), `too_long` (over the model's
    `max_model_len`), `bad_temperature`, `length_mismatch` (not one logprob and advantage per token),
    `nonfinite` (NaN/inf behaviour logprob or advantage), `constraint` (a completion the rebuilt
    constraint rejects: not one our sampler produced).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def choice_positions(allowed: Sequence[np.ndarray]) -> np.ndarray:
    """The positions whose constraint allows more than one id. The others are **forced**: log-probability 0
    and entropy 0 whatever the weights, so the head skips them (`diprl.learn.model.completion_logprobs`)."""
    return np.asarray([i for i, a in enumerate(allowed) if len(a) != 1], dtype=np.int64)


@dataclass
class PreparedRecord:
    """One completion with its per-token masks, temperature and (for GRPO) behaviour logprobs and advantages.

    `free` (from `allowed`, once): the completion positions with a choice; the rest are forced.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    allowed: list[np.ndarray]  # sorted allowed ids before each completion token
    temperature: float
    behaviour: list[float]
    advantages: list[float]
    policy_version: PolicyRef  # the version that sampled it: its weights give the old logprobs
    # Filled by the learner's recompute pass: the trainer's logprobs under the behaviour version's
    # weights (None: the current weights are those weights) and under the EMA reference.
    logp_old: list[float] | None = None
    logp_ref: list[float] | None = None
    free: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.free = choice_positions(self.allowed)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def forced(self) -> int:
        """Completion tokens with one allowed id (no head, no gradient)."""
        return len(self.completion_ids) - len(self.free)


def _describe(record: TrainingRecord, index: int) -> str:
    return f"record {index} ({record.power} {record.phase}, {record.policy_version})"


def prepare_record(
    record: TrainingRecord,
    table: TokenTable,
    index: int = 0,
    *,
    need_rl_fields: bool = True,
    max_len: int | None = None,
) -> PreparedRecord:
    """Validate one `TrainingRecord` and rebuild its masks; `BadRecord` names the record and the problem.

    `need_rl_fields` False (behaviour cloning) ignores `behaviour_logprobs` and `advantages`. The
    record's fields are checked, not trusted: it crossed a process boundary.
    """
    where = _describe(record, index)
    try:
        prompt = [_token_id(t) for t in record.prompt_ids]
        completion = [_token_id(t) for t in record.completion_ids]
        legal = PowerOrders.from_dict(record.legal)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise BadRecord("malformed", f"{where}: malformed training record ({type(err).__name__}: {err})") from None
    if not prompt or not completion:
        raise BadRecord("malformed", f"{where}: empty prompt or completion")
    if not isinstance(record.policy_version, PolicyRef):
        raise BadRecord("malformed", f"{where}: policy_version {record.policy_version!r:.80} is not a PolicyRef")
    if min(prompt) < 0 or max(prompt) >= table.vocab_size:
        raise BadRecord("malformed", f"{where}: a prompt token id is outside the vocabulary [0, {table.vocab_size})")
    if max_len is not None and len(prompt) + len(completion) > max_len:
        raise BadRecord(
            "too_long", f"{where}: {len(prompt) + len(completion)} tokens exceed the model's max_model_len {max_len}"
        )
    try:
        temperature = float(record.temperature)
    except (TypeError, ValueError):
        raise BadRecord("bad_temperature", f"{where}: temperature {record.temperature!r} is not a number") from None
    if not (MIN_TEMPERATURE <= temperature < float("inf")):
        raise BadRecord(
            "bad_temperature",
            f"{where}: temperature must be finite and >= {MIN_TEMPERATURE:g} (below it vLLM samples greedily, "
            f"which is no tempered distribution to train on), got {temperature}",
        )
    n = len(completion)
    if need_rl_fields:
        try:
            behaviour = [float(x) for x in record.behaviour_logprobs or []]
            advantages = [float(x) for x in record.advantages or []]
        except (TypeError, ValueError) as err:
            raise BadRecord("malformed", f"{where}: behaviour logprobs or advantages are not numbers ({err})") from None
        if len(behaviour) != n or len(advantages) != n:
            raise BadRecord(
                "length_mismatch",
                f"{where}: {n} completion tokens but {len(behaviour)} behaviour logprobs and "
                f"{len(advantages)} advantages (one of each per token)",
            )
        if not all(np.isfinite(behaviour)) or not all(np.isfinite(advantages)):
            raise BadRecord("nonfinite", f"{where}: non-finite behaviour logprob or advantage")
    else:
        behaviour, advantages = [0.0] * n, [0.0] * n
    try:
        allowed = OrderConstraint(legal, table).masks_for(completion)
    except ConstraintViolation as err:
        raise BadRecord("constraint", f"{where}: completion is not one the constraint allows: {err}") from None
    return PreparedRecord(prompt, completion, allowed, temperature, behaviour, advantages, record.policy_version)


def _token_id(value: Any) -> int:
    """A token id as an int; a bool, float or string is malformed, not silently converted."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"a token id must be an int, got {type(value).__name__} {value!r:.40}")
    return int(value)


def pack_by_tokens(lengths: Sequence[int], budget: int, min_batches: int = 1) -> list[list[int]]:
    """Indices grouped into micro-batches whose padded size (count x longest) stays within `budget`.

    Longest first, first fit: forks of one state have nearly equal lengths, so padding stays small.
    A sequence longer than the budget gets a micro-batch of its own (it cannot be split). With fewer
    micro-batches than `min_batches`, the records are re-spread over that many (longest to the
    least loaded), as long as there are records to spread.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    target = min(min_batches, len(order))
    if len(batches) < target:
        batches = [[] for _ in range(target)]
        for i in order:
            least = min(
                range(target),
                key=lambda b: ((len(batches[b]) + 1) * max([lengths[i], *(lengths[j] for j in batches[b])]), b),
            )
            batches[least].append(i)
    return batches


@dataclass
class MicroBatch:
    """The model's input plus the flat per-completion-token view the loss works on.

    Unshared: right-padded rows, one per record (`attention_mask` marks the real tokens). Shared:
    one packed prefix tree (`prefix` holds its positions and attention blocks, `diprl.learn.prefix`).
    `rows`/`cols` locate the hidden state that predicts each completion token (position before it).
    """

    input_ids: torch.Tensor  # [B, L] unshared, [1, N] shared
    attention_mask: torch.Tensor | None  # [B, L] unshared, None shared
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    temperatures: torch.Tensor  # [N]
    allowed: list[np.ndarray]  # N entries
    free: np.ndarray  # [F] positions with more than one allowed id (the records' `free`, offset)
    behaviour: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    logp_old: torch.Tensor  # [N], NaN where the current weights are the behaviour weights
    logp_ref: torch.Tensor  # [N], NaN where no reference was computed
    record_slices: list[tuple[int, int]]  # [start, end) of each record's tokens in the flat view
    prefix: PrefixLayout | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def padded_tokens(self) -> int:
        """Tokens forwarded: padding included in the unshared path, each shared prefix once in the shared one."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        move = {
            k: getattr(self, k).to(device)
            for k in (
                "input_ids",
                "rows",
                "cols",
                "targets",
                "temperatures",
                "behaviour",
                "advantages",
                "logp_old",
                "logp_ref",
            )
        }
        return MicroBatch(
            **move,
            attention_mask=self.attention_mask.to(device) if self.attention_mask is not None else None,
            allowed=self.allowed,
            free=self.free,
            record_slices=self.record_slices,
            prefix=self.prefix.to(device) if self.prefix is not None else None,
        )


def _token_view(
    records: Sequence[PreparedRecord],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    rows: list[int],
    cols: list[int],
    prefix: PrefixLayout | None = None,
) -> MicroBatch:
    """The micro-batch around `input_ids`, given where each record's completion tokens are predicted (in order)."""
    targets: list[int] = []
    temps: list[float] = []
    allowed: list[np.ndarray] = []
    free: list[np.ndarray] = []
    behaviour: list[float] = []
    advantages: list[float] = []
    logp_old: list[float] = []
    logp_ref: list[float] = []
    slices: list[tuple[int, int]] = []
    for r in records:
        start = len(targets)
        n = len(r.completion_ids)
        targets.extend(r.completion_ids)
        temps.extend([r.temperature] * n)
        allowed.extend(r.allowed)
        free.append(start + r.free)
        behaviour.extend(r.behaviour)
        advantages.extend(r.advantages)
        nan = [float("nan")] * n
        logp_old.extend(r.logp_old if r.logp_old is not None else nan)
        logp_ref.extend(r.logp_ref if r.logp_ref is not None else nan)
        slices.append((start, len(targets)))
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        rows=torch.tensor(rows, dtype=torch.long),
        cols=torch.tensor(cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        allowed=allowed,
        free=np.concatenate(free) if free else np.zeros(0, dtype=np.int64),
        behaviour=torch.tensor(behaviour, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        logp_old=torch.tensor(logp_old, dtype=torch.float32),
        logp_ref=torch.tensor(logp_ref, dtype=torch.float32),
        record_slices=slices,
        prefix=prefix,
    )


def collate(records: Sequence[PreparedRecord], pad_id: int) -> MicroBatch:
    """Right-pad `records` into one micro-batch (right padding leaves every real token's attention unchanged)."""
    width = max(r.length for r in records)
    input_ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(records), width), dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    for b, r in enumerate(records):
        ids = r.prompt_ids + r.completion_ids
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[b, : len(ids)] = 1
        p = len(r.prompt_ids)
        rows.extend([b] * len(r.completion_ids))
        cols.extend(range(p - 1, p - 1 + len(r.completion_ids)))
    return _token_view(records, input_ids, attention, rows, cols)


def shared_inputs(records: Sequence[PreparedRecord]) -> list[np.ndarray]:
    """What the shared path forwards per record: prompt and completion, less the last token (it predicts nothing)."""
    return [np.asarray(r.prompt_ids + r.completion_ids[:-1], dtype=np.int64) for r in records]


def collate_shared(records: Sequence[PreparedRecord], min_prefix_tokens: int) -> MicroBatch:
    """`records` as one packed prefix tree: every shared prefix (of `min_prefix_tokens` or more) forwarded once."""
    inputs = shared_inputs(records)
    tree = build_tree(inputs, min_prefix_tokens)
    input_ids, layout = packed_layout(tree, inputs)
    cols: list[int] = []
    for i, r in enumerate(records):
        p = len(r.prompt_ids)
        cols.extend(tree.flat_positions(i, range(p - 1, p - 1 + len(r.completion_ids))))
    return _token_view(records, input_ids, None, [0] * len(cols), cols, layout)


def micro_batches(
    records: Sequence[PreparedRecord],
    budget: int,
    min_batches: int,
    pad_id: int,
    min_prefix_tokens: int | None = None,
) -> list[tuple[list[int], MicroBatch]]:
    """(record indices, micro-batch) for every micro-batch of one optimiser step.

    `min_prefix_tokens` None: padded rows, `budget` counting padding. Otherwise packed prefix trees,
    `budget` counting the tokens of each tree (what is forwarded).
    """
    if min_prefix_tokens is None:
        groups = pack_by_tokens([r.length for r in records], budget, min_batches)
        return [(idx, collate([records[i] for i in idx], pad_id)) for idx in groups if idx]
    runs = pack_shared(shared_inputs(records), budget, min_batches, min_prefix_tokens)
    return [(idx, collate_shared([records[i] for i in idx], min_prefix_tokens)) for idx in runs]
