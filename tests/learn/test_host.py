"""`LearnerHost`: two policies on one base in one process train exactly as two learners of their own.

Real DeepSpeed (ZeRO-2, CPU) and PEFT on the tiny Qwen3, as in test_learner.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.learn.config import LearnerConfig
from diprl.learn.host import HostError, LearnerHost, check_shareable
from diprl.learn.learner import Learner
from diprl.learn.model import build_peft_model, lora_state
from diprl.learn.site import LearnerSite
from diprl.learn.train_state import base_optimizer
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.torch_threads import torch_threads

from .groups import make_group

POLICIES = ("main", "rival")
Trained = tuple[LearnerHost, dict[str, Learner]]
CONFIG = LearnerConfig(lr=2e-2, micro_batch_tokens=1200, checkpoint_every=1, max_grad_norm=1.0, kl_coef=0.0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(load_preset("tiny")))


def _batch(learner: Learner, tokenizer: Any, seed: int) -> list[Any]:
    return _group(learner.config.policy, str(learner.version), tokenizer, seed)


def _group(policy: str, version: str, tokenizer: Any, seed: int) -> list[Any]:
    table = token_table(tokenizer, load_preset("tiny").tiny.vocab_size)  # type: ignore[union-attr]
    advantages = [1.0, -1.0, 0.5, -0.5] if policy == "main" else [-1.0, 1.0, 0.25, -0.25]
    return [make_group(table, tokenizer, version, advantages, seed=seed)]


def _two_steps(tokenizer: Any) -> dict[tuple[str, int], list[Any]]:
    """Each policy's batches of its first two steps (versions v1 and v2), the same for every learner here."""
    return {(p, k): _group(p, f"{p}@v{k + 1}", tokenizer, seed=10 * k + len(p)) for p in POLICIES for k in range(2)}


def _moments(learner: Learner) -> list[torch.Tensor]:
    state = base_optimizer(learner.engine).state
    return [t for st in state.values() for _, t in sorted(st.items()) if torch.is_tensor(t) and t.numel() > 1]


def _base_weight(learner: Learner) -> torch.Tensor:
    return learner.peft.get_base_model().model.embed_tokens.weight


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[Trained]:
    """A host of both policies and a learner of its own for each, two steps on the same batches.

    One torch thread: with two, CPU reductions split differently from call to call, and two learners of
    their own on the same batches already differ by 1e-4 after two steps; with one they agree to the bit."""
    with torch_threads(1):
        root = tmp_path_factory.mktemp("host")
        host = LearnerHost(
            [replace(CONFIG, policy=p) for p in POLICIES], LearnerSite(root / "host", root / "host-adapters")
        )
        alone = {
            p: Learner(replace(CONFIG, policy=p), LearnerSite(root / f"alone-{p}", root / f"alone-{p}-adapters"))
            for p in POLICIES
        }
        batches = _two_steps(tokenizer)
        for step in range(2):
            for policy in POLICIES:  # interleaved, as the host's calls come
                batch = batches[policy, step]
                assert host.train_step(policy, batch).trained
                assert alone[policy].train_step(batch).trained
        yield host, alone
        for learner in [*host.learners.values(), *alone.values()]:
            learner.engine.destroy()


def test_each_adapter_trains_exactly_as_a_learner_of_its_own(trained: Trained) -> None:
    host, alone = trained
    for policy in POLICIES:
        mine, theirs = lora_state(host.learner(policy).peft), lora_state(alone[policy].peft)
        assert mine.keys() == theirs.keys()
        assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) == 0.0
        moved = max(float(v.abs().max()) for k, v in mine.items() if "lora_B" in k)
        assert moved > 1e-3  # it did train
        moments = list(zip(_moments(host.learner(policy)), _moments(alone[policy]), strict=True))
        assert moments and max(float((a - b).abs().max()) for a, b in moments) == 0.0
        assert host.learner(policy).step == alone[policy].step == 2
        assert host.state(policy)["version"] == f"{policy}@v3"
    main, rival = (lora_state(host.learner(p).peft) for p in POLICIES)
    assert any(not torch.equal(main[k], rival[k]) for k in main)  # two adapters, not one seen twice


def test_a_parallel_host_steps_its_policies_at_once_each_as_a_learner_of_its_own(
    trained: Trained, tokenizer: Any, tmp_path: Path
) -> None:
    """A CPU host's policies step in threads of their own (as a threaded actor's calls come): their steps
    overlap, and each adapter still ends exactly where a learner of its own ends."""
    _, alone = trained
    configs = [replace(CONFIG, policy=p, host_parallel=True) for p in POLICIES]
    host = LearnerHost(configs, LearnerSite(tmp_path / "run", tmp_path / "adapters"))
    spans: dict[str, list[tuple[float, float]]] = {p: [] for p in POLICIES}
    for policy, learner in host.learners.items():
        step = learner._step

        def timed(*args: Any, _step: Any = step, _spans: Any = spans[policy], **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return _step(*args, **kwargs)
            finally:
                _spans.append((began, time.monotonic()))

        learner._step = timed  # type: ignore[method-assign]
    batches = _two_steps(tokenizer)
    try:
        with ThreadPoolExecutor(len(POLICIES)) as pool:
            for k in range(2):
                reports = list(pool.map(host.train_step, POLICIES, [batches[p, k] for p in POLICIES]))
                assert all(r.trained for r in reports)
        overlapped = [max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(spans["main"], spans["rival"], strict=True)]
        assert all(overlapped), spans
        for policy in POLICIES:
            mine, theirs = lora_state(host.learner(policy).peft), lora_state(alone[policy].peft)
            assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) == 0.0
            moments = list(zip(_moments(host.learner(policy)), _moments(alone[policy]), strict=True))
            assert moments and max(float((a - b).abs().max()) for a, b in moments) == 0.0
        assert host.state("main")["parallel"] is True
    finally:
        for learner in host.learners.values():
            learner.engine.destroy()
    with pytest.raises(ValueError, match="a GPU host is serial"):
        replace(CONFIG, use_gpu=True, host_parallel=True)


