"""The GRPO loss as small pure functions over flat per-token tensors.

Every tensor here is one value per completion token, all completions of a micro-batch concatenated
(no padding, so no masks): `logp` is the trainer's masked, tempered log-probability of each sampled
token under the current weights (with gradient), `logp_old` the trainer's under the weights that
produced the behaviour version (no gradient), `behaviour` what vLLM reported while sampling.

Why three logprobs. The sampling distribution is vLLM's; the trainer can only differentiate its
own. Following the decoupled form of Yao et al. ("Your efficient RL framework secretly brings you
off-policy RL training", 2025), the importance weight pi_theta / mu is split in two factors:

    pi_theta / mu  =  [pi_theta / pi_old]  *  [pi_old / mu]
                       PPO ratio, clipped      truncated importance weight (TIS), detached

`pi_old` is the trainer's own distribution under the behaviour version's weights, so the ratio
measures only policy change (the lag between the version that played and the weights being
trained), and the asymmetric clip bounds that change per token; `pi_old / mu` measures only the
numeric drift between two engines computing the same policy, and is capped at `tis_cap` so that a
rare token the engines disagree on cannot dominate the step. With no lag the ratio is exactly 1 in
value and the step is the plain policy gradient weighted by the drift correction.

Per-token loss:  -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
                 - entropy_coef * H  +  kl_coef * k2(pi_theta, pi_ref)
The KL penalty's gradient is k2's, (logp - logp_ref) * grad(logp): over tokens sampled from the policy
it is the gradient of KL(pi_theta || pi_ref), the direction meant. k3 (exp(d) - d - 1), the usual
GRPO choice, has gradient (1 - pi_ref / pi_theta) * grad(logp), whose expectation under pi_theta is
the gradient of the reverse KL(pi_ref || pi_theta); it is still what the logs report as `kl`, being
the unbiased, non-negative estimate of KL(pi_theta || pi_ref)'s value.
Normalisation: summed over every token of the optimiser step and divided by that step's token count
(`total_tokens`), the same for every micro-batch, so gradient accumulation is exact and a long
completion weighs as many tokens as it has (no per-sequence mean, hence no length bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def importance_ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """r = pi_theta / pi_old per token; differentiable in `logp` only."""
    return torch.exp(logp - logp_old.detach())


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate with separate epsilons: (loss per token, clipped-low, clipped-high).

    The clip only matters where it removes the gradient: below 1 - clip_low for a negative
    advantage (the token is already made less likely enough) and above 1 + clip_high for a positive
    one. Those are the tokens the two boolean masks mark.
    """
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    low = (advantages < 0) & (ratio < 1.0 - clip_low)
    high = (advantages > 0) & (ratio > 1.0 + clip_high)
    return loss, low, high


def truncated_importance_weight(
    logp_old: torch.Tensor, behaviour: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w = min(pi_old / mu, cap), capped mask), detached: a weight, never a path for gradients."""
    raw = torch.exp(logp_old.detach() - behaviour)
    return raw.clamp(max=cap), raw > cap


def k2_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """0.5 * (logp - logp_ref)^2 per sampled token: the penalty whose gradient, over tokens sampled from
    pi_theta, is that of KL(pi_theta || pi_ref) (see the module doc); differentiable in `logp` only."""
    d = logp - logp_ref.detach()
    return 0.5 * d * d


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per sampled token: exp(d) - d - 1, d = ref - logp.

    Non-negative, zero exactly where the two agree, and an unbiased estimate of the KL's value for tokens
    sampled from pi_theta; per token, so it cannot explode with length. Logged, not differentiated: its
    gradient points along the reverse KL (see the module doc).
    """
    d = logp_ref.detach() - logp
    return torch.exp(d) - d - 1.0


def masked_entropy(scaled_logits: torch.Tensor) -> torch.Tensor:
    """Entropy per row of softmax(scaled_logits), where disallowed entries are -inf (they contribute 0).

    `scaled_logits` are already masked and divided by the temperature: the entropy of the
    distribution the sampler actually drew from.
    """
    logp = torch.log_softmax(scaled_logits, dim=-1)
    # -inf must leave the product before it is formed: 0 * -inf is NaN, and so is its gradient,
    # even behind a `where` that discards the value.
    finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(finite.exp() * finite).sum(-1)  # masked entries: exp(0) * 0 = 0


