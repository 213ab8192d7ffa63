r"""League health: what a run reports about its league every few steps (issue 36).

One job per piece, each a pure function or a small class the `LeagueManager` feeds:

- `nash_over_measured`: the maximum-entropy Nash of the payoff among the members whose every pair
  has at least `min_games` games. A pair that never met is not a result; reading it as 0.5 invents
  one (main beating Random 90% and losing to DumbBot 90% gives an unplayed `base` a third of the
  weight). Members outside the solved set are reported as *left out*, never as weight 0.
- `population_value` / `relative_population_performance`: AlphaStar's relative population
  performance, the value of the zero-sum meta-game between two populations.
- `ExploitLedger`: exploiters' results against main's versions, with Wilson intervals, and the
  lower bound on each version's exploitability they give; exploiters that timed out are recorded too.
- `BestVersion`, `collapse_faults`, `rollback_decision`: the best main version by evaluation score,
  guards on collapse (typed `Fault` records) and the decision to roll back to the best version.

Nothing here imports torch or Ray; the manager persists what the classes hold (`to_dict`/`from_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linprog  # type: ignore[import-untyped]

from diprl.league.nash import max_entropy_nash

Z95 = 1.959963984540054
"""Two-sided 95% quantile of the standard normal."""

_SUPPORT_TOL = 1e-6


# ----------------------------------------------------------------------------------------- config
@dataclass
class GuardConfig:
    """Thresholds of the collapse guards (see `collapse_faults`); a rate that is not measured is not guarded.

    The defaults flag what a working main never does: the held-out main of issue 36 ordered supports
    in 0.56% of its orders (below `min_support_rate`), 87% of them void (above `max_void_support_rate`).
    """

    max_hold_rate: float = 0.9  # share of the hero's movement orders that are holds
    min_support_rate: float = 0.02  # share of the hero's movement orders that are supports
    max_void_support_rate: float = 0.6  # share of supports the engine marked void
    max_bad_completion_rate: float = 0.05  # share of LLM completions that were malformed
    max_kind_share: float = 0.95  # any one order kind (hold, move, support, convoy) above this share: no mix left

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"league.health.guards.{name} must be in [0, 1], got {value}")


@dataclass
class HealthConfig:
    """What the league reports about its health (`league.health`), and how often the driver logs it."""

    every_steps: int = 10  # main steps between two `league` health records in metrics.jsonl (also at step 1)
    nash_min_games: float = 1.0  # a member enters the Nash solve only if all its pairs have this many games
    rpp_snapshots: int = 3  # relative population performance against the population this many snapshots ago
    z: float = Z95  # the intervals' normal quantile (95%)
    guards: GuardConfig = field(default_factory=GuardConfig)
    rollback: bool = False  # when a guard fires, decide a rollback of main to its best version
    pin_every: int = 2  # main's 1st snapshot and every pin_every-th after it join the evaluator's pool (0: none)
    pin_max: int = 3  # at most this many pinned: the frozen pool stays fixed once full (evaluation cost)
    crossplay_pairs: int = 2  # pool pairs the evaluator plays after each evaluation, unmeasured first (0: none)
    crossplay_games: int = 7  # games a pair: every power once as the hero
    crossplay_replays: int = 1  # a pair's first games kept as replays (the league page links them; 0: none)
    crossplay_replay_rounds: int = 10  # replays of the newest rounds kept, older rounds' deleted (disk)

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"league.health.every_steps must be >= 1, got {self.every_steps}")
        if self.nash_min_games < 0.0:
            raise ValueError(f"league.health.nash_min_games must be >= 0, got {self.nash_min_games}")
        if self.rpp_snapshots < 1:
            raise ValueError(f"league.health.rpp_snapshots must be >= 1, got {self.rpp_snapshots}")
        if self.z <= 0.0:
            raise ValueError(f"league.health.z must be positive, got {self.z}")
        for name in ("pin_every", "pin_max", "crossplay_pairs"):
            if getattr(self, name) < 0:
                raise ValueError(f"league.health.{name} must be >= 0, got {getattr(self, name)}")
        if self.crossplay_games < 1:
            raise ValueError(f"league.health.crossplay_games must be >= 1, got {self.crossplay_games}")
        replays = self.crossplay_replays
        if isinstance(replays, bool) or not isinstance(replays, int) or not 0 <= replays <= self.crossplay_games:
            raise ValueError(
                f"league.health.crossplay_replays must be between 0 and crossplay_games ({self.crossplay_games}), "
                f"got {replays!r}"
            )
        if self.crossplay_replay_rounds < 1:
            raise ValueError(f"league.health.crossplay_replay_rounds must be >= 1, got {self.crossplay_replay_rounds}")


# ----------------------------------------------------------------------------------------- intervals
def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a rate `successes / n`; fractional counts allowed (ties count half).

    The league's outcomes are shares (the share of a member's seats the hero outranks, ties half), so
    `successes` is a sum of numbers in [0, 1] over `n` games. With no games the whole range comes back.
    (`diprl.eval.stats` has the integer form; the league sits below `diprl.eval` and cannot import it.)
    """
    if n < 0.0 or successes < 0.0 or successes > n + 1e-9:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0.0:
        return 0.0, 1.0
    p = min(successes / n, 1.0)
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2.0 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


