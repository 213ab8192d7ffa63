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
from diprl.policy.logprobs import constrained_greedy, verify_greedy
from diprl.policy.vocab import TokenTable, token_table
from diprl.torch_threads import torch_threads

__all__ = ["learner_canary", "version_canary"]


def learner_canary(
    model: Any,
    table: TokenTable,
    prompts: Sequence[CanaryPrompt],
    pad_id: int | None = None,
    previous: Canary | None = None,
) -> Canary:
    """The canary of `model`'s current weights: each prompt's greedy completion under its legal orders
    (EOS included) and every completion token's masked log-probability at temperature 1.

    `previous`: a canary of the same prompts from earlier weights (the last version's). A learner step
    moves the weights a little, so its completions are usually still the greedy ones; one forward checks
    that exactly (`verify_greedy`) and gives their log-probabilities, and only the prompts whose completion
    changed are decoded token by token. Either way the canary is the greedy decode's."""
    import torch

    pad = table.eos_id if pad_id is None else pad_id
    constraints = [OrderConstraint(p.legal, table) for p in prompts]
    ids = [p.prompt_ids for p in prompts]
    found: dict[int, CanaryItem] = {}  # row -> its item, checked or decoded
    with torch_threads(1 if next(model.parameters()).device.type == "cpu" else None):
        if previous is not None and [i.prompt for i in previous.items] == list(prompts):
            expected = [i.token_ids for i in previous.items]
            for row, checked in enumerate(verify_greedy(model, ids, expected, constraints, pad)):
                if checked is not None:
                    found[row] = CanaryItem(prompts[row], expected[row], tuple(checked))
        todo = [row for row in range(len(prompts)) if row not in found]
        if todo:  # the rows whose completion changed (all of them without a previous canary), decoded
            completions, scores = constrained_greedy(
                model, [ids[r] for r in todo], [constraints[r] for r in todo], table.eos_id, pad, CANARY_MAX_TOKENS,
                with_scores=True,
            )  # fmt: skip
            logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in scores], dim=1)  # [B, T, V]
            for k, (row, tokens) in enumerate(zip(todo, completions, strict=True)):
                picked = logprobs[k, torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
                found[row] = CanaryItem(prompts[row], tuple(tokens), tuple(float(x) for x in picked))
    return Canary(tuple(found[row] for row in range(len(prompts))))


@functools.lru_cache(maxsize=4)
def _canary_inputs(model_path: str, vocab_size: int | None) -> tuple[TokenTable, tuple[CanaryPrompt, ...]]:
    from diprl.policy.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    return token_table(tokenizer, vocab_size), tuple(canary_prompts(tokenizer))


def version_canary(model: Any, preset: Any, zero_stage: int, previous: Canary | None = None) -> Canary | None:
    """The canary to publish with `model`'s current weights on `preset`'s base (the tokenizer and the
    canary set are made once per process), or None under ZeRO-3, whose partitioned base weights one
    rank cannot decode with alone: such versions are checked by their bytes only. `previous`: the last
    canary this process made (see `learner_canary`)."""
    if zero_stage == 3:
        return None
    from diprl.policy.models import resolve_model_path

    vocab_size = preset.tiny.vocab_size if preset.tiny is not None else None
    table, prompts = _canary_inputs(str(resolve_model_path(preset)), vocab_size)
    return learner_canary(model, table, prompts, previous=previous)
