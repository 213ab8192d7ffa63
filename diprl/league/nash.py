r"""Maximum-entropy Nash equilibrium of a symmetric zero-sum game (Nash averaging).

Win rates P (P[i, j] = i's win rate against j, 0.5 on the diagonal) become the antisymmetric
payoff A = (P - P^T) / 2, so A[i, j] = -A[j, i] and the game's value is 0. A mixed strategy p is a
Nash equilibrium (a maximin strategy) exactly when no pure strategy beats it:

    (A^T p)_j = sum_i p_i A[i, j] >= 0   for every j,   p >= 0,   sum_i p_i = 1.

These equilibria form a convex polytope; when it has more than one point, Balduzzi et al. (2018,
"Re-evaluating evaluation") pick the one of maximum entropy, which is unique, treats duplicated
members alike and gives weight to every member that some equilibrium needs (and zero to members no
equilibrium uses, e.g. a dominated strategy). Nash averaging then rates member i by (A p)_i, its
expected payoff against the equilibrium mixture (<= 0; 0 for members in the support).

The computation, for n members:
1. For each i, a linear program maximises p_i over the polytope. Members whose maximum is ~0 are in
   no equilibrium's support and get weight 0.
2. The mean of those n LP solutions is an equilibrium (the polytope is convex) that is positive on
   every remaining member: a feasible, strictly interior start.
3. Sequential least squares (SLSQP) maximises -sum p_i log p_i over the remaining members, keeping
   the equilibrium constraints against all n columns.
Rock-paper-scissors gives (1/3, 1/3, 1/3); a strategy dominated by another gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linprog, minimize  # type: ignore[import-untyped]

_SUPPORT_TOL = 1e-7


def antisymmetrise(win_rates: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """A = (P - P^T) / 2 for a square matrix of win rates (or any payoffs)."""
    p = np.asarray(win_rates, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != p.shape[1] or p.shape[0] == 0:
        raise ValueError(f"need a non-empty square payoff matrix, got shape {p.shape}")
    if not np.all(np.isfinite(p)):
        raise ValueError("payoff matrix has non-finite entries")
    return np.asarray((p - p.T) / 2.0)


def _max_weight_solution(a: np.ndarray, i: int) -> np.ndarray | None:
    """An equilibrium that maximises p_i (linprog), or None if the LP fails."""
    n = a.shape[0]
    c = np.zeros(n)
    c[i] = -1.0
    res = linprog(
        c, A_ub=-a.T, b_ub=np.zeros(n), A_eq=np.ones((1, n)), b_eq=[1.0], bounds=[(0.0, 1.0)] * n, method="highs"
    )
    return np.asarray(res.x) if res.status == 0 else None


def max_entropy_nash(win_rates: Sequence[Sequence[float]] | np.ndarray, tol: float = 1e-9) -> np.ndarray:
    """The maximum-entropy Nash equilibrium of the symmetric zero-sum game of `win_rates` (see module doc)."""
    a = antisymmetrise(win_rates)
    n = a.shape[0]
    if n == 1:
        return np.ones(1)
    solutions = [s for i in range(n) if (s := _max_weight_solution(a, i)) is not None]
    if not solutions:  # cannot happen for an antisymmetric game (one always exists); guard anyway
        raise RuntimeError("no Nash equilibrium found for the payoff matrix")
    stacked = np.vstack(solutions)
    support = stacked.max(axis=0) > _SUPPORT_TOL
    start = stacked.mean(axis=0)[support]
    start /= start.sum()
    idx = np.flatnonzero(support)
    k = idx.size
    if k == 1:
        out = np.zeros(n)
        out[idx[0]] = 1.0
        return out
    cols = a[idx, :]  # rows of A for the support: constraints (A^T p)_j = sum_s p_s A[s, j] >= 0

    def neg_entropy(q: np.ndarray) -> float:
        q = np.clip(q, 1e-15, None)
        return float(np.sum(q * np.log(q)))

    def grad(q: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(np.clip(q, 1e-15, None)) + 1.0)

    res = minimize(
        neg_entropy,
        start,
        jac=grad,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * k,
        constraints=[
            {"type": "eq", "fun": lambda q: np.array([q.sum() - 1.0]), "jac": lambda q: np.ones((1, k))},
            {"type": "ineq", "fun": lambda q: cols.T @ q + tol, "jac": lambda q: cols.T},
        ],
        options={"ftol": 1e-12, "maxiter": 500},
    )
    q = np.clip(res.x if res.success else start, 0.0, None)
    if np.min(cols.T @ q) < -1e-6:  # the solver drifted off the polytope: the interior start is an equilibrium
        q = start
    out = np.zeros(n)
    out[idx] = q / q.sum()
    return out


def nash_ratings(win_rates: Sequence[Sequence[float]] | np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Nash averaging: each member's expected payoff (A p)_i against the max-entropy equilibrium p."""
    a = antisymmetrise(win_rates)
    p = max_entropy_nash(win_rates) if weights is None else np.asarray(weights, dtype=np.float64)
    return np.asarray(a @ p)
