"""Packing by a token budget, record validation, and the sparse masked logprobs against the dense reference."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from diprl.game import DiplomacyGame
from diprl.learn.batching import BadRecord, collate, collate_shared, pack_by_tokens, prepare_record
from diprl.learn.model import completion_logprobs
from diprl.messages import GenerationRequest, PolicyRef, TrainingRecord
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table
from diprl.rollout.clients import UniformConstrainedClient
from tests.dense_logprobs import constrained_logprobs


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return token_table(load_tokenizer(), 151936)


def _record(table: TokenTable, power: str = "FRANCE", seed: int = 0) -> TrainingRecord:
    game = DiplomacyGame()
    legal = game.legal_orders(power).to_dict()
    request = GenerationRequest(policy="main@v1", prompt=[1, 2, 3, 4, 5], legal=legal)
    [result] = UniformConstrainedClient(table, seed=seed).generate([request])
    n = len(result.token_ids)
    return TrainingRecord(
        prompt_ids=result.prompt_ids,
        completion_ids=result.token_ids,
        behaviour_logprobs=result.logprobs,
        legal=legal,
        advantages=[1.0] * n,
        policy_version=PolicyRef.adapter("main", 1),
        temperature=1.0,
        power=power,
        phase="S1901M",
    )


def test_every_bad_record_is_a_bad_record_error_with_its_reason(table: TokenTable) -> None:
    """Found: a tiny temperature (1e-40) and out-of-vocabulary prompt ids passed validation and broke the step."""
    from diprl.learn.batching import BadRecord

    record = _record(table)
    n = len(record.completion_ids)
    cases: list[tuple[TrainingRecord, str]] = [
        (replace(record, behaviour_logprobs=[float("-inf")] * n), "nonfinite"),
        (replace(record, advantages=[float("nan")] * n), "nonfinite"),
        (replace(record, advantages=[1.0]), "length_mismatch"),
        (replace(record, completion_ids=[9707, *record.completion_ids[1:]]), "constraint"),
        (replace(record, prompt_ids=[1, 2, table.vocab_size]), "malformed"),
        (replace(record, prompt_ids=[-1, 2]), "malformed"),
        (replace(record, legal=None), "malformed"),
        (replace(record, advantages=["x"] * n), "malformed"),
        (replace(record, temperature=float("nan")), "bad_temperature"),
        (replace(record, temperature=1e-40), "bad_temperature"),
        (replace(record, temperature="hot"), "bad_temperature"),
    ]
    for bad, reason in cases:
        with pytest.raises(BadRecord) as caught:
            prepare_record(bad, table, 7)
        assert caught.value.reason == reason and "record 7" in str(caught.value)
    with pytest.raises(BadRecord) as caught:
        prepare_record(record, table, max_len=4)
    assert caught.value.reason == "too_long"


def test_pack_by_tokens_respects_the_budget_and_keeps_long_ones_alone() -> None:
    # padded cost = count x longest; budget 100
    assert pack_by_tokens([30, 30, 30, 30], 100) == [[0, 1, 2], [3]]
    assert pack_by_tokens([10, 120, 50, 40], 100) == [[1], [2, 3], [0]]
    assert pack_by_tokens([], 100) == []
    # at least 2 micro-batches: spread, longest first onto the least loaded
    assert sorted(map(sorted, pack_by_tokens([30, 30, 30, 30], 1000, min_batches=2))) == [[0, 2], [1, 3]]
    assert pack_by_tokens([30], 1000, min_batches=4) == [[0]]


def test_prepare_rebuilds_one_mask_per_token_and_refuses_bad_records(table: TokenTable) -> None:
    record = _record(table)
    prepared = prepare_record(record, table)
    assert len(prepared.allowed) == len(record.completion_ids)
    # the uniform sampler's behaviour logprob is -log(#allowed): the masks are the sampler's masks
    assert prepared.behaviour == pytest.approx([-math.log(len(a)) for a in prepared.allowed])
    with pytest.raises(ValueError, match="one of each per token"):
        prepare_record(replace(record, advantages=[1.0]), table)
    with pytest.raises(ValueError, match="constraint allows"):
        bad = [9707, *record.completion_ids[1:]]  # "Hello" where an order must start
        prepare_record(replace(record, completion_ids=bad), table)
    with pytest.raises(ValueError, match="malformed"):
        prepare_record(replace(record, legal={}), table)
    unparsed = copy.copy(record)
    unparsed.policy_version = "main@v1"  # type: ignore[assignment]  # as a record unpickled past __post_init__
    with pytest.raises(BadRecord, match="policy_version 'main@v1' is not a PolicyRef"):
        prepare_record(unparsed, table)
    with pytest.raises(ValueError, match="max_model_len"):
        prepare_record(record, table, max_len=4)
    bc = prepare_record(replace(record, advantages=[], behaviour_logprobs=[]), table, need_rl_fields=False)
    assert bc.advantages == [0.0] * len(record.completion_ids)


def test_collate_points_each_target_at_the_position_before_it(table: TokenTable) -> None:
    a, b = prepare_record(_record(table, seed=1), table), prepare_record(_record(table, "ENGLAND", seed=2), table)
    mb = collate([a, b], pad_id=0)
    for (s, e), r, row in zip(mb.record_slices, [a, b], [0, 1], strict=True):
        assert mb.targets[s:e].tolist() == r.completion_ids
        assert mb.input_ids[row, mb.cols[s:e] + 1].tolist() == r.completion_ids
        assert set(mb.rows[s:e].tolist()) == {row}
    assert int(mb.attention_mask.sum()) == a.length + b.length


def test_collate_shared_points_each_target_at_the_token_and_position_before_it(table: TokenTable) -> None:
    records = [prepare_record(_record(table, power, seed=s), table) for power, s in (("FRANCE", 1), ("FRANCE", 2))]
    records.append(prepare_record(replace(_record(table, seed=3), prompt_ids=[1, 2, 3, 9]), table))  # shares 3 tokens
    mb = collate_shared(records, min_prefix_tokens=1)
    assert mb.input_ids.shape[0] == 1 and mb.prefix is not None and mb.attention_mask is None
    # every distinct prefix of the inputs (prompt + completion less its last token) forwarded once
    inputs = [r.prompt_ids + r.completion_ids[:-1] for r in records]
    assert mb.padded_tokens == len({tuple(x[:k]) for x in inputs for k in range(1, len(x) + 1)})
    assert mb.padded_tokens < sum(len(x) for x in inputs) - 2 * 3
    positions = mb.prefix.position_ids[0]
    for (s, e), r in zip(mb.record_slices, records, strict=True):
        sequence = r.prompt_ids + r.completion_ids
        before = range(len(r.prompt_ids) - 1, len(sequence) - 1)
        assert mb.targets[s:e].tolist() == r.completion_ids
        assert mb.input_ids[0, mb.cols[s:e]].tolist() == [sequence[v] for v in before]
        assert positions[mb.cols[s:e]].tolist() == list(before)


def test_a_micro_batch_carries_the_positions_its_records_leave_a_choice(table: TokenTable) -> None:
    """Forced positions (one allowed id) are found once per record; a micro-batch carries the others, offset
    into its flat view, to the head, and the step's forced-token count is the records' own."""
    records = [prepare_record(_record(table, power, seed=s), table) for power, s in (("FRANCE", 1), ("ENGLAND", 2))]
    for r in records:
        assert 0 < r.forced == sum(len(a) == 1 for a in r.allowed) < len(r.completion_ids)
    for mb in (collate(records, pad_id=0), collate_shared(records, min_prefix_tokens=1)):
        assert mb.free.tolist() == [i for i, a in enumerate(mb.allowed) if len(a) > 1]
        assert mb.to("cpu").free is mb.free


def test_sparse_masked_logprobs_equal_the_dense_reference(table: TokenTable) -> None:
    rng = np.random.default_rng(0)
    prepared = prepare_record(_record(table, seed=3), table)
    n, hidden_size = len(prepared.completion_ids), 16
    hidden = torch.tensor(rng.normal(size=(n, hidden_size)), dtype=torch.float32)
    weight = torch.tensor(rng.normal(size=(151936, hidden_size)), dtype=torch.float32)
    targets = torch.tensor(prepared.completion_ids)
    for temperature in (1.0, 0.7):
        temps = torch.full((n,), temperature)
        ours, entropy = completion_logprobs(
            hidden, weight, targets, temps, prepared.allowed, chunk_tokens=5, with_entropy=True
        )
        dense = constrained_logprobs(hidden @ weight.T, prepared.allowed, targets, temperature)
        assert torch.allclose(ours, dense, atol=1e-5)
        assert entropy is not None and bool((entropy >= -1e-6).all())
        single = [i for i, a in enumerate(prepared.allowed) if len(a) == 1]
        assert all(abs(float(entropy[i])) < 1e-6 and abs(float(ours[i])) < 1e-6 for i in single)


def test_the_head_multiplies_only_the_allowed_columns_of_positions_with_a_choice(table: TokenTable) -> None:
    """Forced positions (one allowed id) skip the head; the others meet only the rows their chunk allows.
    Same values and gradients as the dense reference over the whole 151,936-wide vocabulary."""
    from torch.utils.flop_counter import FlopCounterMode

    rng = np.random.default_rng(1)
    prepared = prepare_record(_record(table, seed=4), table)
    n, hidden_size = len(prepared.completion_ids), 16
    free = [i for i, a in enumerate(prepared.allowed) if len(a) > 1]
    assert 0 < len(free) < n  # the record has both kinds
    hidden = torch.tensor(rng.normal(size=(n, hidden_size)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(151936, hidden_size)), dtype=torch.float32)
    targets, temps = torch.tensor(prepared.completion_ids), torch.full((n,), 0.8)
    with FlopCounterMode(display=False) as counter:
        ours, _ = completion_logprobs(hidden, weight, targets, temps, prepared.allowed, chunk_tokens=n)
    union = np.unique(np.concatenate([prepared.allowed[i] for i in free]))
    assert counter.get_total_flops() == 2 * len(free) * len(union) * hidden_size
    assert all(float(ours[i]) == 0.0 for i in range(n) if i not in free)
    (grad,) = torch.autograd.grad(ours.sum(), hidden)
    dense_hidden = hidden.detach().clone().requires_grad_(True)
    dense = constrained_logprobs(dense_hidden @ weight.T, prepared.allowed, targets, 0.8)
    (dense_grad,) = torch.autograd.grad(dense.sum(), dense_hidden)
    assert torch.allclose(ours, dense, atol=1e-5) and torch.allclose(grad, dense_grad, atol=1e-5)
    with pytest.raises(ValueError, match="outside the ids its constraint allows"):
        outside = targets.clone()
        outside[free[0]] = int(np.setdiff1d(np.arange(151936), union)[0])
        completion_logprobs(hidden, weight, outside, temps, prepared.allowed, chunk_tokens=n)
