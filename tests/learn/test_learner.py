"""The Learner with real DeepSpeed (ZeRO-2, CPU, gloo) and real PEFT on the tiny Qwen3.

Tests share one learner where they build on each other (in file order) to keep start-up cost down.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.atomic_io import sha256_file
from diprl.inference.adapters import AdapterStore
from diprl.learn.batching import collate
from diprl.learn.config import LearnerConfig, scheduled_lr
from diprl.learn.learner import Learner
from diprl.learn.loss import grpo_loss
from diprl.learn.model import (
    CompletionHidden,
    build_peft_model,
    completion_logprobs,
    load_lora_state_,
    lora_state,
    read_adapter_dir,
)
from diprl.learn.site import LearnerSite
from diprl.learn.train_state import engine_state, rng_state
from diprl.messages import PolicyRef, StepFault, TrainingRecord
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.tracking import read_metrics

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
    learner = Learner(config, LearnerSite(root / "run", root / "adapters"))
    yield learner
    learner.engine.destroy()


def test_first_version_is_published_at_start_and_is_the_untrained_lora(shared: Learner) -> None:
    assert shared.latest_version() == "main@v1"
    assert [str(r) for r in AdapterStore(shared.store.root).versions("main")] == ["main@v1"]
    assert all(float(t.abs().max()) == 0 for n, t in lora_state(shared.peft).items() if "lora_B" in n)


def test_one_step_equals_plain_adamw_on_the_token_mean_loss(shared: Learner, tokenizer: Any) -> None:
    """DeepSpeed ZeRO-2 with hand-set accumulation over micro-batches == one plain step on all tokens."""
    group = on_policy(shared, make_group(shared.table, tokenizer, "main@v1", [1.0, -1.0, 0.5, -0.5], seed=1))
    cfg = shared.config
    reference = CompletionHidden(build_peft_model(shared.preset, cfg))
    prepared = shared._prepare(group.records, rl=True)
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
    assert metrics.metrics["micro_batches"] >= 2 and metrics.step == 1 and str(metrics.published) == "main@v2"
    assert metrics.metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert metrics.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert metrics.metrics["ratio"] == pytest.approx(1.0) and metrics.metrics["tis_weight"] == pytest.approx(
        1.0, abs=1e-5
    )
    ours, theirs = lora_state(shared.peft), lora_state(reference.peft_model)
    # Adam's first step moves every weight by about lr = 2e-2; float32 summation order differs slightly,
    # and a weight whose gradient is near Adam's eps moves by lr * g / (|g| + eps), so that difference
    # shows at up to a few 1e-3 of the step: 2.1e-5 and 6.4e-5 measured on two machines with the compact
    # vocabulary's tiny model (5.7e-5 with shared prefixes). A wrong loss or step is off by ~lr.
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1.5e-4
    for key in (
        "time_recompute_s",
        "time_fwd_bwd_s",
        "time_optimizer_s",
        "time_publish_s",
        "entropy",
        "clip_frac_high",
    ):
        assert key in metrics.metrics


def test_a_positive_advantage_completion_becomes_more_likely(shared: Learner, tokenizer: Any) -> None:
    group = make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1 / 3, -1 / 3, -1 / 3], seed=2)
    before = [sum(s) for s in shared.score(group.records)]
    for _ in range(4):
        latest = PolicyRef.parse(shared.latest_version())
        group = on_policy(shared, replace(group, policy_version=latest))
        group.records = [replace(r, policy_version=latest) for r in group.records]
        metrics = shared.train_step([group])
        assert metrics.metrics["policy_lag_max"] == 0 and metrics.metrics["dropped_stale"] == 0
    after = [sum(s) for s in shared.score(group.records)]
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
    assert (
        metrics.trained is False and metrics.metrics["dropped_stale"] == 1 and metrics.metrics["dropped_foreign"] == 1
    )
    assert shared.step == step and shared.counters["dropped_stale"] == 1

    # lag 2 (allowed): the ratio is taken against v4's weights, the TIS weight against the engine
    lagged = make_group(shared.table, tokenizer, "main@v4", [1.0, -1.0], seed=5)
    with shared.model.weights(shared._weights_of(PolicyRef.adapter("main", 4)) or {}):
        old = shared.score(lagged.records)
    lagged.records = [replace(r, behaviour_logprobs=s) for r, s in zip(lagged.records, old, strict=True)]
    metrics = shared.train_step([lagged])
    assert metrics.trained is True and metrics.metrics["policy_lag_max"] == 2
    assert metrics.metrics["tis_weight"] == pytest.approx(1.0, abs=1e-5)  # no engine drift: weights found exactly
    assert abs(metrics.metrics["log_ratio"]) > 1e-4  # but the policy moved since v4


def test_behaviour_cloning_raises_the_likelihood_of_the_teacher_completion(tmp_path: Path, tokenizer: Any) -> None:
    """A fresh learner: the shared one's Adam moments, left by the GRPO steps before, carry it the other way
    for several steps, which says nothing about the BC loss."""
    config = LearnerConfig(lr=2e-2, micro_batch_tokens=1200, checkpoint_every=0, max_grad_norm=1.0)
    fresh = Learner(config, LearnerSite(tmp_path / "run", tmp_path / "adapters"))
    group = make_group(fresh.table, tokenizer, "main@v1", [0.0], power="ENGLAND", seed=6)
    teacher = [replace(r, behaviour_logprobs=[], advantages=[]) for r in group.records]
    before = sum(fresh.score(teacher)[0])
    for _ in range(3):
        metrics = fresh.train_records(teacher, objective="bc")
    assert metrics.metrics["objective"] == "bc" and metrics.metrics["loss_nll"] == pytest.approx(
        metrics.metrics["loss"]
    )
    assert sum(fresh.score(teacher)[0]) > before + 0.1
    with pytest.raises(ValueError, match="objective"):
        fresh.train_records(teacher, objective="ppo")
    fresh.engine.destroy()


def test_the_lr_decays_linearly_to_zero_over_lr_decay_steps(tmp_path: Path, tokenizer: Any) -> None:
    """Each step's lr reaches the optimiser: 2e-2, then two thirds and one third of it, then 0, which leaves
    the weights where they were."""
    assert [scheduled_lr(LearnerConfig(lr=0.3, lr_decay_steps=3), s) for s in range(5)] == pytest.approx(
        [0.3, 0.2, 0.1, 0.0, 0.0]
    )
    assert scheduled_lr(LearnerConfig(lr=0.3), 10_000) == 0.3
    config = LearnerConfig(lr=2e-2, lr_decay_steps=3, micro_batch_tokens=1200, checkpoint_every=0)
    fresh = Learner(config, LearnerSite(tmp_path / "run", tmp_path / "adapters"))
    group = make_group(fresh.table, tokenizer, "main@v1", [0.0], power="ENGLAND", seed=6)
    teacher = [replace(r, behaviour_logprobs=[], advantages=[]) for r in group.records]
    lrs = [fresh.train_records(teacher, objective="bc").metrics["lr"] for _ in range(3)]
    assert lrs == pytest.approx([2e-2, 2e-2 * 2 / 3, 2e-2 / 3])
    before = {k: v.clone() for k, v in lora_state(fresh.peft).items()}
    assert fresh.train_records(teacher, objective="bc").metrics["lr"] == 0.0
    assert _tensors_equal(lora_state(fresh.peft), before)
    fresh.engine.destroy()


def test_reset_publishes_a_fresh_lora_and_drops_groups_from_before_it(shared: Learner, tokenizer: Any) -> None:
    old_version = shared.latest_version()
    new_version = shared.reset()
    assert int(new_version.split("@v")[1]) == int(old_version.split("@v")[1]) + 1
    assert all(float(t.abs().max()) == 0 for n, t in lora_state(shared.peft).items() if "lora_B" in n)
    # Checkpointed at once, whatever the cadence: a restore never brings back the network the league forgot.
    restored = shared.checkpoints.newest_good().checkpoint
    assert restored is not None and restored.meta["version"] == new_version
    metrics = shared.train_step([make_group(shared.table, tokenizer, old_version, [1.0, -1.0], seed=7)])
    assert metrics.trained is False and metrics.metrics["dropped_stale"] == 1


def test_epochs_take_several_clipped_updates_on_one_batch_and_publish_one_version(
    tmp_path: Path, tokenizer: Any
) -> None:
    """With epochs=3 a step makes three updates, each against the logprobs the batch was sampled with:
    the later epochs see ratios away from 1 (the clip's view) and the good completion rises further."""
    rises, reports = {}, {}
    for epochs in (1, 3):
        learner = Learner(
            LearnerConfig(lr=1e-3, epochs=epochs, checkpoint_every=0),
            LearnerSite(tmp_path / f"run{epochs}", tmp_path / f"adapters{epochs}"),
        )
        try:
            advantages = [1.0, -1 / 3, -1 / 3, -1 / 3]
            group = on_policy(learner, make_group(learner.table, tokenizer, "main@v1", advantages, seed=2))
            before = [sum(s) for s in learner.score(group.records)]
            reports[epochs] = learner.train_step([group])
            after = [sum(s) for s in learner.score(group.records)]
            rises[epochs] = [a - b for a, b in zip(after, before, strict=True)]
        finally:
            learner.engine.destroy()
    one, three = reports[1].metrics, reports[3].metrics
    assert reports[3].step == 1 and str(reports[3].published) == "main@v2" and three["epochs"] == 3
    assert "epochs" not in one
    assert three["ratio"] == pytest.approx(1.0) and three["ratio_max"] == pytest.approx(one["ratio_max"])
    assert three["last_ratio_max"] > 1.02 or three["last_ratio_min"] < 0.98, three
    assert rises[3][0] > rises[1][0] > 0, rises


def _config(**kw: Any) -> LearnerConfig:
    return LearnerConfig(
        lr=5e-3, micro_batch_tokens=1200, grad_accum=2, kl_coef=0.1, entropy_coef=0.01, ema_decay=0.5, **kw
    )


def _tensors_equal(a: Any, b: Any) -> bool:
    """Exact equality of two nested states (dicts, lists, tuples, tensors, plain values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _snapshot(learner: Learner) -> dict[str, Any]:
    """A deep copy of the engine state (weights, fp32 master weights, Adam moments) and of every RNG."""
    return copy.deepcopy({"engine": engine_state(learner.engine), "rng": rng_state()})


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resume_reproduces_the_next_step_exactly_and_a_corrupt_checkpoint_falls_back(
    tmp_path: Path, tokenizer: Any, zero_stage: int
) -> None:
    """At ZeRO-2, and at ZeRO-3 with every base weight partitioned (its master weights live outside the
    torch optimizer's groups between steps)."""
    run, adapters = tmp_path / "run", tmp_path / "adapters"
    stage = {"zero_stage": zero_stage, "zero3_persistence_threshold": 0}
    a = Learner(_config(checkpoint_every=1, **stage), LearnerSite(run, adapters))
    assert (run / "checkpoints" / "main" / "step-0").is_dir()  # resumable from its first moment
    groups = [make_group(a.table, tokenizer, f"main@v{i + 1}", [1.0, -1.0, 0.3], seed=10 + i) for i in range(3)]
    for g in groups[:2]:
        a.train_step([g])
    at_step_2 = _snapshot(a)  # what the step-2 checkpoint must bring back
    expected = a.train_step([groups[2]])
    expected_weights = lora_state(a.peft)
    expected_state = _snapshot(a)
    assert expected.metrics["kl"] > 0 and expected.metrics["entropy"] > 0
    assert not _tensors_equal(at_step_2["engine"]["optimizer"], expected_state["engine"]["optimizer"])
    a.engine.destroy()
    # killed after step 3 ran but before its checkpoint landed
    shutil.rmtree(run / "checkpoints" / "main" / "step-3")

    b = Learner(_config(checkpoint_every=1, **stage), LearnerSite(run, adapters))
    assert _tensors_equal(_snapshot(b), at_step_2)  # master weights, Adam moments and RNGs bit for bit
    # Step 3's main@v4 stays in the store (never reused): the restored weights (main@v3's) become main@v5.
    assert b.step == 2 and b.latest_version() == "main@v5"
    store = AdapterStore(adapters)
    assert [str(r) for r in store.versions("main")] == [f"main@v{i}" for i in range(1, 6)]
    v3, v5 = (read_adapter_dir(store.resolve(v).path, b.peft) for v in ("main@v3", "main@v5"))
    assert all(torch.equal(v3[k], v5[k]) for k in v3)
    log = run / "learner" / "main" / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(log)] == [1, 2]  # the lost step left the log...
    assert [r["step"] for r in read_metrics(log.with_name("metrics.superseded.jsonl"))] == [3]  # ...kept aside
    replay = b.train_step([groups[2]])
    assert replay.metrics["loss"] == expected.metrics["loss"] and replay.metrics["kl"] == expected.metrics["kl"]
    weights = lora_state(b.peft)
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)
    assert _tensors_equal(_snapshot(b), expected_state)
    assert [r["step"] for r in read_metrics(log)] == [1, 2, 3]
    b.engine.destroy()

    newest = run / "checkpoints" / "main" / "step-3"
    state = newest / "learner.safetensors"
    state.write_bytes(state.read_bytes()[:-10])
    c = Learner(_config(checkpoint_every=1, **stage), LearnerSite(run, adapters))
    assert c.step == 2
    [(path, reason)] = c.state()["skipped_checkpoints"]
    assert path == str(newest) and "learner.safetensors" in reason
    c.engine.destroy()
    assert math.isfinite(expected.metrics["grad_norm"])


