"""The learner's process group: NCCL is given its device, so it never guesses one from the global rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from diprl.learn.model import process_group_options


def test_nccl_is_given_the_local_device_and_gloo_none() -> None:
    assert process_group_options(use_gpu=True, local_rank=3) == {
        "backend": "nccl",
        "device_id": torch.device("cuda", 3),
    }
    assert process_group_options(use_gpu=False, local_rank=3) == {"backend": "gloo"}


def test_a_learner_starts_after_something_else_destroyed_the_world_group(tmp_path: Path) -> None:
    """vLLM's in-process engine destroys torch.distributed's world group on shutdown; a learner made after it
    in the same process must not reach DeepSpeed's clone of the dead group (it once failed every learner
    test that followed an in-process vLLM test). A subprocess, so this test's teardown touches nothing else."""
    script = f"""
import torch
from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.site import LearnerSite

adapters = {str(tmp_path / "adapters")!r}
first = Learner(LearnerConfig(checkpoint_every=0), LearnerSite({str(tmp_path / "a")!r}, adapters))
torch.distributed.destroy_process_group()  # what vLLM's shutdown does
second = Learner(LearnerConfig(checkpoint_every=0, policy="other"), LearnerSite({str(tmp_path / "b")!r}, adapters))
print("second", second.latest_version())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "second other@v1" in done.stdout, done.stderr[-3000:]