@dataclass
class LossStats:
    """Sums, counts and extremes over the tokens seen so far; `merge` across micro-batches, `summary` at the end."""

    tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)

    def add_sum(self, name: str, value: torch.Tensor | float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def add_extremes(self, name: str, values: torch.Tensor) -> None:
        if values.numel():
            self.maxs[name] = max(self.maxs.get(name, float("-inf")), float(values.max()))
            self.mins[name] = min(self.mins.get(name, float("inf")), float(values.min()))

    def merge(self, other: LossStats) -> None:
        self.tokens += other.tokens
        for k, v in other.sums.items():
            self.add_sum(k, v)
        for k, v in other.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, float("-inf")), v)
        for k, v in other.mins.items():
            self.mins[k] = min(self.mins.get(k, float("inf")), v)

    def summary(self) -> dict[str, float]:
        """Means per token (`<name>`), and `<name>_max` / `<name>_min` where extremes were kept."""
        n = max(self.tokens, 1)
        out = {k: v / n for k, v in self.sums.items()}
        out.update({f"{k}_max": v for k, v in self.maxs.items()})
        out.update({f"{k}_min": v for k, v in self.mins.items()})
        return out


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    *,
    total_tokens: int,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the step's loss (sums divided by the step's `total_tokens`) and its stats.

    Summing the returned losses of every micro-batch of a step gives the token mean over the step.
    `entropy` (per token, differentiable) is needed when `entropy_coef` > 0 and `logp_ref` when
    `kl_coef` > 0; either is logged when given.
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be positive, got {total_tokens}")
    n = logp.numel()
    for name, t in (("logp_old", logp_old), ("behaviour", behaviour), ("advantages", advantages)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}: one value per token")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs the reference logprobs")
    ratio = importance_ratio(logp, logp_old)
    surrogate, low, high = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    weight, capped = truncated_importance_weight(logp_old, behaviour, tis_cap)
    pg = (weight * surrogate).sum()
    total = pg
    stats = LossStats(tokens=n)
    stats.add_sum("loss_pg", pg.detach())
    if entropy is not None:
        ent = entropy.sum()
        if entropy_coef > 0:
            total = total - entropy_coef * ent
        stats.add_sum("entropy", ent.detach())
    if logp_ref is not None:
        if kl_coef > 0:
            total = total + kl_coef * k2_kl(logp, logp_ref).sum()
        kl = k3_kl(logp.detach(), logp_ref)
        stats.add_sum("kl", kl.sum())
        stats.add_extremes("kl", kl)
    with torch.no_grad():
        log_ratio = logp.detach() - logp_old
        drift = logp_old - behaviour
        stats.add_sum("ratio", ratio.detach().sum())
        stats.add_extremes("ratio", ratio.detach())
        stats.add_sum("log_ratio", log_ratio.sum())
        stats.add_extremes("log_ratio", log_ratio)
        stats.add_sum("drift_abs", drift.abs().sum())  # |trainer - engine| per token under the same weights
        stats.add_extremes("drift", drift)
        stats.add_sum("clip_frac_low", low.sum())
        stats.add_sum("clip_frac_high", high.sum())
        stats.add_sum("tis_capped_frac", capped.sum())
        stats.add_sum("tis_weight", weight.sum())
        stats.add_sum("advantage", advantages.sum())
    return total / total_tokens, stats


def nll_loss(
    logp: torch.Tensor, *, total_tokens: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, LossStats]:
    """Behaviour cloning: this micro-batch's share of the step's masked NLL (token mean over the step).

    `weights` (one per token, >= 0) scale each token's term; the mean still divides by `total_tokens`, so
    weights of 1 are the plain NLL and a weight of 3 counts a token as three. Under a weighted NLL the
    optimum at a branching token is the teacher's distribution tilted by the weights (q(x) is proportional
    to w(x) p(x)): weighting the tokens of the teacher's supports makes a greedy student choose supports
    where the teacher supports often enough, not only where a support is its single likeliest order.
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be positive, got {total_tokens}")
    if weights is not None and (weights.shape != logp.shape or bool((weights < 0).any())):
        raise ValueError(f"weights must be non-negative, one per token: {tuple(weights.shape)} for {tuple(logp.shape)}")
    nll = -(logp * weights).sum() if weights is not None else -logp.sum()
    stats = LossStats(tokens=logp.numel())
    stats.add_sum("loss_nll", nll.detach())
    with torch.no_grad():
        stats.add_sum("token_accuracy_p", logp.detach().exp().sum())  # mean probability of the target token
    return nll / total_tokens, stats
