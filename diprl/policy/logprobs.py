"""The order mask applied to a trainer's logits: masks, the transformers logits processor, constrained greedy.

The learner's importance ratio compares its own log-probabilities with the behaviour ones that vLLM
returned in `processed_logprobs` mode: logits masked by the constraint (everything else -inf), then
divided by the temperature, then log-softmax. The learner computes that with these masks
(`diprl.learn.model.completion_logprobs`), so both sides compute the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from diprl.policy.constraint import ConstraintViolation

if TYPE_CHECKING:
    from diprl.policy.constraint import OrderConstraint


def allowed_mask(allowed: Sequence[np.ndarray], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense boolean mask [len(allowed), vocab_size] from per-position sorted allowed ids."""
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
    if allowed:
        counts = torch.tensor([len(a) for a in allowed], device=device)
        rows = torch.repeat_interleave(torch.arange(len(allowed), device=device), counts)
        cols = torch.from_numpy(np.concatenate(allowed)).to(device)
        mask[rows, cols] = True
    return mask


def mask_rows_(logits: torch.Tensor, rows: Sequence[int], allowed: Sequence[np.ndarray]) -> torch.Tensor:
    """In place: in each row of `rows`, every id outside its allowed set becomes -inf (one scatter)."""
    if not rows:
        return logits
    device = logits.device
    row_index = torch.tensor(list(rows), dtype=torch.long, device=device)
    counts = torch.tensor([len(a) for a in allowed], dtype=torch.long, device=device)
    cols = torch.from_numpy(np.concatenate(allowed)).to(device)
    row_of_col = torch.repeat_interleave(row_index, counts)
    kept = logits[row_of_col, cols]
    logits.index_fill_(0, row_index, float("-inf"))
    logits[row_of_col, cols] = kept
    return logits


class ConstraintLogitsProcessor:
    """A transformers logits processor: in each row, only what the row's constraint allows next.

    `generate` calls it with the prompt (left-padded to a common width) plus what was generated so far.
    A row that has written EOS is finished: `generate` overwrites its later tokens with padding, and
    the processor leaves it EOS only (any allowed id would do; one keeps the row finite).
    """

    def __init__(self, constraints: Sequence[OrderConstraint], prompt_width: int, eos_id: int) -> None:
        self.constraints = list(constraints)
        self.prompt_width = prompt_width
        self.eos = np.array([eos_id], dtype=np.int64)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        generated = input_ids[:, self.prompt_width :].tolist()
        eos = int(self.eos[0])
        allowed = []
        for constraint, ids in zip(self.constraints, generated, strict=True):
            if eos in ids:
                allowed.append(self.eos)
            else:
                allowed.append(constraint.allowed_token_ids(ids))
        return mask_rows_(scores, range(len(allowed)), allowed)


def constrained_greedy(
    model: Any,
    prompts: Sequence[Sequence[int]],
    constraints: Sequence[OrderConstraint],
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    with_scores: bool = False,
) -> tuple[list[list[int]], Any]:
    """Each prompt's greedy completion under its constraint (cut after EOS, EOS kept), in one `generate`
    of the prompts left-padded to a common width; with `with_scores`, also the processed scores of each
    generated position ([B, V] per position, as `generate` returns them). The model is put in eval mode
    and given back in the mode it was in."""
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        output_scores=with_scores,
        return_dict_in_generate=True,
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([ConstraintLogitsProcessor(constraints, width, eos_id)]),
            )
    finally:
        model.train(was_training)
    rows = [row[: row.index(eos_id) + 1] if eos_id in row else row for row in out.sequences[:, width:].tolist()]
    return rows, (out.scores if with_scores else None)


def verify_greedy(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    constraints: Sequence[OrderConstraint],
    pad_id: int,
) -> list[list[float] | None]:
    """For each row, the masked log-probabilities (temperature 1) of its completion's tokens if that
    completion is its prompt's greedy completion under its constraint, else None: one teacher-forced
    forward of all the rows.

    Greedy decoding writes, at each position, the first id of largest masked logit (`argmax`, as
    `generate` does). So a candidate completion is the greedy one exactly when each of its tokens is that
    argmax given the tokens before it, and one forward checks every position at once where decoding takes
    a forward per token: speculative decoding's verification, the candidate being a completion the caller
    expects (the previous weights' completion, after a small update). The prompts' common prefix is
    forwarded once and its KV cache repeated for every row; the rest is right-padded, and a causal model's
    real tokens never attend to the padding after them."""
    if not prompts:
        return []
    shared = 0
    shortest = min(len(p) for p in prompts)
    while shared < shortest - 1 and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1  # one prompt token at least stays in every row: it predicts the first completion token
    rows = [list(p[shared:]) + list(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * (shared + len(r)) + [0] * (width - len(r)) for r in rows], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            cache = None
            if shared:
                prefix = torch.tensor([list(prompts[0][:shared])], device=device)
                cache = model(input_ids=prefix, use_cache=True).past_key_values
                cache.batch_repeat_interleave(len(rows))
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=bool(shared)).logits
    finally:
        model.train(was_training)
    return [
        _greedy_logprobs(logits[row, len(prompt) - shared - 1 :], completion, constraint)  # from its last prompt token
        for row, (prompt, completion, constraint) in enumerate(zip(prompts, completions, constraints, strict=True))
    ]


def _greedy_logprobs(
    logits: torch.Tensor, completion: Sequence[int], constraint: OrderConstraint
) -> list[float] | None:
    """`verify_greedy` for one row: `logits[j]` predicts `completion[j]`."""
    if not completion:
        return None
    try:
        allowed = constraint.masks_for(completion)
    except ConstraintViolation:
        return None  # not even a legal completion now
    scores = logits[: len(completion)].float().clone()
    mask_rows_(scores, range(len(completion)), allowed)
    if scores.argmax(dim=-1).tolist() != list(completion):
        return None
    logprobs = torch.log_softmax(scores, dim=-1)
    return [float(logprobs[j, token]) for j, token in enumerate(completion)]