# ----------------------------------------------------------------------------------------- Nash
@dataclass(frozen=True)
class NashReport:
    """The max-entropy Nash over the measured members, and who was left out of it."""

    weights: dict[str, float]  # solved members -> weight (sum 1)
    left_out: tuple[str, ...]  # members with a pair below the minimum: not in the solve, not weight 0
    entropy: float  # -sum w log w, nats (log k for k members weighed alike)
    support: int  # members with weight above 1e-6
    main_weight: float | None  # main's weight; None when main was left out
    min_games: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"left_out": list(self.left_out)}


def entropy(weights: Sequence[float] | np.ndarray) -> float:
    """Shannon entropy in nats, 0 log 0 = 0."""
    w = np.asarray(weights, dtype=np.float64)
    w = w[w > 0.0]
    return float(-np.sum(w * np.log(w))) + 0.0  # + 0.0: a single member's entropy reads 0.0, not -0.0


def measured_members(members: Sequence[str], games: Callable[[str, str], float], min_games: float) -> list[str]:
    """The largest set the greedy rule finds in which every pair has at least `min_games` games (and one).

    Repeatedly drop the member with the most unmeasured pairs (ties: fewer games in the set, then the
    name), so a table where two bots never met keeps the learner and whichever bots it played.
    """
    need = max(min_games, 1e-9)
    keep = list(members)
    while len(keep) > 1:
        missing = {m: sum(games(m, o) < need for o in keep if o != m) for m in keep}
        played = {m: sum(games(m, o) for o in keep if o != m) for m in keep}
        worst = max(keep, key=lambda m: (missing[m], -played[m], m))
        if missing[worst] == 0:
            break
        keep.remove(worst)
    return keep if len(keep) > 1 or len(members) == 1 else []  # one member left: nothing was measured


def nash_over_measured(
    members: Sequence[str],
    win_rate: Callable[[str, str], float],
    games: Callable[[str, str], float],
    min_games: float,
    main: str = "main",
) -> NashReport:
    """Max-entropy Nash (`diprl.league.nash`) of the win rates among the measured members (see module doc).

    `win_rate(a, b)` must be the measured rate whenever `games(a, b) >= min_games` (a `Payoff` whose own
    `min_games` is not above this one's).
    """
    keep = measured_members(members, games, min_games)
    left_out = tuple(m for m in members if m not in keep)
    if not keep:
        return NashReport({}, left_out, 0.0, 0, None, min_games)
    matrix = [[win_rate(a, b) if a != b else 0.5 for b in keep] for a in keep]
    w = max_entropy_nash(matrix)
    weights = {m: float(x) for m, x in zip(keep, w, strict=True)}
    support = int(np.sum(w > _SUPPORT_TOL))
    return NashReport(weights, left_out, entropy(w), support, weights.get(main), min_games)


