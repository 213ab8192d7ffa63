"""Real vLLM (CPU build) with the tiny Qwen3: constrained sampling is always legal, and its
behaviour log-probabilities equal the masked, tempered ones recomputed with transformers.

Both vocabularies: the compact BPE of the CPU presets and Qwen3's own (the GPU models'), one engine
each for the whole module."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from diprl.bots import make_agent
from diprl.game import DiplomacyGame, PhaseKind
from diprl.inference.engine import EngineConfig, OrderRequest, generate_orders, make_llm
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import TinyModelSpec, TokenizerKind, build_tiny_model, load_preset, resolve_model_path
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.torch_threads import torch_threads
from tests.dense_logprobs import constrained_logprobs


def decision_states(n: int, seed: int = 0) -> list[OrderRequest]:
    """`n` requests from seeded bot games, every phase kind represented."""
    rng = random.Random(seed)
    requests: list[OrderRequest] = []
    game_seed = 0
    while len(requests) < n:
        game = DiplomacyGame(max_year=1912)
        agents = {
            p: make_agent(rng.choice(["dumbbot", "random", "chaos"]), game_seed * 7 + i)
            for i, p in enumerate(game.powers)
        }
        while not game.is_done and len(requests) < n:
            for power in game.orderable_powers():
                # Keep every non-movement decision, and a sample of movement ones.
                if game.legal_orders(power).kind is not PhaseKind.MOVEMENT or rng.random() < 0.3:
                    requests.append(OrderRequest(build_prompt(game, power).text, game.legal_orders(power)))
            game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
        game_seed += 1
    return requests[:n]


@pytest.fixture(scope="module", params=["compact", "qwen3"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    if request.param == "compact":
        path = str(resolve_model_path(load_preset("tiny")))
    else:
        path = str(build_tiny_model(TinyModelSpec(vocab_size=151936, tokenizer=TokenizerKind.qwen3)))
    with torch_threads():  # vLLM sets torch to its own count in-process
        llm = make_llm(EngineConfig(model=path, max_model_len=2048, max_num_seqs=128))
        yield llm, path
        del llm


def test_constrained_sampling_is_always_a_complete_legal_order_set(engine: tuple[Any, str]) -> None:
    llm, _ = engine
    requests = decision_states(210)
    kinds = Counter(r.legal.kind for r in requests)
    assert set(kinds) == {PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND}, kinds
    generations = generate_orders(llm, requests, temperature=1.0)
    failures = [
        (r.legal.phase, r.legal.power, g.text, g.parsed.rejected)
        for r, g in zip(requests, generations, strict=True)
        if not g.complete
    ]
    assert failures == []
    assert all(g.finish_reason == "stop" for g in generations)
    # A random-weight model writes nothing legal on its own: the constraint does all the work.
    free = generate_orders(
        llm, [OrderRequest(r.prompt, r.legal, constrained=False) for r in requests[:20]], max_tokens=48
    )
    assert sum(g.complete for g in free) == 0


def test_a_seeded_request_writes_the_same_orders_in_any_batch(engine: tuple[Any, str]) -> None:
    """Evaluation's reproducibility: the same seeded decision alone, and inside a batch of 31 others."""
    llm, _ = engine
    states = decision_states(32, seed=3)
    seeded = [replace(r, sample_seed=1000 + i) for i, r in enumerate(states[:4])]
    alone = [generate_orders(llm, [r], temperature=1.0)[0] for r in seeded]
    crowd = generate_orders(llm, [*states[4:], *seeded[::-1]], temperature=1.0)[-4:][::-1]
    assert [g.token_ids for g in alone] == [g.token_ids for g in crowd]
    assert all(g.complete for g in alone)
    other_seed = generate_orders(llm, [replace(r, sample_seed=2000 + i) for i, r in enumerate(states[:4])])
    assert [g.token_ids for g in other_seed] != [g.token_ids for g in alone]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_transformers_under_the_same_mask(engine: tuple[Any, str], temperature: float) -> None:
    from transformers import AutoModelForCausalLM

    llm, path = engine
    requests = decision_states(24, seed=3)
    generations = generate_orders(llm, requests, temperature=temperature)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    table = token_table(load_tokenizer(path), model.config.vocab_size)
    worst = 0.0
    for request, gen in zip(requests, generations, strict=True):
        ids = torch.tensor([gen.prompt_ids + gen.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(gen.prompt_ids) - 1 : -1]
        masks = OrderConstraint(request.legal, table).masks_for(gen.token_ids)
        ours = constrained_logprobs(logits, masks, torch.tensor(gen.token_ids), temperature)
        theirs = torch.tensor(gen.logprobs)
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < 1e-4, f"max |logprob difference| = {worst:.2e}"
