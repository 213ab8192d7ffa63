"""LoRA on vLLM's CPU backend, one matmul per adapter in the batch, and base rows left as the base.

vLLM's CPU build applies LoRA with PyTorch-native "punica" ops (`vllm.lora.ops.torch_ops`): each row of
the batch gathers its own copy of its adapter's matrices (`weights[indices]`, rows x out x in) and an
einsum multiplies row by row. Two problems, both measured on vLLM 0.32 (docs/inference.md, "LoRA on CPU"):

- **Base rows get an adapter.** A row without LoRA has index -1, and `weights[-1]` is the last adapter
  slot: a `base` request decoded in one batch with adapter requests is served with whatever adapter holds
  the last slot (with `max_loras=1`, exactly the other request's). The GPU kernels skip -1; these did not.
- **The gather is most of the engine's time.** On `tiny` in `+experiment=random` LoRA was 40% of the
  engine process, more than attention.

`register` (a vLLM general plugin, `[project.entry-points."vllm.general_plugins"]` in pyproject.toml:
vLLM calls it in every process it starts, its engine core included) replaces the row-wise ops with
`bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` below: one matmul against the slots' matrices
instead of a copy of them per row, and a row with index -1 gets 0 (no LoRA). The prefill
("sgmv") ops call these through the module, so they follow. Only on the CPU platform: GPU builds use
their own kernels and are left alone. `DIPRL_VLLM_CPU_LORA=vllm` keeps vLLM's ops (to compare them:
`python -m diprl.bench cpu-lora`).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
NO_LORA = -1  # vLLM's index of a row served by the base alone
SWITCH = "DIPRL_VLLM_CPU_LORA"  # "vllm": leave vLLM's own ops in place


def lora_rows(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, out]: row i times `weights[indices[i]]` transposed ([slots, (1,) out, in]), 0 where indices[i] is -1.

    A batch of one adapter is one matmul with its matrix. A mixed batch is one matmul with every slot's
    matrices side by side ([in, slots x out]: a LoRA's rank is small), then each row keeps its slot's block;
    never a per-row copy of the matrices. `indices` may be longer than `inputs` (vLLM's buffers are sized for
    the largest batch): the first `len(inputs)` are the rows'.
    """
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    x = inputs.to(dtype)
    rows = x.shape[0]
    slots, width, _ = weights.shape
    if rows == 0:
        return x.new_zeros(0, width)
    indices = indices[:rows]
    first, last = int(indices.min()), int(indices.max())
    if first == last:  # one adapter (or none) for the whole batch
        return x.new_zeros(rows, width) if first == NO_LORA else x @ weights[first].to(dtype).t()
    every = (x @ weights.to(dtype).reshape(slots * width, -1).t()).view(rows, slots, width)
    picked = every[torch.arange(rows), indices.clamp(min=0)]
    return picked.masked_fill_((indices == NO_LORA).unsqueeze(1), 0.0)


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """`output[:, :rank] = scaling * inputs @ A[slot]^T` per row (vLLM's signature and semantics, -1 rows 0)."""
    outputs = lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """`output (+)= inputs @ B[slot]^T` per row, over the columns both have (vLLM's semantics, -1 rows 0)."""
    outputs = lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # LoRA adapter and model may pad the output to different widths
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """`output[:, offset:offset+size] (+)= inputs @ B[slot]^T` per row (vLLM's semantics, -1 rows 0)."""
    outputs = lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> list[str]:
    """Put these ops in place of vLLM's row-wise ones: in the torch-ops module (which its prefill ops
    call) and in the CPU punica wrapper (which imported them by name). Returns the modules patched."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    patched = []
    for module in (lora_ops, punica_cpu):
        missing = [name for name in OPS if not hasattr(module, name)]
        if missing:
            # Another vLLM whose CPU LoRA is laid out differently: serve with its own ops and say so.
            log.warning("vLLM's %s has no %s: its own CPU LoRA ops stay in place", module.__name__, missing)
            continue
        for name, op in OPS.items():
            setattr(module, name, op)
        patched.append(module.__name__)
    return patched


def register() -> None:
    """vLLM's general-plugin entry point: these ops on the CPU platform, nothing elsewhere."""
    from vllm.platforms import current_platform

    choice = os.environ.get(SWITCH, "diprl")
    if choice not in ("diprl", "vllm"):
        raise ValueError(f"{SWITCH} must be 'diprl' (the default) or 'vllm', got {choice!r}")
    if current_platform.is_cpu() and choice == "diprl":
        install()