# ----------------------------------------------------------------------------------------- RPP
def population_value(win_rates: Sequence[Sequence[float]] | np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    r"""Value of the zero-sum meta-game M - 1/2 (rows maximise), and both players' equilibrium mixtures.

    M[i, j] is row member i's win rate against column member j. The row player's maximin mixture p
    solves the linear program

        max v   s.t.   sum_i p_i (M[i, j] - 1/2) >= v  for every column j,   p >= 0,   sum p = 1,

    and the column player's mixture is the dual of the column constraints. v > 0: some mixture of
    the rows beats every mixture of the columns; v = 0 for a population against itself.
    """
    m = np.asarray(win_rates, dtype=np.float64) - 0.5
    if m.ndim != 2 or 0 in m.shape:
        raise ValueError(f"need a non-empty matrix of win rates, got shape {m.shape}")
    rows, cols = m.shape
    c = np.zeros(rows + 1)
    c[-1] = -1.0  # maximise v
    a_ub = np.hstack([-m.T, np.ones((cols, 1))])  # v - sum_i p_i m[i, j] <= 0
    a_eq = np.hstack([np.ones((1, rows)), np.zeros((1, 1))])
    bounds = [(0.0, None)] * rows + [(None, None)]
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(cols), A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    if res.status != 0:  # cannot happen: the program is feasible and bounded; guard anyway
        raise RuntimeError(f"meta-game LP failed: {res.message}")
    p = np.clip(np.asarray(res.x[:rows]), 0.0, None)
    q = np.clip(-np.asarray(res.ineqlin.marginals), 0.0, None)
    q = q / q.sum() if q.sum() > 0 else np.full(cols, 1.0 / cols)
    return float(res.x[-1]), p / p.sum(), q


@dataclass(frozen=True)
class RPPReport:
    value: float  # > 0: the current population beats the past one at the meta-game's equilibrium
    current: tuple[str, ...]  # rows kept (every pair with a kept column measured)
    past: tuple[str, ...]
    left_out: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def relative_population_performance(
    current: Sequence[str],
    past: Sequence[str],
    win_rate: Callable[[str, str], float],
    games: Callable[[str, str], float],
    min_games: float,
) -> RPPReport | None:
    """AlphaStar's RPP of population `current` against `past`, over measured pairs only; None if none.

    Only measured pairs count: greedily drop the row or column with the most pairs below `min_games`
    until every remaining row-column pair was played. A member in both populations is dropped from
    the past one (it cannot be compared with itself).
    """
    need = max(min_games, 1e-9)
    rows = list(current)
    cols = [m for m in past if m not in rows]
    while rows and cols:
        row_missing = {r: sum(games(r, c) < need for c in cols) for r in rows}
        col_missing = {c: sum(games(r, c) < need for r in rows) for c in cols}
        worst_row = max(rows, key=lambda r: (row_missing[r], r))
        worst_col = max(cols, key=lambda c: (col_missing[c], c))
        if row_missing[worst_row] == 0:
            break
        if row_missing[worst_row] / len(cols) >= col_missing[worst_col] / len(rows):
            rows.remove(worst_row)
        else:
            cols.remove(worst_col)
    if not rows or not cols:
        return None
    value, _, _ = population_value([[win_rate(r, c) for c in cols] for r in rows])
    left_out = tuple(m for m in [*current, *past] if m not in rows and m not in cols)
    return RPPReport(value, tuple(rows), tuple(cols), left_out)


# ----------------------------------------------------------------------------------------- exploitability
@dataclass(frozen=True)
class ExploitEstimate:
    """One exploiter's payoff against one main version: share of its seats outranked, Wilson interval."""

    exploiter: str
    target: str
    rate: float
    low: float
    high: float
    games: float


class ExploitLedger:
    """Exploiters' games against main's versions, and when an exploiter was frozen (beat main or timed out).

    An exploiter e that outranks main's version v in a share x of seats over n games shows that v can
    be exploited: the Wilson lower bound lo(e, v) - 1/2 is, at 95%, a lower bound on v's exploitability
    measured as the best response's gain over an even game. Taking the running maximum over every
    exploiter that met v gives the tightest bound the league has seen; 0 when no exploiter beat v
    beyond chance. It is a lower bound only: a stronger exploiter may exist that nobody trained.
    """

    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str], list[float]] = {}  # (exploiter, target) -> [wins, games]
        self.closed: list[dict[str, Any]] = []  # exploiters frozen: beat main, or timed out

    def record(self, exploiter: str, target: str, outcome: float, weight: float = 1.0) -> None:
        if not 0.0 <= outcome <= 1.0:
            raise ValueError(f"outcome must be in [0, 1], got {outcome}")
        if weight <= 0.0:
            raise ValueError(f"game weight must be positive, got {weight}")
        acc = self.tallies.setdefault((exploiter, target), [0.0, 0.0])
        acc[0] += weight * outcome
        acc[1] += weight

    def close(self, exploiter: str, target: str, win_rate: float, beaten: bool, step: int) -> None:
        """Exploiter `exploiter` was frozen against main's `target`: it beat main (`beaten`) or timed out."""
        event = {"exploiter": exploiter, "target": target, "win_rate": win_rate, "beaten": beaten, "step": step}
        if event not in self.closed:
            self.closed.append(event)

    def estimates(self, z: float = Z95, group: Callable[[str], str] | None = None) -> list[ExploitEstimate]:
        """Per (exploiter, target) estimate; `group` maps a target to the version it stands for (default: itself)."""
        merged: dict[tuple[str, str], list[float]] = {}
        for (exploiter, target), (wins, games) in sorted(self.tallies.items()):
            key = (exploiter, group(target) if group else target)
            acc = merged.setdefault(key, [0.0, 0.0])
            acc[0] += wins
            acc[1] += games
        out = []
        for (exploiter, target), (wins, games) in merged.items():
            low, high = wilson_interval(wins, games, z)
            out.append(ExploitEstimate(exploiter, target, wins / games, low, high, games))
        return out

    def lower_bounds(self, z: float = Z95, group: Callable[[str], str] | None = None) -> dict[str, dict[str, Any]]:
        """Target -> {"lower_bound", "exploiter", "rate", "low", "high", "games"}: the exploiter of the max bound."""
        best: dict[str, ExploitEstimate] = {}
        for e in self.estimates(z, group):
            if e.target not in best or e.low > best[e.target].low:
                best[e.target] = e
        return {
            t: {"lower_bound": max(0.0, e.low - 0.5)} | asdict(e) for t, e in sorted(best.items(), key=lambda kv: kv[0])
        }

    def to_dict(self) -> dict[str, Any]:
        return {"tallies": [[e, t, w, g] for (e, t), (w, g) in sorted(self.tallies.items())], "closed": self.closed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExploitLedger:
        ledger = cls()
        for e, t, w, g in data.get("tallies", []):
            ledger.tallies[(str(e), str(t))] = [float(w), float(g)]
        ledger.closed = [dict(c) for c in data.get("closed", [])]
        return ledger


# ----------------------------------------------------------------------------------------- best version, guards
@dataclass(frozen=True)
class Score:
    """An evaluation score of one main version with its interval (e.g. mean centres and its 95% bootstrap)."""

    version: str
    step: int
    score: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.score <= self.high:
            raise ValueError(f"score {self.score} is not inside its interval [{self.low}, {self.high}]")


class BestVersion:
    """The best main version so far. Rule: the highest lower bound of the evaluation interval wins (ties:
    the earlier version), so a lucky evaluation with a wide interval does not displace a version that
    was measured well. The first evaluated version is the best until one is surely better."""

    def __init__(self) -> None:
        self.best: Score | None = None

    def observe(self, score: Score) -> bool:
        """Take one evaluation; True when `score`'s version becomes the best."""
        if self.best is None or score.low > self.best.low:
            self.best = score
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"best": None if self.best is None else asdict(self.best)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BestVersion:
        out = cls()
        if data.get("best") is not None:
            out.best = Score(**data["best"])
        return out


@dataclass(frozen=True)
class BehaviourRates:
    """What the collapse guards read about a main version; None where it was not measured."""

    hold_rate: float | None = None
    support_rate: float | None = None
    void_support_rate: float | None = None
    bad_completion_rate: float | None = None
    kind_shares: Mapping[str, float] | None = None  # order kind -> share of the hero's movement orders


@dataclass(frozen=True)
class Fault:
    """A guard that fired: the `fault` record the run logs (`kind: fault`, `fault: collapse`)."""

    guard: str
    value: float
    threshold: float
    version: str
    step: int
    message: str

    def to_record(self) -> dict[str, Any]:
        return {"fault": "collapse"} | asdict(self)


def collapse_faults(
    version: str,
    step: int,
    rates: BehaviourRates,
    guards: GuardConfig,
    score: Score | None = None,
    best: Score | None = None,
) -> list[Fault]:
    """Every guard that fires for `version` (empty: healthy). An unmeasured rate fires nothing.

    The score guard fires when the version's evaluation is below the best's by more than its own
    interval: its upper bound under the best's score.
    """
    out: list[Fault] = []

    def fire(guard: str, value: float, threshold: float, what: str) -> None:
        out.append(Fault(guard, float(value), float(threshold), version, step, f"{version}: {what}"))

    if rates.hold_rate is not None and rates.hold_rate > guards.max_hold_rate:
        fire("hold_rate", rates.hold_rate, guards.max_hold_rate, f"holds {rates.hold_rate:.1%} of its orders")
    if rates.support_rate is not None and rates.support_rate < guards.min_support_rate:
        fire("support_rate", rates.support_rate, guards.min_support_rate, f"supports in {rates.support_rate:.2%}")
    if rates.void_support_rate is not None and rates.void_support_rate > guards.max_void_support_rate:
        v = rates.void_support_rate
        fire("void_support_rate", v, guards.max_void_support_rate, f"{v:.0%} of its supports are void")
    if rates.bad_completion_rate is not None and rates.bad_completion_rate > guards.max_bad_completion_rate:
        b = rates.bad_completion_rate
        fire("bad_completion_rate", b, guards.max_bad_completion_rate, f"{b:.1%} of its completions are malformed")
    for kind, share in sorted((rates.kind_shares or {}).items()):
        if share > guards.max_kind_share:
            fire(f"kind_share/{kind}", share, guards.max_kind_share, f"{share:.1%} of its orders are {kind}")
    if score is not None and best is not None and score.version != best.version and score.high < best.score:
        fire(
            "score",
            score.score,
            best.score,
            f"score {score.score:.3g} (<= {score.high:.3g}) below best {best.score:.3g}",
        )
    return out


@dataclass(frozen=True)
class RollbackDecision:
    """Roll main back from `current` to `to` (the best version) because of `faults`: a league event."""

    policy: str
    current: str
    to: str
    step: int
    guards: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"guards": list(self.guards)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RollbackDecision:
        return cls(str(data["policy"]), str(data["current"]), str(data["to"]), int(data["step"]), tuple(data["guards"]))


def rollback_decision(
    policy: str, current: str, step: int, faults: Sequence[Fault], best: Score | None
) -> RollbackDecision | None:
    """A rollback to the best version when a guard fired and a different best version exists; else None."""
    if not faults or best is None or best.version == current:
        return None
    return RollbackDecision(policy, current, best.version, step, tuple(f.guard for f in faults))
