"""A version the learner publishes is served by the PolicyServer's engine, and the learner's masked,
tempered logprobs of the served completions equal the engine's processed logprobs (within 1e-4),
with the compact vocabulary of the CPU presets and with Qwen3's own (the GPU models'). The base requests
share the batch with the version's and the engine has one LoRA slot, which the version holds: a base row
must still be served by the base (vLLM's own CPU LoRA ops gave it the last slot's adapter;
diprl.inference.cpu_lora)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diprl.game import DiplomacyGame
from diprl.inference.config import ServerConfig
from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.model import lora_state
from diprl.learn.site import LearnerSite
from diprl.messages import PolicyRef, TrainingRecord
from diprl.policy.models import ModelSource, TinyModelSpec, TokenizerKind, load_preset, resolve_model_path
from diprl.policy.prompt import build_prompt
from diprl.policy.tokenizer import load_tokenizer
from tests.inference.lora_fixtures import serve_in_process

from .groups import make_group, on_policy


def zero_lora_b_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights of the base model: current A, B = 0 (the adapter then adds nothing)."""
    return {n: (torch.zeros_like(t) if "lora_B" in n else t) for n, t in lora_state(model).items()}


@pytest.mark.parametrize("vocabulary", ["compact", "qwen3"])
def test_published_version_is_served_and_learner_logprobs_match_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocabulary: str
) -> None:
    preset = load_preset("tiny")
    if vocabulary == "qwen3":
        assert preset.source is ModelSource.tiny
        preset = replace(preset, tiny=TinyModelSpec(vocab_size=151936, tokenizer=TokenizerKind.qwen3))
        monkeypatch.setattr("diprl.learn.learner.load_preset", lambda name: preset)
    model_path = resolve_model_path(preset)
    adapters = tmp_path / "adapters"
    learner = Learner(
        LearnerConfig(lr=3e-2, max_grad_norm=0.0, checkpoint_every=0), LearnerSite(tmp_path / "run", adapters)
    )
    assert learner.preset == preset
    tokenizer = load_tokenizer(model_path)
    for seed in range(2):  # move the LoRA well away from the base
        version = learner.latest_version()
        group = on_policy(learner, make_group(learner.table, tokenizer, version, [1.0, -1.0, 1.0, -1.0], seed=seed))
        learner.train_step([group])
    version = learner.latest_version()
    assert version == "main@v3"

    game = DiplomacyGame()
    requests = [
        {
            "policy": policy,
            "prompt": build_prompt(game, power).text,
            "legal": game.legal_orders(power).to_dict(),
            "temperature": temperature,
        }
        for policy in (version, "base")
        for power, temperature in (("FRANCE", 1.0), ("ENGLAND", 0.7), ("RUSSIA", 1.0))
    ]
    config = ServerConfig(
        model=str(model_path),
        dtype="float32",
        adapter_root=str(adapters),
        max_num_seqs=8,
        max_loras=1,  # the only slot holds the version: a base row indexed -1 would read it
    )
    results = serve_in_process(config, requests)
    assert [r.error for r in results] == [None] * len(requests)
    assert all(r.complete for r in results)

    records = [
        TrainingRecord(
            prompt_ids=r.prompt_ids,
            completion_ids=r.token_ids,
            behaviour_logprobs=[],
            legal=q["legal"],
            advantages=[],
            policy_version=PolicyRef.parse(q["policy"]),
            temperature=q["temperature"],
            power=q["legal"]["power"],
            phase=q["legal"]["phase"],
        )
        for q, r in zip(requests, results, strict=True)
    ]
    ours = learner.score(records[:3])
    with learner.model.weights(zero_lora_b_state(learner.peft)):
        base = learner.score(records)
    worst = 0.0
    for mine, r in zip(ours + base[3:], results, strict=True):
        worst = max(worst, float((torch.tensor(mine) - torch.tensor(r.logprobs)).abs().max()))
    assert worst < 1e-4, f"max |learner - engine| logprob = {worst:.2e}"
    # and the served version is the trained one, not the base: the base explains its samples worse
    gap = max(
        float((torch.tensor(b) - torch.tensor(r.logprobs)).abs().max())
        for b, r in zip(base[:3], results[:3], strict=True)
    )
    assert gap > 1e-3
    learner.engine.destroy()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
