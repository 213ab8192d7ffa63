"""The Learner with real DeepSpeed (ZeRO-2, CPU, gloo) and real PEFT on the tiny Qwen3.

Tests share one learner where they build on each other (in file order) to keep start-up cost down.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.inference.adapters import AdapterStore
from diprl.learn.batching import collate
from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.loss import grpo_loss
from diprl.learn.model import CompletionHidden, build_peft_model, completion_logprobs, lora_state
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer

from .groups import make_group, on_policy


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(load_preset("tiny")))  # the learner's model's tokenizer


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Learner]:
    root = tmp_path_factory.mktemp("learner")
    config = LearnerConfig(
        lr=2e-2, micro_batch_tokens=1200, grad_accum=2, max_policy_lag=2, checkpoint_every=0, max_grad_norm=1.0
    )
    learner = Learner(config, root / "run", root / "adapters")
    yield learner
    learner.engine.destroy()


def test_first_version_is_published_at_start_and_is_the_untrained_lora(shared: Learner) -> None:
    assert shared.latest_version() == "main@v1"
    assert [r.name for r in AdapterStore(shared.store.root).versions("main")] == ["main@v1"]
    assert all(float(t.abs().max()) == 0 for n, t in lora_state(shared.peft).items() if "lora_B" in n)


def test_one_step_equals_plain_adamw_on_the_token_mean_loss(shared: Learner, tokenizer: Any) -> None:
    """DeepSpeed ZeRO-2 with hand-set accumulation over micro-batches == one plain step on all tokens."""
    group = on_policy(shared, make_group(shared.table, tokenizer, "main@v1", [1.0, -1.0, 0.5, -0.5], seed=1))
    cfg = shared.config
    reference = CompletionHidden(build_peft_model(shared.preset, cfg))
    prepared = shared._prepare(group["records"], rl=True)
    mb = collate(prepared, shared.pad_id)
    logp, _ = completion_logprobs(
        reference(mb.input_ids, mb.attention_mask, mb.rows, mb.cols),
        reference.lm_head_weight,
        mb.targets,
        mb.temperatures,
        mb.allowed,
    )
    loss, _ = grpo_loss(
        logp,
        logp.detach(),
        mb.behaviour,
        mb.advantages,
        total_tokens=mb.num_tokens,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        tis_cap=cfg.tis_cap,
    )
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=0.0
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    optimizer.step()

    metrics = shared.train_step([group])
    assert metrics["micro_batches"] >= 2 and metrics["step"] == 1 and metrics["published"] == "main@v2"
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert metrics["ratio"] == pytest.approx(1.0) and metrics["tis_weight"] == pytest.approx(1.0, abs=1e-5)
    ours, theirs = lora_state(shared.peft), lora_state(reference.peft_model)
    # Adam's first step moves every weight by about lr = 2e-2; float32 summation order differs slightly,
    # and a weight whose gradient is near Adam's eps moves by lr * g / (|g| + eps), so that difference
    # shows at up to about 1e-3 of the step (2.1e-5 measured with the compact vocabulary's tiny model)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 5e-5
    for key in (
        "time_recompute_s",
        "time_fwd_bwd_s",
        "time_optimizer_s",
        "time_publish_s",
        "entropy",
        "clip_frac_high",
    ):
        assert key in metrics


def test_a_positive_advantage_completion_becomes_more_likely(shared: Learner, tokenizer: Any) -> None:
    group = make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1 / 3, -1 / 3, -1 / 3], seed=2)
    before = [sum(s) for s in shared.score(group["records"])]
    for _ in range(4):
        group = on_policy(shared, {**group, "policy_version": shared.latest_version()})
        group["records"] = [{**r, "policy_version": shared.latest_version()} for r in group["records"]]
        metrics = shared.train_step([group])
        assert metrics["policy_lag_max"] == 0 and metrics["dropped_stale"] == 0
    after = [sum(s) for s in shared.score(group["records"])]
    rise = [a - b for a, b in zip(after, before, strict=True)]
    assert rise[0] > 0.1 and rise[0] > max(rise[1:]), rise
    assert sum(rise[1:]) < 0, rise  # the negative-advantage ones lose probability overall


def test_stale_and_foreign_groups_are_dropped_and_counted_lagged_ones_use_their_own_weights(
    shared: Learner, tokenizer: Any
) -> None:
    assert shared.latest_version() == "main@v6"
    stale = make_group(shared.table, tokenizer, "main@v3", [1.0, -1.0], seed=3)  # lag 3 > 2
    foreign = make_group(shared.table, tokenizer, "other@v1", [1.0, -1.0], seed=4)
    step = shared.step
    metrics = shared.train_step([stale, foreign])
    assert metrics["trained"] == 0 and metrics["dropped_stale"] == 1 and metrics["dropped_foreign"] == 1
    assert shared.step == step and shared.counters["dropped_stale"] == 1

    # lag 2 (allowed): the ratio is taken against v4's weights, the TIS weight against the engine
    lagged = make_group(shared.table, tokenizer, "main@v4", [1.0, -1.0], seed=5)
    with shared._weights(shared._weights_of("main@v4") or {}):
        old = shared.score(lagged["records"])
    lagged["records"] = [{**r, "behaviour_logprobs": s} for r, s in zip(lagged["records"], old, strict=True)]
    metrics = shared.train_step([lagged])
    assert metrics["trained"] == 1 and metrics["policy_lag_max"] == 2
    assert metrics["tis_weight"] == pytest.approx(1.0, abs=1e-5)  # no engine drift: weights found exactly
    assert abs(metrics["log_ratio"]) > 1e-4  # but the policy moved since v4


def test_behaviour_cloning_raises_the_likelihood_of_the_teacher_completion(shared: Learner, tokenizer: Any) -> None:
    group = make_group(shared.table, tokenizer, "main@v1", [0.0], power="ENGLAND", seed=6)
    teacher = [{k: v for k, v in r.items() if k not in ("behaviour_logprobs", "advantages")} for r in group["records"]]
    before = sum(shared.score(teacher)[0])
    for _ in range(3):
        metrics = shared.train_records(teacher, objective="bc")
    assert metrics["objective"] == "bc" and metrics["loss_nll"] == pytest.approx(metrics["loss"])
    assert sum(shared.score(teacher)[0]) > before + 0.1
    with pytest.raises(ValueError, match="objective"):
        shared.train_records(teacher, objective="ppo")


def test_reset_publishes_a_fresh_lora_and_drops_groups_from_before_it(shared: Learner, tokenizer: Any) -> None:
    old_version = shared.latest_version()
    new_version = shared.reset()
    assert int(new_version.split("@v")[1]) == int(old_version.split("@v")[1]) + 1
    assert all(float(t.abs().max()) == 0 for n, t in lora_state(shared.peft).items() if "lora_B" in n)
    metrics = shared.train_step([make_group(shared.table, tokenizer, old_version, [1.0, -1.0], seed=7)])
    assert metrics["trained"] == 0 and metrics["dropped_stale"] == 1


def _config(**kw: Any) -> LearnerConfig:
    return LearnerConfig(
        lr=5e-3, micro_batch_tokens=1200, grad_accum=2, kl_coef=0.1, entropy_coef=0.01, ema_decay=0.5, **kw
    )


def test_resume_reproduces_the_next_step_exactly_and_a_corrupt_checkpoint_falls_back(
    tmp_path: Path, tokenizer: Any
) -> None:
    run, adapters = tmp_path / "run", tmp_path / "adapters"
    a = Learner(_config(checkpoint_every=1), run, adapters)
    groups = [make_group(a.table, tokenizer, f"main@v{i + 1}", [1.0, -1.0, 0.3], seed=10 + i) for i in range(3)]
    for g in groups[:2]:
        a.train_step([g])
    expected = a.train_step([groups[2]])
    expected_weights = lora_state(a.peft)
    assert expected["kl"] > 0 and expected["entropy"] > 0
    a.engine.destroy()
    # killed after step 3 ran but before its checkpoint landed
    shutil.rmtree(run / "checkpoints" / "main" / "step-3")

    b = Learner(_config(checkpoint_every=1), run, adapters)
    assert b.step == 2 and b.latest_version() == "main@v3"
    replay = b.train_step([groups[2]])
    assert replay["loss"] == expected["loss"] and replay["kl"] == expected["kl"]
    weights = lora_state(b.peft)
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)
    b.engine.destroy()

    newest = run / "checkpoints" / "main" / "step-3"
    state = newest / "learner_state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    c = Learner(_config(checkpoint_every=1), run, adapters)
    assert c.step == 2
    [(path, reason)] = c.state()["skipped_checkpoints"]
    assert path == str(newest) and "learner_state.pt" in reason
    c.engine.destroy()
    assert math.isfinite(expected["grad_norm"])


def test_config_ranges_are_validated() -> None:
    with pytest.raises(ValueError, match="clip_low"):
        LearnerConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="zero_stage"):
        LearnerConfig(zero_stage=3)


def test_default_yaml_matches_the_dataclass() -> None:
    from diprl.learn.config import load_learner_config

    assert load_learner_config("default") == LearnerConfig()
    assert load_preset("tiny").lora.rank == 8
