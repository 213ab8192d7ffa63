"""Shared prefixes forwarded once give the unshared numbers: logprobs, loss and LoRA gradients within 1e-5.

The batch mixes every case the learner meets: forks with identical prompts (and two identical
completions), powers of one phase sharing the rules and the board, a later phase sharing only the
rules, a prompt that is a strict prefix of another, and prompts sharing nothing; lengths are odd and
uneven, so padding, dissolved short nodes and several micro-batches are all exercised. The model is the
tiny preset in float32 with random LoRA B (a fresh B = 0 would leave A without gradient).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from diprl.game import DiplomacyGame
from diprl.learn.batching import PreparedRecord, micro_batches, prepare_record
from diprl.learn.config import LearnerConfig
from diprl.learn.loss import grpo_loss
from diprl.learn.model import CompletionHidden, build_peft_model, completion_logprobs, load_lora_state_, lora_state
from diprl.learn.prefix import build_tree, pack_shared
from diprl.learn.prefix_attention import use_prefix_attention
from diprl.messages import Generation, GenerationRequest, PolicyRef, TrainingRecord
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.rollout.clients import UniformConstrainedClient

PAD = 0
TOLERANCE = 1e-5


def _randomise_lora_b(model: CompletionHidden, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    state = {
        k: (torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v)
        for k, v in lora_state(model.peft_model).items()
    }
    load_lora_state_(model.peft_model, state)


def _model(gradient_checkpointing: bool = False) -> CompletionHidden:
    config = LearnerConfig(gradient_checkpointing=gradient_checkpointing)
    model = CompletionHidden(build_peft_model(load_preset("tiny"), config))
    _randomise_lora_b(model, seed=1)
    model.train()  # gradient checkpointing only acts in training mode
    return model


@pytest.fixture(scope="module")
def model() -> CompletionHidden:
    return _model()


@pytest.fixture(scope="module")
def records() -> list[PreparedRecord]:
    preset = load_preset("tiny")
    tokenizer = load_tokenizer(resolve_model_path(preset))
    assert preset.tiny is not None
    table = token_table(tokenizer, preset.tiny.vocab_size)
    opening = DiplomacyGame()
    later = DiplomacyGame()
    later.step({})  # everyone holds: the next phase has another board, the same rules

    def sample(
        game: DiplomacyGame, power: str, seed: int, n: int = 1, prompt: Any = None
    ) -> list[tuple[Generation, Any]]:
        legal = game.legal_orders(power).to_dict()
        request = GenerationRequest(
            policy="main@v1", prompt=build_prompt(game, power).text if prompt is None else prompt, legal=legal
        )
        client = UniformConstrainedClient(table, seed=seed, tokenizer=tokenizer)
        return [(r, legal) for r in client.generate([request] * n)]

    forks = sample(opening, "FRANCE", seed=0, n=4)
    france_prompt = forks[0][0].prompt_ids
    results = [
        *forks,
        forks[1],  # two forks that sampled the same completion: identical inputs
        *sample(opening, "ENGLAND", seed=1),
        *sample(opening, "RUSSIA", seed=2),
        *sample(later, "FRANCE", seed=3),
        *sample(opening, "FRANCE", seed=4, prompt=france_prompt[:-7]),  # a strict prefix of the forks' prompt
        *sample(opening, "FRANCE", seed=5, prompt=[7, 8, 9]),  # shares nothing, odd and short
        *sample(opening, "FRANCE", seed=6, prompt=[7, 8, 9, 10, 11]),  # shares 3 tokens with the one above
    ]
    rng = np.random.default_rng(0)
    prepared = []
    for i, (r, legal) in enumerate(results):
        n = len(r.token_ids)
        record = TrainingRecord(
            prompt_ids=r.prompt_ids,
            completion_ids=r.token_ids,
            behaviour_logprobs=[x + float(rng.normal(0, 0.05)) for x in r.logprobs],
            legal=legal,
            advantages=list(rng.normal(size=n)),
            policy_version=PolicyRef.adapter("main", 1),
            temperature=0.7 if i % 3 == 0 else 1.0,
            power=str(legal["power"]),
            phase=str(legal["phase"]),
        )
        prepared.append(prepare_record(record, table, i))
    assert len({tuple(r.prompt_ids) for r in prepared}) == len(prepared) - 4
    return prepared


def _forward(
    model: CompletionHidden, records: list[PreparedRecord], budget: int, min_batches: int, min_prefix: int | None
) -> tuple[list[torch.Tensor], float, dict[str, torch.Tensor], int]:
    """(per-record logprobs, step loss, LoRA gradients, tokens forwarded): the learner's micro-batch loop."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    total = sum(len(r.completion_ids) for r in records)
    out: list[torch.Tensor] = [torch.empty(0)] * len(records)
    loss_total = 0.0
    forwarded = 0
    for idx, mb in micro_batches(records, budget, min_batches, PAD, min_prefix):
        hidden = model(mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.prefix)
        logp, entropy = completion_logprobs(
            hidden, model.lm_head_weight, mb.targets, mb.temperatures, mb.allowed, chunk_tokens=64, with_entropy=True
        )
        loss, _ = grpo_loss(
            logp,
            logp.detach() + 0.01,  # a ratio away from 1, so the clip terms are live
            mb.behaviour,
            mb.advantages,
            total_tokens=total,
            clip_low=0.2,
            clip_high=0.28,
            tis_cap=2.0,
            entropy=entropy,
            entropy_coef=0.01,
        )
        loss.backward()
        loss_total += float(loss.detach())
        forwarded += mb.padded_tokens
        for i, (s, e) in zip(idx, mb.record_slices, strict=True):
            out[i] = logp[s:e].detach()
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    assert len(grads) == len(params)
    return out, loss_total, grads, forwarded


