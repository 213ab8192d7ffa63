"""Log-probabilities of a completion under the order mask and a temperature, as vLLM sampled them.

The learner's importance ratio compares its own log-probabilities with the behaviour ones that vLLM
returned in `processed_logprobs` mode: logits masked by the constraint (everything else -inf), then
divided by the temperature, then log-softmax. This function is that computation for a trainer's
logits, so both sides compute the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


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


def constrained_logprobs(
    logits: torch.Tensor, allowed: Sequence[np.ndarray] | None, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-probability of each `tokens[t]` under softmax(mask(logits[t]) / temperature).

    `logits` is [T, V] (the positions that predicted each completion token), `allowed` the constraint's
    allowed ids before each token (`OrderConstraint.masks_for`), or None for free decoding.
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive: greedy decoding has no log-probabilities to train on")
    logits = logits.float()
    if allowed is not None:
        mask = allowed_mask(allowed, logits.shape[-1], logits.device)
        logits = logits.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