class _Planted:
    """Unpickling this creates `marker`: the stand-in for whatever code a forged checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_pickle_planted_in_a_checkpoint_is_never_unpickled(tmp_path: Path, tokenizer: Any) -> None:
    run, adapters, marker = tmp_path / "run", tmp_path / "adapters", tmp_path / "code-ran"
    a = Learner(_config(checkpoint_every=1), LearnerSite(run, adapters))
    for i in range(2):
        a.train_step([make_group(a.table, tokenizer, f"main@v{i + 1}", [1.0, -1.0, 0.3], seed=10 + i)])
    a.engine.destroy()
    newest = run / "checkpoints" / "main" / "step-2"
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    # every name the first (pickled) format read, listed with a matching hash as a forger would
    for rel in ("learner_state.pt", "deepspeed/state/mp_rank_00_model_states.pt"):
        file = newest / rel
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"step": _Planted(marker)}, file)
        manifest["files"][rel] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    (newest / "MANIFEST.json").write_text(json.dumps(manifest))

    b = Learner(_config(checkpoint_every=1), LearnerSite(run, adapters))
    assert not marker.exists()
    assert b.step == 1
    [(path, reason)] = b.state()["skipped_checkpoints"]
    assert path == str(newest) and "pickled" in reason and "not loaded" in reason
    b.engine.destroy()


def test_config_ranges_are_validated() -> None:
    with pytest.raises(ValueError, match="clip_low"):
        LearnerConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="zero_stage"):
        LearnerConfig(zero_stage=4)
    with pytest.raises(ValueError, match="epochs"):
        LearnerConfig(epochs=0)


def test_default_yaml_matches_the_dataclass() -> None:
    from diprl.structured_config import load_structured

    assert load_structured(LearnerConfig, "learner", "default") == LearnerConfig()
    assert load_preset("tiny").lora.rank == 8


# ---- bad records, bad steps, full disks: the step goes on -------------------------------------------


def _nan_logprob(record: TrainingRecord, tokenizer: Any) -> TrainingRecord:
    return replace(record, behaviour_logprobs=[float("nan"), *record.behaviour_logprobs[1:]])


def _rejected_by_constraint(record: TrainingRecord, tokenizer: Any) -> TrainingRecord:
    hello = tokenizer.encode("Hello", add_special_tokens=False)[0]  # where "<orders>" must start
    return replace(record, completion_ids=[hello, *record.completion_ids[1:]])


def _too_long(record: TrainingRecord, tokenizer: Any) -> TrainingRecord:
    prompt = record.prompt_ids
    return replace(record, prompt_ids=prompt * (4096 // len(prompt) + 1))  # the tiny model's max_model_len is 4096


def _overflowing_advantage(record: TrainingRecord, tokenizer: Any) -> TrainingRecord:
    # finite per token (it passes validation), but the token sum overflows float32: a non-finite loss
    return replace(record, advantages=[3e38] * len(record.completion_ids))


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (_nan_logprob, "nonfinite"),
        (_rejected_by_constraint, "constraint"),
        (_too_long, "too_long"),
        (_overflowing_advantage, "nonfinite_loss"),
    ],
)
def test_one_bad_record_is_quarantined_and_the_rest_of_the_step_trains(
    shared: Learner, tokenizer: Any, spoil: Any, reason: str
) -> None:
    """Found: any one of these raised out of train_step (and so ended the training run)."""
    version = shared.latest_version()
    group = on_policy(shared, make_group(shared.table, tokenizer, version, [1.0, -1.0, 0.5, -0.5], seed=30))
    original = group.records[2]
    group.records[2] = spoil(original, tokenizer)
    step, before = shared.step, shared.counters["quarantined"]
    quarantine = shared.run_dir / "learner" / "main" / "quarantine.jsonl"
    lines_before = _lines(quarantine)

    metrics = shared.train_step([group])

    assert metrics.trained is True and shared.step == step + 1 and metrics.published is not None
    assert math.isfinite(metrics.metrics["loss"]) and math.isfinite(metrics.metrics["grad_norm"])
    assert metrics.metrics["records"] == 3 and metrics.metrics["quarantined"] == 1
    kept = [shared._prepare([r], rl=True)[0] for k, r in enumerate(group.records) if k != 2]
    forced = sum(len(a) == 1 for r in kept for a in r.allowed) / sum(len(r.completion_ids) for r in kept)
    assert 0 < metrics.metrics["forced_token_share"] == pytest.approx(forced)  # the trained records' share
    [entry] = metrics.quarantined
    assert (entry.reason, entry.index, entry.group_id, entry.policy_version) == (reason, 2, group.group_id, version)
    assert shared.counters["quarantined"] == before + 1
    [saved] = _lines(quarantine)[len(lines_before) :]
    assert saved["reason"] == reason and saved["index"] == 2 and saved["group_id"] == group.group_id
    assert saved["record"]["completion_ids"] == group.records[2].completion_ids  # the record itself is kept
    assert all(torch.isfinite(t).all() for t in lora_state(shared.peft).values())


def test_a_step_of_only_bad_records_takes_no_step(shared: Learner, tokenizer: Any) -> None:
    group = make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1.0], seed=31)
    group.records = [_nan_logprob(r, tokenizer) for r in group.records]
    step = shared.step
    metrics = shared.train_step([group])
    assert metrics.trained is False and shared.step == step and metrics.metrics["quarantined"] == 2


def test_non_finite_weights_skip_the_step_without_quarantining_good_records(shared: Learner, tokenizer: Any) -> None:
    """Found: a non-finite loss raised FloatingPointError out of train_step. No record is to blame here."""
    group = on_policy(shared, make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1.0], seed=32))
    good = lora_state(shared.peft)
    broken = {k: v.clone() for k, v in good.items()}
    key = next(k for k in sorted(broken) if "lora_A" in k)
    broken[key][0, 0] = float("nan")
    load_lora_state_(shared.peft, broken)
    step, skipped = shared.step, shared.counters["nonfinite_steps"]
    try:
        metrics = shared.train_step([group])
    finally:
        load_lora_state_(shared.peft, good)
    assert (
        metrics.trained is False and metrics.metrics["nonfinite_gradients"] == 1 and metrics.metrics["quarantined"] == 0
    )
    assert shared.step == step and shared.counters["nonfinite_steps"] == skipped + 1
    assert metrics.faults == [StepFault("nonfinite_gradients", step + 1)]
    # DeepSpeed cleared the poisoned gradients: the next step is an ordinary one
    metrics = shared.train_step([group])
    assert metrics.trained is True and math.isfinite(metrics.metrics["grad_norm"])
    assert all(torch.isfinite(t).all() for t in lora_state(shared.peft).values())


def test_a_full_disk_at_publish_or_checkpoint_is_a_fault_and_retried_next_step(
    shared: Learner, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: OSError(ENOSPC) from publishing raised out of train_step after the optimiser had stepped."""
    from diprl.inference.adapters import _fs

    def full_disk(src: Path, dst: Path) -> tuple[int, str]:
        dst.write_bytes(src.read_bytes()[:100])  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    def no_checkpoint(*args: Any, **kwargs: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    versions = [str(r) for r in shared.store.versions("main")]
    monkeypatch.setattr(_fs, "copy_hashing", full_disk)
    monkeypatch.setattr(shared.checkpoints, "save", no_checkpoint)
    monkeypatch.setattr(shared.config, "checkpoint_every", 1)
    group = on_policy(shared, make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1.0], seed=33))
    step = shared.step
    metrics = shared.train_step([group])
    assert metrics.trained is True and shared.step == step + 1
    assert metrics.published is None and metrics.checkpoint is None
    assert [(f.fault, f.step) for f in metrics.faults] == [
        ("publish_failed", step + 1),
        ("checkpoint_failed", step + 1),
    ]
    assert all("No space left" in str(f.error) for f in metrics.faults)
    # nothing half-published: the same versions, no temp directory left behind
    assert [str(r) for r in shared.store.versions("main")] == versions
    assert not [p for p in (shared.store.root / "main").iterdir() if p.name.startswith(".")]
    trained = lora_state(shared.peft)

    assert all(torch.equal(trained[k], v) for k, v in shared.versions.snapshots[versions[-1]].items()) is False

    monkeypatch.undo()  # the disk has room again: the next step publishes and checkpoints (checkpoint_every is 0)
    metrics = shared.train_step(
        [on_policy(shared, replace(group, policy_version=PolicyRef.parse(shared.latest_version())))]
    )
    assert str(metrics.published) == f"main@v{int(versions[-1].split('@v')[1]) + 1}" and metrics.faults == []
    assert metrics.checkpoint is not None and shared.config.checkpoint_every == 0


