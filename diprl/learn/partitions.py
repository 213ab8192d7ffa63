"""Whole parameter values where DeepSpeed ZeRO-3 keeps each rank's slice only.

At ZeRO-3 every parameter of the engine's module (the LoRA matrices too) lives as a slice per rank and
is gathered for each module's forward, then released: outside a forward its `.data` is empty. What
the learner does with whole weights between forwards (read them to publish, checkpoint or update the
EMA, swap them to score another version, restore them) happens inside `whole`. With `modify`, what
rank 0 wrote is what every rank's slice holds afterwards. Parameters ZeRO-3 never touched (stages 0-2,
a model before its engine) pass through untouched.

Gathering is a collective: every rank of a group enters the block at the same point of its program.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn


def partitioned(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that ZeRO-3 manages (they carry a DeepSpeed id)."""
    return [p for p in params if hasattr(p, "ds_id")]


@contextmanager
def whole(params: Sequence[nn.Parameter], modify: bool = False) -> Iterator[None]:
    """Every parameter of `params` whole inside the block (a copy taken inside must be `.clone()`d)."""
    zero3 = partitioned(params)
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero3, modifier_rank=0 if modify else None):
        yield
