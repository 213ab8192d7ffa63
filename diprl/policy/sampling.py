"""Seeded sampling of one constrained token, reproducible whatever else is in the batch.

vLLM's per-request seeds do not work on the CPU build with chunked prefill, and its sampler draws one
noise tensor for the whole batch, so the same request sampled in two batches of different makeup gets
different tokens. For evaluation a comparison should differ only by the policy, so a request can ask
for its own seed: the token is chosen here, by the Gumbel-max trick over the allowed ids, with noise
drawn from a generator keyed by (seed, position in the completion) alone.

Gumbel-max: argmax_i (l_i / T + g_i) with g_i = -log(-log(u_i)), u_i uniform, is a sample of
softmax(l / T); so the seeded draw has the same distribution as vLLM's own sampling at temperature T.
The row is then left with that one token allowed, which vLLM's sampler can only pick: its reported
log-probabilities are of that one-hot row (0), so seeded requests are for evaluation, never training.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 63) - 1


def _generator(seed: int, step: int) -> torch.Generator:
    # A stable mix of the two integers (no Python hash: it is salted per process).
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed(mixed)


def seeded_choice(logits: torch.Tensor, allowed: np.ndarray, temperature: float, seed: int, step: int) -> int:
    """The token id drawn from softmax(logits[allowed] / temperature) by the noise of (seed, step).

    `logits` is one row over the whole vocabulary; `allowed` the sorted allowed ids. Temperature 0
    (greedy) is the argmax over the allowed ids.
    """
    if len(allowed) == 0:
        raise ValueError("no allowed token to choose from")
    ids = torch.from_numpy(np.asarray(allowed, dtype=np.int64))
    values = logits.detach().float().cpu()[ids]
    if temperature > 0:
        u = torch.rand(len(ids), generator=_generator(seed, step), dtype=torch.float64).clamp_(1e-300, 1.0)
        values = values.double() / temperature - torch.log(-torch.log(u))
    return int(ids[int(torch.argmax(values))])
