"""The learner's process group: NCCL is given its device, so it never guesses one from the global rank."""

from __future__ import annotations

import torch

from diprl.learn.model import process_group_options


def test_nccl_is_given_the_local_device_and_gloo_none() -> None:
    assert process_group_options(use_gpu=True, local_rank=3) == {
        "backend": "nccl",
        "device_id": torch.device("cuda", 3),
    }
    assert process_group_options(use_gpu=False, local_rank=3) == {"backend": "gloo"}
