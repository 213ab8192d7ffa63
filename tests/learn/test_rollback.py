"""`Learner.rollback`: the league's best version's weights become the next version, exactly, once.

Real DeepSpeed (ZeRO-2, CPU) and PEFT on the tiny Qwen3, as in test_learner.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.model import lora_state
from diprl.learn.site import LearnerSite
from diprl.learn.train_state import base_optimizer
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer

from .groups import make_group, on_policy

CONFIG = LearnerConfig(lr=2e-2, micro_batch_tokens=1200, checkpoint_every=1, max_grad_norm=1.0, max_policy_lag=4)


def _adapter(learner: Learner, version: str) -> dict[str, torch.Tensor]:
    return load_file(str(learner.store.resolve(version).path / "adapter_model.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _moments(learner: Learner) -> list[torch.Tensor]:
    state = base_optimizer(learner.engine).state
    return [t for st in state.values() for t in st.values() if torch.is_tensor(t) and t.numel() > 1]


def test_rollback_publishes_the_best_versions_weights_exactly_once_and_survives_a_restart(tmp_path: Path) -> None:
    tokenizer: Any = load_tokenizer(resolve_model_path(load_preset("tiny")))
    learner = Learner(CONFIG, LearnerSite(tmp_path / "run", tmp_path / "adapters"))
    alive = [learner]
    try:
        for seed in (1, 2):  # main@v2 (the "best"), then main@v3 (the "collapsed" one)
            group = on_policy(
                learner, make_group(learner.table, tokenizer, learner.latest_version(), [1, -1.0], seed=seed)
            )
            assert learner.train_step([group]).trained
        assert learner.latest_version() == "main@v3"
        best, collapsed = _adapter(learner, "main@v2"), _adapter(learner, "main@v3")
        assert not _same(best, collapsed)
        assert _moments(learner)  # Adam has moments before the rollback

        decision = "main@v3->main@v2"
        assert learner.rollback("main@v2", decision) == "main@v4"
        assert _same(_adapter(learner, "main@v4"), best)  # the new version's bytes are the best version's
        restored = lora_state(learner.peft)
        assert all(torch.equal(restored[k], learner.ema[k]) for k in restored)  # the KL reference too
        assert not _moments(learner)  # a fresh optimiser
        assert learner.step == 2 and learner.counters["rollbacks"] == 1
        stale = make_group(learner.table, tokenizer, "main@v3", [1.0, -1.0], seed=3)
        assert learner.train_step([stale]).metrics["dropped_stale"] == 1  # the collapsed network's groups
        checkpoint = learner.checkpoints.newest_good().checkpoint
        assert checkpoint is not None and checkpoint.meta["version"] == "main@v4"  # checkpointed at once

        # The same decision again (a retried call): answered, not carried out a second time.
        assert learner.rollback("main@v2", decision) == "main@v4"
        assert str(learner.store.versions("main")[-1]) == "main@v4" and learner.counters["rollbacks"] == 1

        # A learner restarted from its checkpoint (the actor killed) remembers the decision it carried out.
        alive.remove(learner)
        learner.engine.destroy()
        again = Learner(CONFIG, LearnerSite(tmp_path / "run", tmp_path / "adapters"))
        alive.append(again)
        assert again.latest_version() == "main@v4"
        assert again.rollback("main@v2", decision) == "main@v4"
        assert str(again.store.versions("main")[-1]) == "main@v4" and again.counters["rollbacks"] == 1
        assert _same(lora_state(again.peft), restored)

        with pytest.raises(ValueError, match="not a version of this policy"):
            again.rollback("rival@v2", "other")
    finally:
        for one in alive:
            one.engine.destroy()
