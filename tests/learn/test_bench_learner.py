"""The learner benchmark's bare loop shares the learner's model without disturbing it, and the benchmark runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.bench.learner import BARE_ADAPTER, BareLoop, main
from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.model import lora_parameters, lora_state, read_adapter_dir
from diprl.learn.site import LearnerSite
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer

from .groups import make_group, on_policy


def test_the_bare_loop_trains_an_adapter_of_its_own_on_the_learners_base(tmp_path: Path) -> None:
    """Found: the bare loop held a second full copy of the model (an 8B learner ran out of 80 GB)."""
    learner = Learner(LearnerConfig(lr=1e-2, checkpoint_every=0), LearnerSite(tmp_path / "run", tmp_path / "adapters"))
    tokenizer: Any = load_tokenizer(resolve_model_path(load_preset("tiny")))
    group = on_policy(learner, make_group(learner.table, tokenizer, learner.latest_version(), [1.0, -1.0], seed=3))
    names = sorted(lora_parameters(learner.peft))
    before = lora_state(learner.peft)
    batches = [mb for _, mb in learner.passes.batches(learner._prepare(group.records, rl=True))]
    seen: dict[str, int] = {}

    def count(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        active = learner.peft.active_adapter
        seen[active] = seen.get(active, 0) + 1

    backbone = learner.peft.get_base_model().model  # what the learner's module runs
    hook = backbone.register_forward_hook(count, with_kwargs=True)
    try:
        assert min(BareLoop(learner).step(batches)) > 0
    finally:
        hook.remove()
    assert seen == {BARE_ADAPTER: len(batches)}  # it ran through the learner's own backbone, its adapter active
    assert BARE_ADAPTER not in learner.peft.peft_config and learner.peft.active_adapter == "default"
    assert sorted(lora_parameters(learner.peft)) == names
    assert all(torch.equal(before[k], v) for k, v in lora_state(learner.peft).items())
    assert all(p.grad is None for p in lora_parameters(learner.peft).values())
    metrics = learner.train_step([group])  # and the learner trains and publishes as before
    assert metrics.trained
    published = read_adapter_dir(learner.store.resolve(learner.latest_version()).path, learner.peft)
    assert sorted(published) == names and not any(BARE_ADAPTER in p.name for p in tmp_path.rglob("*"))
    learner.engine.destroy()


def test_the_benchmark_prints_shared_and_unshared_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "1", "--groups", "1", "--forks", "3", "--quiet", "--gradient-checkpointing"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = dict(item.split("=") for item in out[-1].split())
    assert set(last) == {
        "learner_tokens_per_s",
        "learner_unshared_tokens_per_s",
        "learner_efficiency",
        "prefix_share_speedup",
    }
    assert all(float(v) > 0 for v in last.values())
    forwarded = next(line for line in out if line.startswith("forwarded per step"))
    shared, unshared = (int(w) for w in forwarded.replace(",", " ").split() if w.isdigit())
    assert shared < unshared  # three forks of one prompt: the prompt forwarded once instead of three times


def test_the_adapters_benchmark_trains_one_host_and_separate_learners_to_the_same_weights(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--adapters", "2", "--steps", "2", "--groups", "1", "--forks", "2", "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    fields = {k: float(v) for k, v in (kv.split("=") for kv in lines[-1].split())}
    assert set(fields) == {
        "multi_adapter_tokens_per_s", "separate_tokens_per_s", "multi_adapter_speedup", "adapter_parity",
        "multi_adapter_memory_ratio",
    }  # fmt: skip
    assert fields["adapter_parity"] == 0.0  # one torch thread an actor: the same steps to the bit
    assert 0.0 < fields["multi_adapter_memory_ratio"] < 1.0  # one process where two ran
    # printed to 3 decimals: at a speedup of 0.245 (a loaded machine) that rounding alone is 1e-3 of it
    assert fields["multi_adapter_speedup"] == pytest.approx(
        fields["multi_adapter_tokens_per_s"] / fields["separate_tokens_per_s"], rel=1e-3, abs=5e-4
    )
    serial = {k: float(v) for k, v in (kv.split("=") for kv in lines[-2].split())}
    assert set(serial) == {"serial_host_tokens_per_s", "serial_host_speedup", "serial_host_memory_ratio"}
    assert 0.0 < serial["serial_host_memory_ratio"] < 1.0
    assert "one host, parallel" in lines[-5] and "(1 process(es), 2 CPU(s)" in lines[-5]
    assert "2 learners" in lines[-4] and "(2 process(es), 2 CPU(s)" in lines[-4]
    assert "one host, serial" in lines[-3] and "(1 process(es), 1 CPU(s)" in lines[-3]