def test_an_unexpected_error_keeps_the_batch_in_quarantine_and_is_raised(
    shared: Learner, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver records the raised error as a fault; the groups it was given are not lost."""
    group = make_group(shared.table, tokenizer, shared.latest_version(), [1.0, -1.0], seed=35)

    def bug(*args: Any) -> None:
        raise RuntimeError("a bug, not a bad record")

    monkeypatch.setattr(shared, "_recompute", bug)
    quarantine = shared.run_dir / "learner" / "main" / "quarantine.jsonl"
    before = len(_lines(quarantine))
    with pytest.raises(RuntimeError, match="a bug"):
        shared.train_step([group])
    [saved] = _lines(quarantine)[before:]
    assert saved["reason"] == "learner_error" and saved["group_id"] == group.group_id
    assert saved["group"]["records"][1]["completion_ids"] == group.records[1].completion_ids


def test_prune_versions_keeps_the_leagues_the_trainable_and_the_newest(shared: Learner) -> None:
    keep_last = max(shared.config.keep_versions, shared.config.max_policy_lag + 1)
    while len(shared.store.versions("main")) < keep_last + 4:
        shared.publish()
    names = [str(r) for r in shared.store.versions("main")]
    removed = shared.prune_versions(["main@v2", "bot:random", "base", "other@v3"])
    left = [str(r) for r in shared.store.versions("main")]
    assert left == ["main@v2", *names[-keep_last:]]
    assert removed == [n for n in names if n not in left]
    assert shared.counters["versions_pruned"] == len(removed)
    assert shared.prune_versions(["main@v2"]) == []


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_warm_start_is_a_version_in_the_store_or_a_directory(tmp_path: Path) -> None:
    """`init_adapter` `<policy>@v<N>` is that version's directory in the store (the whole version, not the
    PolicyRef's policy name), a directory is itself, and anything else is a clear error."""
    from diprl.inference.adapters import UnknownAdapter
    from diprl.learn.lifecycle import Lifecycle
    from diprl.learn.ranks import Collective
    from tests.inference.lora_fixtures import make_lora_dir

    store = AdapterStore(tmp_path / "adapters")
    source = make_lora_dir(tmp_path, seed=1)
    store.publish("warm", source)

    def start_dir(init: str) -> Path | None:
        config = LearnerConfig(init_adapter=init)
        return Lifecycle(config, Collective(None), tmp_path / "run", store, load_preset("tiny")).start_dir()

    assert start_dir("warm@v1") == store.resolve("warm@v1").path
    assert start_dir(str(source)) == source
    with pytest.raises(UnknownAdapter, match="warm@v2"):
        start_dir("warm@v2")
    for init in ("base", "bot:dumbbot", "warm"):
        with pytest.raises(FileNotFoundError, match="neither a version"):
            start_dir(init)


def test_ema_decay_one_keeps_the_warm_start_as_the_kl_reference_across_steps_and_a_resume(
    tmp_path: Path, tokenizer: Any
) -> None:
    """`ema_decay: 1.0` anchors RL to where it started: the reference stays the init adapter's weights while
    the policy moves away from them (kl > 0), and a resumed learner gets that reference back, not its own
    restored weights or a fresh LoRA."""
    warm = Learner(
        LearnerConfig(lr=2e-2, checkpoint_every=0), LearnerSite(tmp_path / "warm", tmp_path / "warm_adapters")
    )
    warm.train_step([make_group(warm.table, tokenizer, "main@v1", [1.0, -1.0, 0.3], seed=3)])
    start = {k: v.float().clone() for k, v in lora_state(warm.peft).items()}
    init_dir = AdapterStore(tmp_path / "warm_adapters").resolve("main@v2").path
    warm.engine.destroy()
    assert any(float(t.abs().max()) > 0 for n, t in start.items() if "lora_B" in n)  # a trained adapter

    def same(state: dict[str, torch.Tensor]) -> bool:
        return state.keys() == start.keys() and all(torch.equal(state[k].float(), start[k]) for k in start)

    config = LearnerConfig(
        lr=2e-2, micro_batch_tokens=1200, kl_coef=0.1, ema_decay=1.0, init_adapter=str(init_dir), checkpoint_every=1
    )
    run, adapters = tmp_path / "run", tmp_path / "adapters"
    a = Learner(config, LearnerSite(run, adapters))
    assert same(lora_state(a.peft)) and same(a.ema)
    reports = [
        a.train_step([make_group(a.table, tokenizer, f"main@v{i + 1}", [1.0, -1.0, 0.3], seed=10 + i)])
        for i in range(2)
    ]
    assert same(a.ema) and not same(lora_state(a.peft))
    assert reports[1].metrics["kl"] > 0
    a.engine.destroy()
    b = Learner(config, LearnerSite(run, adapters))
    assert b.step == 2 and same(b.ema) and not same(lora_state(b.peft))
    b.engine.destroy()