@pytest.fixture(scope="module")
def unshared(model: CompletionHidden, records: list[PreparedRecord]) -> tuple[Any, ...]:
    return _forward(model, records, budget=10**9, min_batches=1, min_prefix=None)


def _assert_same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    logps, loss, grads, _ = got
    ref_logps, ref_loss, ref_grads, _ = want
    worst = max(float((a - b).abs().max()) for a, b in zip(logps, ref_logps, strict=True))
    assert worst < TOLERANCE, f"max |shared - unshared| logprob = {worst:.2e}"
    assert abs(loss - ref_loss) < TOLERANCE, (loss, ref_loss)
    worst_grad = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-3, "the gradients are too small to tell anything apart"
    assert worst_grad < TOLERANCE, f"max |shared - unshared| LoRA gradient = {worst_grad:.2e} (largest {scale:.2e})"


@pytest.mark.parametrize(
    ("budget", "min_batches", "min_prefix"),
    [
        (10**9, 1, 16),  # everything in one tree
        (10**9, 1, 1),  # every shared stretch shared, however short
        (10**9, 1, 10**6),  # nothing shared: each record its own root
        (700, 3, 16),  # a budget that splits the tree, and at least three micro-batches
    ],
)
def test_shared_prefixes_give_the_unshared_logprobs_loss_and_gradients(
    model: CompletionHidden,
    records: list[PreparedRecord],
    unshared: tuple[Any, ...],
    budget: int,
    min_batches: int,
    min_prefix: int,
) -> None:
    got = _forward(model, records, budget, min_batches, min_prefix)
    _assert_same(got, unshared)
    if min_prefix <= 16 and budget > 10**6:
        assert got[3] < unshared[3] / 2, (got[3], unshared[3])  # and it forwards far fewer tokens


def test_gradient_checkpointing_keeps_the_shared_prefix_exact(
    records: list[PreparedRecord], unshared: tuple[Any, ...]
) -> None:
    """The GPU learner checkpoints every layer: the replayed layers must see the same packed tree."""
    checkpointed = _model(gradient_checkpointing=True)
    _assert_same(_forward(checkpointed, records, 10**9, 1, 16), unshared)


def test_the_unshared_path_is_transformers_own_sdpa(records: list[PreparedRecord], unshared: tuple[Any, ...]) -> None:
    """Installing the prefix attention changes nothing for padded rows: a model built without it agrees."""
    plain = CompletionHidden(build_peft_model(load_preset("tiny"), LearnerConfig(prefix_sharing=False)))
    _randomise_lora_b(plain, seed=1)
    plain.train()
    assert plain.peft_model.get_base_model().config._attn_implementation == "sdpa"
    got = _forward(plain, records, 10**9, 1, None)
    assert all(torch.equal(a, b) for a, b in zip(got[0], unshared[0], strict=True))
    with pytest.raises(RuntimeError, match="prefix_sharing"):
        _forward(plain, records, 10**9, 1, 16)


def test_a_model_without_sdpa_is_refused_with_the_reason() -> None:
    peft = build_peft_model(load_preset("tiny"), LearnerConfig(prefix_sharing=False))
    base = peft.get_base_model()
    base.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"'sdpa'.*prefix_sharing=false"):
        use_prefix_attention(base)


def test_prefix_tree_shares_what_is_common_and_dissolves_short_nodes() -> None:
    inputs = [np.array(x) for x in ([1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7], [9], [1, 2, 3, 4, 5])]
    tree = build_tree(inputs, min_tokens=1)
    # [1 2 3] -> ([4] -> [5] (twice), [7]), [6]; and [9] alone
    assert [(n.start, n.end) for n in tree.nodes] == [(0, 3), (3, 4), (4, 5), (4, 5), (3, 4), (0, 1)]
    assert tree.num_tokens == 8
    assert tree.leaf[0] == tree.leaf[4]  # identical inputs end in the same node
    for i, x in enumerate(inputs):
        flat = np.concatenate([inputs[n.source][n.start : n.end] for n in tree.nodes])
        assert flat[tree.flat_positions(i, range(len(x)))].tolist() == x.tolist()
    # the one-token [4] shared by two branches is repeated in each instead
    tree = build_tree(inputs, min_tokens=2)
    assert [(n.start, n.end) for n in tree.nodes] == [(0, 3), (3, 5), (3, 5), (3, 4), (0, 1)]
    assert tree.num_tokens == 9
    with pytest.raises(IndexError):
        tree.flat_positions(1, [4])


def test_pack_shared_keeps_each_tree_within_the_budget() -> None:
    rng = np.random.default_rng(1)
    stems = [rng.integers(0, 50, size=60) for _ in range(3)]
    inputs = [np.concatenate([stems[i % 3], rng.integers(0, 50, size=int(rng.integers(1, 30)))]) for i in range(40)]
    for budget, min_batches in ((400, 1), (10**6, 1), (10**6, 5), (50, 1)):
        runs = pack_shared(inputs, budget, min_batches, min_tokens=8)
        assert sorted(i for run in runs for i in run) == list(range(len(inputs)))
        assert len(runs) >= min_batches
        for run in runs:
            tokens = build_tree([inputs[i] for i in run], 8).num_tokens
            assert tokens <= budget or len(run) == 1, (budget, tokens, len(run))
    assert len(pack_shared(inputs, 10**6, 1, 8)) == 1
    assert sorted(map(sorted, pack_shared(inputs[:2], 10**6, 4, 8))) == [[0], [1]]  # as many as there are records


def test_learner_config_validates_prefix_min_tokens() -> None:
    with pytest.raises(ValueError, match="prefix_min_tokens"):
        LearnerConfig(prefix_min_tokens=0)