def test_the_base_weights_are_held_once(trained: Trained) -> None:
    host, alone = trained
    weights = [_base_weight(host.learner(p)) for p in POLICIES]
    assert weights[0].data_ptr() == weights[1].data_ptr() == host.base.model.embed_tokens.weight.data_ptr()
    assert _base_weight(alone["main"]).data_ptr() != weights[0].data_ptr()
    assert not weights[0].requires_grad


def test_a_reset_moves_that_adapter_alone_and_a_new_host_resumes_each_at_its_own_step(
    trained: Trained, tokenizer: Any, tmp_path: Path
) -> None:
    host, _ = trained
    main_before = lora_state(host.learner("main").peft)
    version = host.reset("rival")
    assert version == "rival@v4"
    assert all(float(v.abs().max()) == 0.0 for k, v in lora_state(host.learner("rival").peft).items() if "lora_B" in k)
    main_after = lora_state(host.learner("main").peft)
    assert all(torch.equal(main_before[k], main_after[k]) for k in main_before)
    assert _base_weight(host.learner("rival")).data_ptr() == host.base.model.embed_tokens.weight.data_ptr()
    # One more step of main only (checkpointed every step), then the host is gone and a new one starts.
    assert host.train_step("main", _batch(host.learner("main"), tokenizer, seed=99)).trained
    run_dir = host.learner("main").run_dir
    adapters = host.learner("main").store.root
    expected = {p: (host.learner(p).step, lora_state(host.learner(p).peft)) for p in POLICIES}
    again = LearnerHost([replace(CONFIG, policy=p) for p in POLICIES], LearnerSite(run_dir, adapters))
    try:
        for policy, (step, weights) in expected.items():
            assert again.learner(policy).step == step
            restored = lora_state(again.learner(policy).peft)
            assert all(torch.equal(restored[k], weights[k]) for k in weights)
        assert (again.learner("main").step, again.learner("rival").step) == (3, 2)
    finally:
        for learner in again.learners.values():
            learner.engine.destroy()


def test_what_cannot_share_a_base_is_refused_with_the_reason() -> None:
    with pytest.raises(HostError, match="each policy once"):
        check_shareable([CONFIG, CONFIG])
    with pytest.raises(HostError, match=r"differ in \['model'\]"):
        check_shareable([CONFIG, replace(CONFIG, policy="rival", model="tiny_wide")])
    with pytest.raises(HostError, match="at least one"):
        check_shareable([])
    # One rule, one reason, refused by the config, the host and the model builder alike.
    with pytest.raises(ValueError, match=r"adapters_per_actor > 1 .* ranks 1 and zero_stage <= 2, got ranks=2"):
        LearnerConfig(adapters_per_actor=3, ranks=2)
    with pytest.raises(ValueError, match=r"adapters_per_actor > 1 .* got ranks=1 zero_stage=3"):
        LearnerConfig(adapters_per_actor=3, zero_stage=3)
    with pytest.raises(HostError, match=r"a learner host .* got ranks=2 zero_stage=2: use learner.adapters_per_actor"):
        check_shareable([replace(CONFIG, ranks=2)])
    with pytest.raises(ValueError, match=r"a shared base .* got ranks=1 zero_stage=3: grouped and ZeRO-3 learners"):
        build_peft_model(load_preset("tiny"), replace(CONFIG, zero_stage=3), base=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="adapters_per_actor must be >= 1"):
        LearnerConfig(adapters_per_actor=0)


def test_an_unknown_policy_is_a_clear_error(trained: Trained) -> None:
    host, _ = trained
    with pytest.raises(HostError, match=r"trains \['main', 'rival'\], not 'ghost'"):
        host.state("ghost")


def test_a_rollback_restores_that_adapter_alone_to_a_published_version(trained: Trained) -> None:
    host, _ = trained
    rival_before = lora_state(host.learner("rival").peft)
    best = host.learner("main").store.resolve("main@v2").path
    version = host.rollback("main", "main@v2", "main@v4->main@v2")
    assert version == host.latest_version("main") and version != "main@v2"
    restored = host.learner("main").store.resolve(version).path
    assert (restored / "adapter_model.safetensors").read_bytes() == (best / "adapter_model.safetensors").read_bytes()
    assert host.rollback("main", "main@v2", "main@v4->main@v2") == version  # the same decision: once
    rival_after = lora_state(host.learner("rival").peft)
    assert all(torch.equal(rival_before[k], rival_after[k]) for k in rival_before)
    assert _base_weight(host.learner("main")).data_ptr() == host.base.model.embed_tokens.weight.data_ptr()
