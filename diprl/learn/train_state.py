"""What a bit-exact resume needs from the DeepSpeed engine and the RNGs, as plain trees for `state_files`.

DeepSpeed's own `save_checkpoint`/`load_checkpoint` pickle (they `torch.save` whole dicts holding
objects and read them back with `weights_only=False`), so the learner does not use them. Instead it
takes the state it needs through public handles:

- the trainable module parameters, in the dtype the engine holds them;
- the optimizer that actually steps: DeepSpeed's ZeRO-1/2 and bf16 wrappers keep a plain torch
  optimizer (`.optimizer`) whose parameters ARE the fp32 master weights (ZeRO's flat partitions);
  with ZeRO-0 in fp32 the engine's optimizer is that torch optimizer itself. Its `state_dict()`
  (Adam moments and step counts as tensors, hyper-parameters as plain values) and the values of its
  parameters are saved; `load_state_dict` and an in-place copy bring both back exactly;
- the engine's step counters (`global_steps`, `global_samples`, `skipped_steps`), as its own
  checkpoint would.

- ZeRO-3 keeps its torch optimizer's parameter groups empty between steps (it slots each fp32 flat
  partition in for its own step); they are slotted in for reading and restoring, as DeepSpeed's own
  checkpoint does (`_master_groups`).

Each rank saves and restores its own partition; restoring into an engine with another partitioning is
refused with the shapes that differ.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from diprl.learn.partitions import whole

ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


class StateMismatch(ValueError):
    """Saved state that does not fit this engine (other LoRA shape, ZeRO stage or partitioning)."""


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrappers: the one whose parameters are the fp32 master weights."""
    opt = engine.optimizer
    for _ in range(4):
        if isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
    raise TypeError(f"no torch optimizer under {type(engine.optimizer).__name__}: cannot checkpoint it")


@contextmanager
def _master_groups(engine: Any) -> Iterator[None]:
    """The fp32 master partitions in the torch optimizer's parameter groups for the block (ZeRO-3 only).

    Uses DeepSpeed's ZeRO-3 optimizer's own pair of methods (what its `state_dict` does); recheck them
    on DeepSpeed upgrades (`tests/learn/test_ranks.py` restores a ZeRO-3 group from its checkpoint).
    """
    wrapper = engine.optimizer
    slot_in = getattr(wrapper, "_set_fp32_optimizer_param_groups", None)
    if slot_in is None:
        yield
        return
    slot_in()
    try:
        yield
    finally:
        wrapper._clear_fp32_optimizer_param_groups()


def _trainable(engine: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in engine.module.named_parameters() if p.requires_grad}


def engine_state(engine: Any) -> dict[str, Any]:
    """The engine's trainable weights, master weights, optimizer state and step counters (tensors + plain values).

    At ZeRO-3 the trainable weights are gathered: every rank of a group calls this at the same point.
    """
    opt = base_optimizer(engine)
    trainable = _trainable(engine)
    with whole(list(trainable.values())):
        whole_trainable = {n: p.detach().clone() for n, p in trainable.items()}
    with _master_groups(engine):
        return {
            "trainable": whole_trainable,
            "master": [[p.detach() for p in group["params"]] for group in opt.param_groups],
            "optimizer": opt.state_dict(),
            "counters": {k: int(getattr(engine, k)) for k in ENGINE_COUNTERS},
        }


@torch.no_grad()
def restore_engine_state(engine: Any, state: dict[str, Any]) -> None:
    """Load `engine_state` output into a freshly built engine (one that has not stepped yet).

    A fresh engine matters for ZeRO: its links from module parameters to optimizer-state fragments
    are made lazily at the first step, so they then point at the restored moments.
    """
    if int(engine.global_steps) != 0:
        raise RuntimeError("engine state restores only into a freshly built engine (this one has stepped)")
    params = _trainable(engine)
    saved = state["trainable"]
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise StateMismatch(f"trainable weights differ: missing {missing[:3]}, unexpected {extra[:3]}")
    with whole(list(params.values()), modify=True):
        with _master_groups(engine):
            _restore_optimizer(base_optimizer(engine), state["master"], state["optimizer"], params, saved)
        for name, p in params.items():
            p.copy_(saved[name].to(p.device))
    for key in ENGINE_COUNTERS:
        setattr(engine, key, int(state["counters"][key]))


def _restore_optimizer(
    opt: torch.optim.Optimizer,
    master: list[list[torch.Tensor]],
    optimizer_state: dict[str, Any],
    params: dict[str, torch.nn.Parameter],
    saved: dict[str, torch.Tensor],
) -> None:
    shapes = [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups]
    saved_shapes = [[tuple(t.shape) for t in g] for g in master]
    if shapes != saved_shapes:
        raise StateMismatch(f"optimizer master weights have shapes {saved_shapes}, this engine {shapes}")
    for name, p in params.items():
        value = saved[name]
        if value.shape != p.shape or value.dtype != p.dtype:
            raise StateMismatch(
                f"{name}: saved {value.dtype} {tuple(value.shape)}, engine holds {p.dtype} {tuple(p.shape)}"
            )
    opt.load_state_dict(optimizer_state)
    for group, values in zip(opt.param_groups, master, strict=True):
        for p, value in zip(group["params"], values, strict=True):
            p.copy_(value.to(device=p.device, dtype=p.dtype))


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states, as plain values and uint8 tensors."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator `rng_state` captured; CUDA states are skipped when no GPU is visible."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": str(npy["bit_generator"]),
            "state": {"key": np.asarray(npy["key"], dtype=np.uint32), "pos": int(npy["pos"])},
            "has_gauss": int(npy["has_gauss"]),
            "gauss": float(npy["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
