"""The dense reference of a constrained log-probability, the tests' yardstick for both engines.

vLLM's `processed_logprobs` (sampling) and the learner's `diprl.learn.model.completion_logprobs`
(allowed columns only, forced tokens skipped) must both equal this plain computation over the whole
vocabulary: the mask, then the temperature, then log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from diprl.policy.logprobs import allowed_mask


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
