"""The GRPO loss on cases small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch

from diprl.learn.loss import (
    clipped_surrogate,
    grpo_loss,
    k3_kl,
    masked_entropy,
    nll_loss,
    truncated_importance_weight,
)

KW = {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0}


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_ratio_one_gives_the_plain_policy_gradient() -> None:
    """logp = logp_old = behaviour: the gradient is -A / N per token, as for -sum(A * logp) / N."""
    logp = _t(-0.5, -1.0, -2.0).requires_grad_()
    adv = _t(1.0, -2.0, 0.5)
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), adv, total_tokens=3, **KW)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, -adv / 3)
    assert float(loss.detach()) == pytest.approx(-float(adv.sum()) / 3)
    s = stats.summary()
    assert s["ratio"] == pytest.approx(1.0) and s["clip_frac_low"] == 0 and s["clip_frac_high"] == 0
    assert s["tis_capped_frac"] == 0 and s["tis_weight"] == pytest.approx(1.0)


def test_clip_high_removes_the_gradient_of_a_positive_advantage_above_one_plus_eps() -> None:
    # ratios 1.5 and 1.1 with A = +1: the first is clipped (1.5 > 1.28), the second is not
    logp = torch.log(_t(1.5, 1.1)).requires_grad_()
    old = _t(0.0, 0.0)
    loss, stats = grpo_loss(logp, old, old, _t(1.0, 1.0), total_tokens=2, **KW)
    loss.backward()
    assert logp.grad is not None
    assert float(logp.grad[0]) == 0.0
    assert float(logp.grad[1]) == pytest.approx(-1.1 / 2)  # d(-r A)/dlogp = -r A, over 2 tokens
    assert float(loss.detach()) == pytest.approx(-(1.28 + 1.1) / 2)
    assert stats.summary()["clip_frac_high"] == pytest.approx(0.5)
    assert stats.summary()["clip_frac_low"] == 0


def test_clip_low_removes_the_gradient_of_a_negative_advantage_below_one_minus_eps() -> None:
    logp = torch.log(_t(0.5, 0.9)).requires_grad_()
    old = _t(0.0, 0.0)
    loss, stats = grpo_loss(logp, old, old, _t(-1.0, -1.0), total_tokens=2, **KW)
    loss.backward()
    assert logp.grad is not None
    assert float(logp.grad[0]) == 0.0
    assert float(logp.grad[1]) == pytest.approx(0.9 / 2)
    assert float(loss.detach()) == pytest.approx((0.8 + 0.9) / 2)
    assert stats.summary()["clip_frac_low"] == pytest.approx(0.5)


def test_clip_is_pessimistic_only_it_never_stops_a_correction() -> None:
    """A positive advantage at r < 1 - eps, or a negative one at r > 1 + eps, keeps its full gradient."""
    ratio = _t(0.5, 1.5)
    loss, low, high = clipped_surrogate(ratio, _t(1.0, -1.0), 0.2, 0.28)
    assert torch.allclose(loss, _t(-0.5, 1.5))
    assert not low.any() and not high.any()


def test_truncated_importance_weight_caps_engine_drift() -> None:
    # trainer-old vs engine: ratios 1, e^0.5 = 1.65, e^1 = 2.72 (capped at 2), e^-1
    w, capped = truncated_importance_weight(_t(0.0, 0.5, 1.0, -1.0), _t(0.0, 0.0, 0.0, 0.0), cap=2.0)
    assert torch.allclose(w, _t(1.0, math.exp(0.5), 2.0, math.exp(-1.0)))
    assert capped.tolist() == [False, False, True, False]
    # the weight scales the gradient and carries none itself
    logp = _t(-1.0, -1.0).requires_grad_()
    loss, stats = grpo_loss(logp, logp.detach(), _t(-3.0, -1.0), _t(1.0, 1.0), total_tokens=2, **KW)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, _t(-2.0 / 2, -1.0 / 2))
    assert stats.summary()["tis_capped_frac"] == pytest.approx(0.5)
    # ...also when `logp_old` arrives attached to the graph (no lag: the same tensor as logp). Were the
    # weight or the ratio's denominator not detached, gradient would flow through them and differ.
    attached = _t(-1.0, -1.0).requires_grad_()
    loss, _ = grpo_loss(attached, attached, _t(-3.0, -1.0), _t(1.0, 1.0), total_tokens=2, **KW)
    loss.backward()
    assert attached.grad is not None and torch.allclose(attached.grad, logp.grad)


def test_token_normalisation_sums_over_all_tokens_of_the_step() -> None:
    """Two micro-batches (a 1-token and a 3-token completion) add up to the mean over all 4 tokens."""
    adv = [_t(2.0), _t(1.0, 1.0, 1.0)]
    logps = [_t(-1.0).requires_grad_(), _t(-1.0, -1.0, -1.0).requires_grad_()]
    total = sum(
        grpo_loss(lp, lp.detach(), lp.detach(), a, total_tokens=4, **KW)[0] for lp, a in zip(logps, adv, strict=True)
    )
    assert float(total.detach()) == pytest.approx(-(2 + 1 + 1 + 1) / 4)
    assert isinstance(total, torch.Tensor)
    total.backward()
    # every token weighs 1/4: no per-sequence mean that would give the lone token 1/2
    assert logps[0].grad is not None and logps[1].grad is not None
    assert float(logps[0].grad[0]) == pytest.approx(-2 / 4)
    assert torch.allclose(logps[1].grad, _t(-0.25, -0.25, -0.25))


def test_entropy_of_a_masked_distribution() -> None:
    inf = float("inf")
    # two allowed tokens with equal logits: log 2; one allowed: 0; four equal: log 4
    logits = _t(0.0, 0.0, -inf, -inf).reshape(1, 4)
    assert float(masked_entropy(logits)[0]) == pytest.approx(math.log(2))
    assert float(masked_entropy(_t(3.0, -inf, -inf, -inf).reshape(1, 4))[0]) == pytest.approx(0.0)
    assert float(masked_entropy(_t(1.0, 1.0, 1.0, 1.0).reshape(1, 4))[0]) == pytest.approx(math.log(4))
    # its gradient is finite although the masked logits are -inf
    raw = _t(0.5, -0.5, 0.0, 0.0).requires_grad_()
    masked_entropy(raw.masked_fill(_t(0, 0, 1, 1).bool(), -inf).reshape(1, 4)).sum().backward()
    assert raw.grad is not None and bool(torch.isfinite(raw.grad).all()) and float(raw.grad.abs().sum()) > 0
    # the bonus lowers the loss by coef * mean entropy
    logp = _t(-0.7).requires_grad_()
    base, _ = grpo_loss(logp, logp.detach(), logp.detach(), _t(0.0), total_tokens=1, **KW)
    bonus, stats = grpo_loss(
        logp, logp.detach(), logp.detach(), _t(0.0), total_tokens=1, entropy=_t(0.5), entropy_coef=0.1, **KW
    )
    assert float((base - bonus).detach()) == pytest.approx(0.05)
    assert stats.summary()["entropy"] == pytest.approx(0.5)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    logp = _t(-1.0, -2.0).requires_grad_()
    kl = k3_kl(logp, logp.detach())
    assert torch.equal(kl, _t(0.0, 0.0))
    kl.sum().backward()
    assert logp.grad is not None and torch.equal(logp.grad, _t(0.0, 0.0))  # no pull at the reference
    d = 0.5
    assert float(k3_kl(_t(-1.0), _t(-1.0 + d))[0]) == pytest.approx(math.exp(d) - d - 1)
    loss, stats = grpo_loss(
        logp.detach(),
        logp.detach(),
        logp.detach(),
        _t(0.0, 0.0),
        total_tokens=2,
        logp_ref=logp.detach(),
        kl_coef=1.0,
        **KW,
    )
    assert float(loss.detach()) == 0.0 and stats.summary()["kl"] == 0.0


def test_the_kl_penalty_pulls_along_kl_of_policy_to_reference() -> None:
    """Over tokens sampled from pi, the penalty's expected gradient is grad KL(pi || ref), not KL(ref || pi).

    Three tokens, logits theta; the expectation is taken exactly by weighting each token's gradient
    with pi (detached), as sampling would on average.
    """
    theta = _t(1.0, 0.0, -1.0).requires_grad_()
    ref = torch.log_softmax(_t(-1.0, 0.5, 0.2), dim=0)
    logp = torch.log_softmax(theta, dim=0)
    pi = logp.detach().exp()
    expected = sum(
        pi[t]
        * grpo_loss(
            logp[t : t + 1],
            logp[t : t + 1].detach(),
            logp[t : t + 1].detach(),
            _t(0.0),
            total_tokens=1,
            logp_ref=ref[t : t + 1],
            kl_coef=1.0,
            **KW,
        )[0]
        for t in range(3)
    )
    (grad_penalty,) = torch.autograd.grad(expected, theta, retain_graph=True)
    forward_kl = (logp.exp() * (logp - ref)).sum()
    (grad_forward,) = torch.autograd.grad(forward_kl, theta, retain_graph=True)
    reverse_kl = (ref.exp() * (ref - logp)).sum()
    (grad_reverse,) = torch.autograd.grad(reverse_kl, theta)
    assert torch.allclose(grad_penalty, grad_forward, atol=1e-12)
    assert not torch.allclose(grad_forward, grad_reverse, atol=1e-3)  # the two directions do differ here


def test_nll_is_the_token_mean_negative_log_likelihood() -> None:
    logp = _t(-1.0, -3.0).requires_grad_()
    loss, stats = nll_loss(logp, total_tokens=2)
    assert float(loss.detach()) == pytest.approx(2.0)
    loss.backward()
    assert logp.grad is not None and torch.allclose(logp.grad, _t(-0.5, -0.5))
    assert stats.summary()["loss_nll"] == pytest.approx(2.0)


def test_weighted_nll_counts_a_token_as_its_weight_and_keeps_the_token_mean() -> None:
    logp = _t(-1.0, -3.0).requires_grad_()
    loss, _ = nll_loss(logp, total_tokens=2, weights=_t(1.0, 3.0))
    assert float(loss.detach()) == pytest.approx((1.0 + 9.0) / 2)
    loss.backward()
    assert logp.grad is not None and torch.allclose(logp.grad, _t(-0.5, -1.5))
    with pytest.raises(ValueError, match="non-negative"):
        nll_loss(logp, total_tokens=2, weights=_t(1.0, -1.0))
    with pytest.raises(ValueError, match="one per token"):
        nll_loss(logp, total_tokens=2, weights=_t(1.0))


def test_bad_inputs_are_refused() -> None:
    x = _t(0.0, 0.0)
    with pytest.raises(ValueError, match="one value per token"):
        grpo_loss(x, x, _t(0.0), x, total_tokens=2, **KW)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(x, x, x, x, total_tokens=2, entropy_coef=0.1, **KW)
    with pytest.raises(ValueError, match="total_tokens"):
        grpo_loss(x, x, x, x, total_tokens=0, **KW)
