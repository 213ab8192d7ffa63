"""Attention over a packed prefix tree (`diprl.learn.prefix`), plugged into transformers' attention interface.

The model keeps PyTorch's scaled-dot-product attention; this implementation adds one case. When the
mask it is handed is a `PrefixLayout` (the learner passes it through the model's mask mapping), the
packed sequence is attended block by block: each block gathers its nodes' own tokens as queries and
their ancestors' and own tokens as keys and values, and runs SDPA with the block's mask (roots: plain
causal). Any other mask is SDPA's as usual, so the unshared path is transformers' own.

Why blocks of gathered keys, not one mask over the packed sequence: a dense mask over N tokens costs
N^2 attention, and most of it would be masked (unrelated records); the blocks cost what each token
really attends to, like an expanded KV cache. Why not an expanded KV cache itself (prefix forwarded
with `use_cache`, suffixes against the cache repeated along the batch): transformers drops
`past_key_values` in training under gradient checkpointing (each checkpointed layer is replayed in the
backward pass and would append to the cache twice), which the GPU learner uses, and the suffixes of
one micro-batch would then be padded to a common length. Here the layers see one ordinary sequence,
so checkpointing, DeepSpeed and PEFT are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from diprl.learn.prefix import PrefixLayout

IMPLEMENTATION = "diprl_prefix_tree"
"""The attention implementation name registered with transformers: SDPA, plus `PrefixLayout` masks."""


def prefix_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, Hq, T, d], k/v [B, Hkv, T, d] -> [B, T, Hq, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, PrefixLayout):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"a packed prefix tree is one sequence (batch 1), got a batch of {query.shape[0]}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, d]
    outputs = []
    for block in attention_mask.blocks:
        bq = q[block.query_index].transpose(1, 2)  # [n, Hq, S, d]
        bk = k[block.key_index].transpose(1, 2)  # [n, Hkv, A + S, d]
        bv = v[block.key_index].transpose(1, 2)
        out, _ = sdpa_attention_forward(
            module, bq, bk, bv, block.mask, dropout=dropout, scaling=scaling, is_causal=block.mask is None
        )
        outputs.append(out.reshape(-1, out.shape[-2], out.shape[-1]))  # [n * S, Hq, d]
    packed = torch.cat(outputs).index_select(0, attention_mask.gather_back)
    return packed.unsqueeze(0), None


def use_prefix_attention(model: Any) -> None:
    """Switch a transformers model from SDPA to SDPA plus prefix-tree layouts (idempotent).

    Refused, naming the reason, for a model that does not use SDPA or has sliding-window layers:
    the blocks implement full causal attention with SDPA only.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    current = config._attn_implementation
    if current == IMPLEMENTATION:
        return
    hint = "set learner.prefix_sharing=false to train it without prefix sharing"
    if current != "sdpa":
        raise ValueError(f"prefix sharing needs the model's attention to be 'sdpa', it is {current!r}: {hint}")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"prefix sharing supports full attention only, the model has {sorted(kinds)}: {hint}")
    AttentionInterface.register(IMPLEMENTATION, prefix_tree_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
