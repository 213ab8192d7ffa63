"""The learner's side of a canary: greedy constrained completions of the canary set with the weights it
publishes, and each token's log-probability, to store in the version (`diprl.inference.canary`).

transformers' `generate` decodes the model as it is in memory (KV cache, left padding, one batch for the
whole set), under the same `OrderConstraint` and the same one-scatter mask (`mask_rows_`) that the
engine's logits processor applies. `output_scores` returns the logits after that mask, and their
log-softmax at temperature 1 is what vLLM reports for a greedy request (`processed_logprobs`; its
sampler sets a greedy row's temperature to 1). The model's own generation defaults are replaced by a
plain greedy configuration, so nothing else (a repetition penalty, say) enters the scores.

On CPU the decode runs on one thread: a step of a few rows is a chain of tiny matrix products, where
more threads only add synchronisation, and on a loaded machine (other processes on the cores) two
spinning threads took 9.5 s for what one does in 0.2 s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from diprl.inference.canary import CANARY_MAX_TOKENS, Canary, CanaryItem, CanaryPrompt, canary_prompts
from diprl.policy.constraint import OrderConstraint
from diprl.policy.logprobs import constrained_greedy
from diprl.policy.vocab import TokenTable, token_table

__all__ = ["canary_bytes", "learner_canary", "version_canary"]


def learner_canary(model: Any, table: TokenTable, prompts: Sequence[CanaryPrompt], pad_id: int | None = None) -> Canary:
    """The canary of `model`'s current weights: each prompt's greedy completion under its legal orders
    (EOS included) and every completion token's masked log-probability at temperature 1."""
    import torch

    pad = table.eos_id if pad_id is None else pad_id
    constraints = [OrderConstraint(p.legal, table) for p in prompts]
    threads = torch.get_num_threads()
    try:
        if next(model.parameters()).device.type == "cpu":
            torch.set_num_threads(1)
        completions, scores = constrained_greedy(
            model, [p.prompt_ids for p in prompts], constraints, table.eos_id, pad, CANARY_MAX_TOKENS, with_scores=True
        )
    finally:
        torch.set_num_threads(threads)
    logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in scores], dim=1)  # [B, T, V]
    items = []
    for row, (prompt, tokens) in enumerate(zip(prompts, completions, strict=True)):
        picked = logprobs[row, torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        items.append(CanaryItem(prompt, tuple(tokens), tuple(float(x) for x in picked)))
    return Canary(tuple(items))


def canary_bytes(model: Any, table: TokenTable, tokenizer: Any) -> bytes:
    """What `AdapterStore.publish(..., canary=)` takes: the fixed canary set decoded by `model`."""
    return learner_canary(model, table, canary_prompts(tokenizer)).to_bytes()


@functools.lru_cache(maxsize=4)
def _canary_inputs(model_path: str, vocab_size: int | None) -> tuple[TokenTable, tuple[CanaryPrompt, ...]]:
    from diprl.policy.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    return token_table(tokenizer, vocab_size), tuple(canary_prompts(tokenizer))


def version_canary(model: Any, preset: Any, zero_stage: int) -> bytes | None:
    """The canary to publish with `model`'s current weights on `preset`'s base (the tokenizer and the
    canary set are made once per process), or None under ZeRO-3, whose partitioned base weights one
    rank cannot decode with alone: such versions are checked by their bytes only."""
    if zero_stage == 3:
        return None
    from diprl.policy.models import resolve_model_path

    vocab_size = preset.tiny.vocab_size if preset.tiny is not None else None
    table, prompts = _canary_inputs(str(resolve_model_path(preset)), vocab_size)
    return learner_canary(model, table, prompts).to_bytes()
