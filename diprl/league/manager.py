"""The LeagueManager: pool, payoff, ratings, roles and matchmaking, persisted after every change.

The training driver talks to it in four calls: `register_version` when a learner publishes (a
`VersionDecision`: maybe "snapshot", maybe "reset"), `next_match` for a role's next `Match`, `report`
with the `MatchResult`s of played matches, and `summary` for the run's `league_summary.json`. What
each role does (who it plays, its snapshot and reset rules) is the role table (`roles.py`): nothing
here branches on a role's name.

A version a PolicyServer replica refused by its canary (`refuse_version`: its engine does not serve the
weights that were trained, `diprl.inference.canary`) is never handed out again: matches and evaluations
get the role's newest version, not newer than the refused one, whose canary a replica passed
(`prove_version`; `serving`, `verified`). Versions between two canaries (`learner.canary_every`) are served
on their byte checks but never chosen as a fallback: nothing proved them, and the fault that got the
refused version may well have reached them too. With no proven version the role falls back to its first
version (what its learner started from, canaried at its first publish; a fresh adapter's first version
plays as the base model does); a role with nothing left to fall back on keeps its current version (its
requests fail, which the run's serving check stops on).

`league_actor` runs it as the named Ray actor "league" that Ray restarts after a crash; every state
change is written to `run_dir/league/` before the call returns, so a restarted manager continues where
it was and a call Ray retries after the crash is answered the same (registrations and reports are
idempotent).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diprl.league.config import LeagueConfig
from diprl.league.health import (
    BehaviourRates,
    BestVersion,
    ExploitLedger,
    RollbackDecision,
    Score,
    collapse_faults,
    nash_over_measured,
    relative_population_performance,
    rollback_decision,
)
from diprl.league.matchmaking import KINDS
from diprl.league.members import ANCHOR, LEARNER, POWERS, SNAPSHOT, Member
from diprl.league.nash import max_entropy_nash
from diprl.league.payoff import Payoff, match_outcomes
from diprl.league.persist import load_state, save_state
from diprl.league.ratings import Ratings
from diprl.league.role_state import STATE_VERSION, RoleState, VersionDecision, upgrade_state
from diprl.league.roles import MAIN, ROLE_TABLE, trained_seats
from diprl.league.snapshot import should_snapshot
from diprl.messages import Match, MatchResult, PolicyRef, UnknownPolicyRef, parse_seats, seat_texts

log = logging.getLogger(__name__)

DONE_MEMORY = 20_000  # reported match ids remembered, so a retried report is not counted twice
VERSION_MEMORY = 64  # registered versions remembered per role: the fallbacks for one refused by its canary
NASH_REFRESH = 20  # matches reported between recomputations of the Nash weights used for matchmaking


class LeagueManager:
    """See the module doc; `config.roles` says which trained policies (`main`, ...) the league runs."""

    def __init__(self, config: LeagueConfig, run_dir: str | Path) -> None:
        self.config = config
        self.dir = Path(run_dir) / "league"
        self.members: dict[str, Member] = {}
        self.roles: dict[str, RoleState] = {}
        self.payoff = Payoff(config.decay, config.min_games)
        self.ratings = Ratings()
        self.rng = np.random.default_rng(config.seed)
        self.pending: dict[str, dict[str, Any]] = {}
        self.done: deque[str] = deque(maxlen=DONE_MEMORY)
        self.counts: dict[str, dict[str, int]] = {}
        self.reported = {"matches": 0, "results": 0, "ignored": 0}
        self._nash_cache: tuple[int, dict[str, float]] | None = None
        self.exploits = ExploitLedger()  # exploiters' games against main's versions (health)
        self.best = BestVersion()
        self.entries: list[dict[str, Any]] = []  # each snapshot's rating when it entered the pool
        self.entries_logged = 0  # entries already in a health record
        self.events: list[dict[str, Any]] = []  # league events: rollback decisions
        self.rollback: RollbackDecision | None = None  # decided, not yet carried out by the learner
        self.pinned: list[str] = []  # main's snapshots pinned into the evaluator's frozen pool (`eval_pins`)
        self.crossplayed: list[str] = []  # tags of the crossplay rounds already in the payoff (a retry is not)
        self.refused: dict[str, str] = {}  # versions a replica refused by their canary -> why
        self.registered: dict[str, list[str]] = {}  # per role, its registered versions (oldest first)
        self.proven: list[str] = []  # versions whose canary a replica passed, in the order proved: the fallbacks
        self.first: dict[str, str] = {}  # per role, its first registered version: the fallback without a proof
        state = load_state(self.dir)
        if state is not None:
            self._restore(state)
        self._configure()
        self._save()

    # ------------------------------------------------------------------------------------ public API
    def register_version(self, policy: str, version: str, learner_step: int) -> VersionDecision:
        """A learner published `version` at `learner_step`: maybe snapshot it, maybe ask for a reset.

        On `reset` the driver calls that policy's `Learner.reset()` and registers the version it
        publishes. Registering the current version again returns the same decision (a retried call, or a
        resumed run whose learner checkpointed exactly what the league knows), whatever step.

        Versions only move forward: a learner restored from an older checkpoint publishes its weights
        again under a new number (see `Learner`), so an older version here is a bug, not a resume. The
        versions the lost steps published stay what they were: snapshots among them remain frozen
        members of the pool.
        """
        role = self._role(policy)
        parsed = PolicyRef.parse_adapter(version)
        owner, number = parsed.policy, parsed.version
        if owner != policy:
            raise UnknownPolicyRef(f"version {version!r} does not belong to policy {policy!r}")
        if isinstance(learner_step, bool) or not isinstance(learner_step, int) or learner_step < 0:
            raise ValueError(f"learner_step must be a non-negative int, got {learner_step!r}")
        if role.current == version and role.decision is not None:
            return role.decision
        if role.current is not None and number <= PolicyRef.parse_adapter(role.current).version:
            raise ValueError(
                f"{policy}: version {version!r} is not newer than the current {role.current!r} (a learner "
                "restored from an older checkpoint must publish its weights under a new number)"
            )
        role.current = version
        self.first.setdefault(policy, version)
        history = self.registered.setdefault(policy, [])
        history.append(version)
        del history[:-VERSION_MEMORY]
        if role.baseline_step is None or role.awaiting_reset or learner_step < role.baseline_step:
            role.baseline_step = learner_step  # first version, a fresh adapter, or a restarted step counter
            role.awaiting_reset = False
        steps = learner_step - role.baseline_step
        win_rate = self._role_win_rate(policy)
        snapshot = reset = False
        member = None
        if should_snapshot(steps, win_rate, self.config.snapshot_steps, self.config.snapshot_win_rate):
            snapshot = True
            member = self._snapshot(policy, version)
            role.baseline_step = learner_step
            self._record_entry(policy, member, learner_step, win_rate)
            if self.rng.random() < ROLE_TABLE[policy].reset_probability(self.config):
                reset = True
                self._reset(policy)
        role.decision = VersionDecision(snapshot, reset, member, steps, win_rate)
        self._save()
        return role.decision

    def next_match(self, policy: str) -> Match:
        """The next game for `policy`'s current version: hero power stratified, six seats by its role.

        `Match.train` lists the seats that train (`LeagueConfig.train_seats`, see `roles.trained_seats`).
        """
        role = self._role(policy)
        if role.current is None:
            raise RuntimeError(f"{policy} has no version yet: register_version({policy!r}, ...) first")
        pick = ROLE_TABLE[policy].pick(self, policy)
        hero_power = self._next_hero_power(policy)
        others = [p for p in POWERS if p != hero_power]
        members = {hero_power: policy} | dict(zip(others, pick.opponents, strict=True))
        seats = {p: self._ref_of(m) for p, m in members.items()}
        learners = [k for k in members.values() if self.members[k].kind == LEARNER]
        train = trained_seats(hero_power, members, learners, self.config.train_seats)
        match_id = f"{policy}-{role.matches}"
        role.matches += 1
        seed = int(self.rng.integers(0, 2**31 - 1))
        self.pending[match_id] = {
            "policy": policy,
            "kind": pick.kind,
            "members": members,
            "seats": seats,
            "hero": hero_power,
        }
        while len(self.pending) > self.config.max_pending:  # oldest first; a late report maps seats by PolicyRef
            del self.pending[next(iter(self.pending))]
        counts = self.counts.setdefault(policy, {k: 0 for k in KINDS})
        counts[pick.kind] = counts.get(pick.kind, 0) + 1
        self._save()
        return Match(match_id=match_id, seats=parse_seats(seats), hero=hero_power, seed=seed, train=train)

    def report(self, results: Sequence[MatchResult]) -> None:
        """The `MatchResult`s of played matches: all G forks of a match in one call, each weighing 1/G.

        G is each result's `forks`; a match reported with another number of forks is an error (a
        worker's `play` returns them together). A match reported twice (a retried call) is ignored the
        second time.
        """
        by_match: dict[str, list[MatchResult]] = {}
        for result in results:
            if not isinstance(result, MatchResult):
                raise TypeError(
                    f"report takes diprl.messages.MatchResult objects, got {type(result).__name__}: {result!r:.200}"
                )
            by_match.setdefault(result.match_id, []).append(result)
        plans = [(mid, self._match_plan(mid, forks)) for mid, forks in by_match.items()]  # validate everything first
        for match_id, plan in plans:
            if plan is None:
                self.reported["ignored"] += 1
                continue
            hero_member, forks = plan
            weights = [f["weight"] for f in forks]
            outcomes = match_outcomes([(f["centres"], f["hero"], f["members"]) for f in forks], hero_member, weights)
            for member, outcome in outcomes.items():
                self.payoff.update(hero_member, member, outcome)
            self._record_exploits(hero_member, forks, by_match[match_id][0].seats, outcomes)
            self.ratings.rate([(f["members"], f["ranks"]) for f in forks])
            self.pending.pop(match_id, None)
            self.done.append(match_id)
            self.reported["matches"] += 1
            self.reported["results"] += len(forks)
        self._save()

    def pending_reset(self, policy: str) -> bool:
        """True when the league asked `policy`'s learner for a reset and no reset version has arrived.

        A driver stopped between the answer and `Learner.reset()` finds this on resume and resets then,
        so the learner's weights agree with the statistics the league already forgot.
        """
        return self._role(policy).awaiting_reset

    def current(self, policy: str) -> str:
        """The current version of a trained policy (`<policy>@v<N>`)."""
        current = self._role(policy).current
        if current is None:
            raise RuntimeError(f"{policy} has no version yet: register_version({policy!r}, ...) first")
        return current

    def refs_in_use(self) -> list[str]:
        """Every PolicyRef the league may still hand out or be told about, sorted.

        The current version of every role and the version that would stand in for it (its newest proven
        one), every pool member's ref, the seats of matches handed out and not yet reported, and main's
        best version (what a rollback restores). What the adapter store must keep when it deletes old
        versions.
        """
        refs = {r.current for r in self.roles.values() if r.current is not None}
        for policy, role in self.roles.items():
            if role.current is not None:  # what plays now, and what would if a replica refused the current one
                refused = {**self.refused, role.current: ""}
                refs |= {self.serving(policy), stand_in(role.current, refused, *self._fallbacks(policy))}
        refs |= {m.ref for m in self.members.values() if m.kind != LEARNER}
        for match in self.pending.values():
            refs |= {str(ref) for ref in match["seats"].values()}
        if self.best.best is not None:  # a rollback restores it: its weights must outlive pruning
            refs.add(self.best.best.version)
        return sorted(refs)

    # ---------------------------------------------------------------------------------- canaries
    def refuse_version(self, version: str, reason: str = "") -> dict[str, Any]:
        """A replica refused `version` by its canary: never hand it out again (see the module doc).

        Returns {"version", "policy", "serving": what the role plays now, "new": False when it was already
        refused (a retried call, or many matches reporting the same refusal)}."""
        policy = PolicyRef.parse_adapter(version).policy
        new = version not in self.refused
        if new:
            self.refused[version] = str(reason)[:500]
            log.error("%s refused by a replica's canary; %s plays %s", version, policy, self._served(policy))
            self._save()
        return {"version": version, "policy": policy, "serving": self._served(policy), "new": new}

    def prove_version(self, version: str) -> dict[str, Any]:
        """A replica loaded `version` and its canary passed: it may stand in for a later version a replica
        refuses (see the module doc). Returns {"version", "new": False when already proved or refused}."""
        PolicyRef.parse_adapter(version)  # a malformed version is an error here too
        new = version not in self.proven and version not in self.refused
        if new:
            self.proven.append(version)
            self._save()
        return {"version": version, "new": new}

    def serving(self, policy: str) -> str:
        """The version of `policy` that matches and evaluations use: its current one unless a replica refused
        it, else the version that stands in for it (`verified`)."""
        self.current(policy)  # a role with no version yet is an error here too
        return self._served(policy)

    def verified(self, version: str) -> str:
        """`version` itself, or the version that stands in for it when a replica refused it: the newest
        version of its policy, not newer than it, whose canary a replica passed and none refused, else the
        policy's first version (what an evaluation plays; see `stand_in`)."""
        return stand_in(version, self.refused, *self._fallbacks(PolicyRef.parse_adapter(version).policy))

    def _fallbacks(self, policy: str) -> tuple[list[str], str | None]:
        """(`policy`'s proven versions, its first version): what `stand_in` may choose from."""
        return [v for v in self.proven if PolicyRef.parse_adapter(v).policy == policy], self.first.get(policy)

    def _served(self, policy: str) -> str:
        current = self.roles[policy].current
        if current is None or current not in self.refused:
            return str(current)
        return self.verified(current)

    def pid_of(self) -> int:
        """This actor's process id (the driver's watchdog notices a restart by its change)."""
        return os.getpid()

    def rating(self, ref: str) -> float | None:
        """openskill ordinal (mu - 3 sigma) of the pool member that plays `ref`, or None if none does.

        Cheap on purpose (no payoff matrix, no Nash solve): the training driver asks it every few
        learner steps for the progress line.
        """
        for key, member in self.members.items():
            if member.kind == LEARNER and self.roles[key].current is None:
                continue
            if self._ref_of(key) == ref or (member.kind == LEARNER and self.roles[key].current == ref):
                return float(self.ratings.get(key).ordinal)
        return None

    def summary(self) -> dict[str, Any]:
        """What `league_summary.json` holds (the web app's league page too): pool, payoff, ratings, Nash, counts.

        {"roles": [...], "current": {policy: ref}, "pool": [{"member", "kind", "role", "ref", "rating",
        "mu", "sigma", "nash", "games"}], "payoff": {"members": [...], "win_rate": [[...]], "games": [[...]]},
        "ratings": {member: {"mu", "sigma", "ordinal"}}, "nash": {member: weight},
        "matches": {policy: {kind: count}}, "reported": {"matches", "results", "ignored"},
        "snapshots": {policy: n}, "resets": {policy: n}, "pending": n, "health": {...}}

        The top-level "nash" (and each pool entry's) reads 0 for members left out of the solve; "health"
        says which were left out (`_health_summary`).
        """
        keys = list(self.members)
        nash = self._nash_weights(force=True)
        ratings = {k: self.ratings.get(k) for k in keys}
        games = {k: sum(self.payoff.games(k, o) for o in keys if o != k) for k in keys}
        pool = []
        for key in keys:
            member = self.members[key]
            rating = ratings[key]
            ref = self._ref_of(key) if member.kind != LEARNER or self.roles[key].current else None
            pool.append(
                {"member": key, "kind": member.kind, "role": member.role, "ref": ref}
                | {"rating": rating.ordinal, "mu": rating.mu, "sigma": rating.sigma}
                | {"nash": nash.get(key, 0.0), "games": games[key]}
            )
        return {
            "roles": list(self.config.roles),
            "current": {p: r.current for p, r in self.roles.items()},
            "pool": pool,
            "payoff": {
                "members": keys,
                "win_rate": self.payoff.matrix(keys),
                "games": [[self.payoff.games(a, b) for b in keys] for a in keys],
            },
            "ratings": {k: {"mu": r.mu, "sigma": r.sigma, "ordinal": r.ordinal} for k, r in ratings.items()},
            "nash": nash,
            "matches": {p: dict(c) for p, c in self.counts.items()},
            "reported": dict(self.reported),
            "snapshots": {p: r.snapshots for p, r in self.roles.items()},
            "resets": {p: r.resets for p, r in self.roles.items()},
            "pending": len(self.pending),
            "health": self._health_summary(keys),
            "serving": {p: self._served(p) for p, r in self.roles.items() if r.current is not None},
            "canary_refused": dict(self.refused),
        }

    def _health_summary(self, keys: Sequence[str]) -> dict[str, Any]:
        """The summary's `health`: Nash with who was left out, exploitability, entries, best version, events."""
        h = self.config.health
        min_games = max(h.nash_min_games, self.payoff.min_games)
        nash = nash_over_measured(keys, self.payoff.win_rate, self.payoff.games, min_games, main=MAIN)
        return {
            "nash": nash.to_dict(),
            "exploitability": self.exploits.lower_bounds(h.z, self._exploit_group()),
            "exploiters": list(self.exploits.closed),
            "entries": list(self.entries),
            "best": self.best.to_dict()["best"],
            "events": list(self.events),
            "rollback_pending": None if self.rollback is None else self.rollback.to_dict(),
            "eval_pinned": self.eval_pins(),
        }

    # ------------------------------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        """One `league` record of the league's health for metrics.jsonl: flat numbers, and the details behind them.

        Nash over measured members (`league/nash*`; members left out are listed, not weighed 0), every
        member's rating (`league/rating/<member>`, mu - 3 sigma), relative population performance
        (`league/rpp`: learners and the last `rpp_snapshots` snapshots against the pool before them),
        exploitability lower bounds of main's versions (`league/exploitability*`), the snapshots that
        entered since the last record with their rating, the best version and a pending rollback.
        See `diprl.league.health` for each figure's derivation.
        """
        h = self.config.health
        keys = [k for k in self.members if self.members[k].kind != LEARNER or self.roles[k].current is not None]
        min_games = max(h.nash_min_games, self.payoff.min_games)
        nash = nash_over_measured(keys, self.payoff.win_rate, self.payoff.games, min_games, main=MAIN)
        out: dict[str, Any] = {
            "league/nash_entropy": nash.entropy,
            "league/nash_support": nash.support,
            "league/nash_members": len(nash.weights),
            "league/nash_left_out_count": len(nash.left_out),
            "league/nash": nash.weights,
            "league/nash_left_out": list(nash.left_out),
        }
        if nash.main_weight is not None:
            out["league/nash_main"] = nash.main_weight
        out |= {f"league/rating/{k}": float(self.ratings.get(k).ordinal) for k in keys}
        snaps = self.snapshots()
        cut = max(0, len(snaps) - h.rpp_snapshots)
        learners = [p for p, r in self.roles.items() if r.current is not None]
        rpp = relative_population_performance(
            learners + snaps[cut:], self.anchors() + snaps[:cut], self.payoff.win_rate, self.payoff.games, min_games
        )
        if rpp is not None:
            out["league/rpp"] = rpp.value
            out["league/rpp_populations"] = rpp.to_dict()
        bounds = self.exploits.lower_bounds(h.z, self._exploit_group())
        if bounds:
            latest = max(bounds, key=_version_order)
            out["league/exploitability_lb"] = bounds[latest]["lower_bound"]
            out["league/exploitability_target"] = latest
            out["league/exploitability_lb_max"] = max(b["lower_bound"] for b in bounds.values())
            out["league/exploitability"] = bounds
        out["league/exploiters_beat_main"] = sum(1 for c in self.exploits.closed if c["beaten"])
        out["league/exploiters_timed_out"] = sum(1 for c in self.exploits.closed if not c["beaten"])
        if self.entries_logged < len(self.entries):
            out["league/snapshot_entries"] = self.entries[self.entries_logged :]
            self.entries_logged = len(self.entries)
            self._save()
        if self.best.best is not None:
            out["league/best_version"] = self.best.best.version
            out["league/best_version_number"] = _version_order(self.best.best.version)[0]  # a gauge needs a number
            out["league/best_score"] = self.best.best.score
        out["league/rollbacks"] = sum(1 for e in self.events if e["event"] == "rollback")
        out["league/rollbacks_done"] = sum(1 for e in self.events if e["event"] == "rollback_done")
        if self.rollback is not None:
            out["league/rollback_pending"] = self.rollback.to_dict()
        if self.pinned:
            out["league/eval_pinned"] = self.eval_pins()
        return out

    def observe_evaluation(
        self,
        version: str,
        step: int,
        score: float,
        low: float,
        high: float,
        rates: Mapping[str, Any] | None = None,
        policy: str = MAIN,
    ) -> dict[str, Any]:
        """An evaluation of `policy`'s `version`: run the guards, track the best version among the versions no
        guard flagged, maybe decide a rollback.

        Returns {"best": version, "became_best": bool, "faults": [fault records], "rollback": decision or
        None}. Each fault is a `fault` record for the run's journal. With `league.health.rollback` on, a
        fired guard decides one rollback to the best version (a league event, persisted): the same
        version observed again (a retried call, a resumed run) returns the same decision, never a second.
        Carrying it out (restoring the best version's adapter weights) is the learner's; it then calls
        `rollback_done`.
        """
        current = Score(version, step, score, low, high)
        faults = collapse_faults(
            version, step, BehaviourRates(**(rates or {})), self.config.health.guards, current, self.best.best
        )
        # A version a guard flags never becomes the best, whatever it scored: the best is what a rollback
        # restores, and a collapsed main that scored well against bots (it can, for a while) must not be it.
        became = not faults and self.best.observe(current)
        decision = None
        if faults and self.config.health.rollback:
            earlier = [e for e in self.events if e["event"] == "rollback" and e["current"] == version]
            if earlier:
                decision = RollbackDecision.from_dict(earlier[0])
            else:
                decision = rollback_decision(policy, version, step, faults, self.best.best)
                if decision is not None:
                    self.rollback = decision
                    self.events.append({"event": "rollback"} | decision.to_dict())
        self._save()
        best = self.best.best
        return {
            "best": None if best is None else best.version,
            "became_best": became,
            "faults": [f.to_record() for f in faults],
            "rollback": None if decision is None else decision.to_dict(),
        }

    def pending_rollback(self, policy: str = MAIN) -> dict[str, Any] | None:
        """The rollback decided for `policy` and not yet done (a resumed driver carries it out then), or None."""
        r = self.rollback
        return r.to_dict() if r is not None and r.policy == policy else None

    def rollback_done(self, policy: str, restored: str) -> None:
        """The learner restored the best version's weights and published them as `restored`: clear the decision."""
        r = self.rollback
        if r is None or r.policy != policy:
            return
        self.events.append(
            {"event": "rollback_done", "policy": policy, "from": r.current, "to": r.to, "published": restored}
        )
        self.rollback = None
        self._save()

    def eval_pins(self) -> list[str]:
        """Main's snapshots for the evaluator's frozen pool, oldest first (`league.health.pin_every`, `pin_max`).

        Main's first snapshot and every `pin_every`-th after it is pinned until `pin_max` are: the pool then
        stays as it is, so later versions meet the same past selves on the same seeded games. The driver pins
        each into the evaluator (`Evaluator.pin`, idempotent) before its next evaluation. A version a replica
        refused by its canary is left out (it could not be played).
        """
        return [v for v in self.pinned if v not in self.refused]

    def crossplay_plan(self) -> dict[str, Any]:
        """The next crossplay round for the evaluator: {"pairs": [[hero, opponent], ...], "games": n, "replays":
        the first games of each pair kept as replays, "keep_rounds": how many rounds' replays are kept}.

        Pool members (anchors and snapshots; none a replica refused) whose pair has fewer games than the Nash
        needs (`league.health.nash_min_games`), fewest games first, then the newest members first; at most
        `league.health.crossplay_pairs`. The newer member is the hero. Empty when every pair is measured.
        """
        h = self.config.health
        need = max(h.nash_min_games, self.payoff.min_games, 1e-9)
        pool = [k for k in self.pool() if self.members[k].ref not in self.refused]
        pairs = [
            (self.payoff.games(a, b), -j, -i, a, b)
            for j, a in enumerate(pool)
            for i, b in enumerate(pool[:j])
            if self.payoff.games(a, b) < need
        ]
        chosen = sorted(pairs)[: h.crossplay_pairs]
        return {
            "pairs": [[self.members[a].ref, self.members[b].ref] for _, _, _, a, b in chosen],
            "games": h.crossplay_games,
            "replays": h.crossplay_replays,
            "keep_rounds": h.crossplay_replay_rounds,
        }

    def report_crossplay(self, tag: str, results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """A crossplay round's games (`Evaluator.crossplay`) into the payoff, once per `tag`.

        Each game is one hero-vs-member outcome, as a match's would be; ratings are left to the league's
        own matches. Returns {"tag", "new": whether it counted now, "games": games added}."""
        if tag in self.crossplayed:
            return {"tag": tag, "new": False, "games": 0}
        keys = {m.ref: k for k, m in self.members.items() if m.kind != LEARNER}
        games = 0
        for result in results:
            hero, opponent = keys.get(str(result["hero"])), keys.get(str(result["opponent"]))
            if hero is None or opponent is None or hero == opponent:
                continue  # no longer a pool member (a member the league forgot): nothing to record
            for outcome in result["outcomes"]:
                self.payoff.update(hero, opponent, float(outcome))
                games += 1
        self.crossplayed.append(tag)
        del self.crossplayed[:-DONE_MEMORY]
        self._nash_cache = None
        self._save()
        return {"tag": tag, "new": True, "games": games}

    # ------------------------------------------------------------- what the role table reads (LeagueView)
    def anchors(self) -> list[str]:
        return [k for k in self.config.anchors if k in self.members]

    def snapshots(self, roles: Sequence[str] | None = None) -> list[str]:
        return [k for k, m in self.members.items() if m.kind == SNAPSHOT and (roles is None or m.role in roles)]

    def pool(self) -> list[str]:
        """The frozen members: anchors and every snapshot."""
        return self.anchors() + self.snapshots()

    def win_rate(self, member: str, opponent: str) -> float:
        return self.payoff.win_rate(member, opponent)

    def nash(self) -> dict[str, float]:
        """Nash weights for matchmaking (refreshed every NASH_REFRESH reported matches)."""
        return self._nash_weights()

    # ------------------------------------------------------------------------------------ internals
    def _role(self, policy: str) -> RoleState:
        if policy not in self.roles or policy not in self.config.roles:
            known = list(self.config.roles)
            raise UnknownPolicyRef(f"{policy!r} is not a trained role of this league (roles: {known})")
        return self.roles[policy]

    def _configure(self) -> None:
        """Add what the config names and the state lacks (fresh run, or roles/anchors added on resume)."""
        for ref in self.config.anchors:
            self.members.setdefault(ref, Member(ref, ANCHOR, ANCHOR, ref))
        for policy in self.config.roles:
            self.members.setdefault(policy, Member(policy, LEARNER, policy, policy))
            self.roles.setdefault(policy, RoleState())
        self.payoff.decay = self.config.decay
        self.payoff.min_games = self.config.min_games

    def _ref_of(self, key: str) -> str:
        member = self.members[key]
        if member.kind != LEARNER:
            return self.verified(member.ref) if member.ref in self.refused else member.ref
        current = self.roles[key].current
        if current is None:
            raise RuntimeError(f"{key} has no version yet: register_version({key!r}, ...) before matching against it")
        return self._served(key)

    def _next_hero_power(self, policy: str) -> str:
        """Powers in shuffled cycles of seven: every seven matches of a role cover every power once."""
        role = self.roles[policy]
        if not role.hero_cycle:
            role.hero_cycle = [POWERS[int(i)] for i in self.rng.permutation(len(POWERS))]
        return role.hero_cycle.pop()

    def _role_win_rate(self, policy: str) -> float:
        """The snapshot rule's win rate: the lowest against the role's opponents (0.5 when it has none)."""
        opponents = ROLE_TABLE[policy].snapshot_opponents(self, policy)
        return min(self.payoff.win_rates(policy, opponents), default=0.5)

    def _snapshot(self, policy: str, version: str) -> str:
        if version not in self.members:
            self.members[version] = Member(version, SNAPSHOT, policy, version)
            self.ratings.set(version, self.ratings.get(policy))  # same weights as the learner right now
            self.roles[policy].snapshots += 1
            self._pin(policy, version, self.roles[policy].snapshots - 1)
        return version

    def _pin(self, policy: str, version: str, index: int) -> None:
        """Pin main's `index`-th snapshot (0: its first) into the frozen evaluation pool if the rule says so."""
        h = self.config.health
        if policy == MAIN and h.pin_every and index % h.pin_every == 0 and len(self.pinned) < h.pin_max:
            self.pinned.append(version)

    def _exploiter_label(self, policy: str) -> str:
        """An exploiter's generation: its name and the number of resets before it (each reset is a new adapter)."""
        return f"{policy}#{self.roles[policy].resets}"

    def _record_entry(self, policy: str, member: str, step: int, win_rate: float) -> None:
        """A snapshot entered: its rating now; for an exploiter, whether it beat main or timed out."""
        if any(e["member"] == member for e in self.entries):
            return
        r = self.ratings.get(member)
        self.entries.append(
            {"member": member, "role": policy, "step": step, "rating": r.ordinal, "mu": r.mu, "sigma": r.sigma}
        )
        if ROLE_TABLE[policy].exploiter and MAIN in self.roles:
            target = str(self.roles[MAIN].current)
            beaten = win_rate > self.config.snapshot_win_rate
            self.exploits.close(self._exploiter_label(policy), target, win_rate, beaten, step)

    def _record_exploits(
        self, hero: str, forks: Sequence[Mapping[str, Any]], seats: Mapping[str, Any], outcomes: Mapping[str, float]
    ) -> None:
        """An exploiter's outcome against a main member, under the main version its seats played."""
        if hero not in self.roles or not ROLE_TABLE[hero].exploiter:
            return
        for member, outcome in outcomes.items():
            if member not in self.members or self.members[member].role != MAIN:
                continue
            refs = {str(seats[p]) for p, m in forks[0]["members"].items() if m == member}
            if len(refs) == 1:
                self.exploits.record(self._exploiter_label(hero), refs.pop(), outcome)

    def _exploit_group(self) -> Any:
        """Main's version -> the frozen main version it is counted under (see `health`).

        Main publishes a version every step; an exploiter meets each only a few times. Games against
        the versions up to a main snapshot count for that snapshot (the learner moves little in the
        `snapshot_steps` between two), those after the last snapshot for main's current version.
        """
        snapshots = [k for k, m in self.members.items() if m.kind == SNAPSHOT and m.role == MAIN]
        frozen = sorted(PolicyRef.parse_adapter(k).version for k in snapshots)
        current = self.roles[MAIN].current if MAIN in self.roles else None

        def group(target: str) -> str:
            try:
                parsed = PolicyRef.parse_adapter(target)
            except UnknownPolicyRef:
                return target
            policy, number = parsed.policy, parsed.version
            if policy != MAIN:
                return target
            later = [k for k in frozen if k >= number]
            return f"{MAIN}@v{later[0]}" if later else current or target

        return group

    def _reset(self, policy: str) -> None:
        """A fresh adapter replaces the learner: forget its statistics and its unreported matches."""
        role = self.roles[policy]
        role.resets += 1
        role.awaiting_reset = True
        self.payoff.forget(policy)
        self.ratings.forget(policy)
        for match_id in [m for m, p in self.pending.items() if policy in p["members"].values()]:
            del self.pending[match_id]
            self.done.append(match_id)

    def _member_of(self, ref: str, hero_seat: bool) -> str:
        """The member a PolicyRef in a result stands for, for matches this manager did not hand out."""
        parsed = PolicyRef.parse(ref)
        if ref in self.members and self.members[ref].kind == ANCHOR:
            return ref
        if not parsed.is_adapter:
            raise UnknownPolicyRef(f"{ref!r} is not an anchor of this league (anchors: {self.anchors()})")
        if not hero_seat and ref in self.members:
            return ref
        if parsed.policy in self.roles:
            return parsed.policy
        if ref in self.members:
            return ref
        raise UnknownPolicyRef(f"{ref!r} is neither a trained role nor a snapshot of this league")

    def _match_plan(self, match_id: str, results: Sequence[MatchResult]) -> tuple[str, list[dict[str, Any]]] | None:
        """(hero member, validated forks with members by power and weight 1/G) of one match; None if counted."""
        if match_id in self.done:
            return None
        plan = self.pending.get(match_id)
        forks: dict[int, dict[str, Any]] = {}
        hero_member = None
        n_forks = results[0].forks
        if isinstance(n_forks, bool) or not isinstance(n_forks, int) or n_forks < 1:
            raise ValueError(f"match {match_id}: forks must be a positive int (G), got {n_forks!r}")
        for result in results:
            seats = seat_texts(result.seats)  # as `pending` keeps them (JSON) and members are named
            for name, value in (("seats", result.seats), ("centres", result.centres), ("ranks", result.ranks)):
                if sorted(value) != sorted(POWERS):
                    raise ValueError(f"match {match_id}: {name} must name the seven powers, got {sorted(value)}")
            hero = str(result.hero)
            if plan is not None:
                # In self-play every seat is the policy's member: only the recorded hero power identifies it.
                if seats != plan["seats"] or hero != plan.get("hero", hero):
                    raise ValueError(f"match {match_id}: the reported seats differ from the match handed out")
                members = dict(plan["members"])
            else:
                members = {p: self._member_of(ref, p == hero) for p, ref in seats.items()}
            if hero_member is not None and members[hero] != hero_member:
                raise ValueError(f"match {match_id}: forks disagree on the hero")
            hero_member = members[hero]
            fork = int(result.fork)
            if result.forks != n_forks:
                raise ValueError(f"match {match_id}: forks disagree on G ({result.forks} and {n_forks})")
            if not 0 <= fork < n_forks:
                raise ValueError(f"match {match_id}: fork {fork} is not one of its G={n_forks} forks")
            if fork in forks:
                raise ValueError(f"match {match_id}: fork {fork} reported twice in one call")
            forks[fork] = {
                "hero": hero,
                "members": members,
                "centres": {p: int(n) for p, n in result.centres.items()},
                "ranks": {p: int(r) for p, r in result.ranks.items()},
                "weight": 1.0 / n_forks,
            }
        if len(forks) != n_forks:
            raise ValueError(
                f"match {match_id}: {len(forks)} of its G={n_forks} forks reported; "
                "report all forks of a match in one call"
            )
        assert hero_member is not None
        return hero_member, [forks[k] for k in sorted(forks)]

    def _nash_weights(self, force: bool = False) -> dict[str, float]:
        stamp = self.reported["matches"] // NASH_REFRESH
        if force or self._nash_cache is None or self._nash_cache[0] != stamp:
            # Solved over measured pairs only; members outside the measured set get no weight.
            keys = self.payoff.measured_subset(list(self.members))
            weights: list[float] = max_entropy_nash(self.payoff.matrix(keys)).tolist() if keys else []
            nash = dict.fromkeys(self.members, 0.0) | {k: float(w) for k, w in zip(keys, weights, strict=True)}
            self._nash_cache = (stamp, nash)
        return dict(self._nash_cache[1])

    # ---------------------------------------------------------------------------------- persistence
    def state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "members": [m.to_dict() for m in self.members.values()],
            "roles": {p: r.to_dict() for p, r in self.roles.items()},
            "payoff": self.payoff.to_dict(),
            "ratings": self.ratings.to_dict(),
            "rng": self.rng.bit_generator.state,
            "pending": self.pending,
            "done": list(self.done),
            "counts": self.counts,
            "reported": self.reported,
            "health": {
                "exploits": self.exploits.to_dict(),
                "best": self.best.to_dict(),
                "entries": self.entries,
                "entries_logged": self.entries_logged,
                "events": self.events,
                "rollback": None if self.rollback is None else self.rollback.to_dict(),
                "pinned": list(self.pinned),
                "crossplayed": list(self.crossplayed),
            },
            "canary": {
                "refused": dict(self.refused),
                "registered": {p: list(v) for p, v in self.registered.items()},
                "proven": list(self.proven),
                "first": dict(self.first),
            },
        }

    def _restore(self, state: Mapping[str, Any]) -> None:
        state = upgrade_state(state, str(self.dir))
        self.members = {m["key"]: Member(m["key"], m["kind"], m["role"], m["ref"]) for m in state["members"]}
        self.roles = {p: RoleState.from_dict(r, p) for p, r in state["roles"].items()}
        self.payoff = Payoff.from_dict(state["payoff"])
        self.ratings = Ratings.from_dict(state["ratings"])
        self.rng.bit_generator.state = state["rng"]
        self.pending = dict(state["pending"])
        self.done = deque(state["done"], maxlen=DONE_MEMORY)
        self.counts = {p: dict(c) for p, c in state["counts"].items()}
        self.reported = dict(state["reported"])
        health = state.get("health") or {}  # absent in states written before the league reported its health
        self.exploits = ExploitLedger.from_dict(health.get("exploits") or {})
        self.best = BestVersion.from_dict(health.get("best") or {})
        self.entries = [dict(e) for e in health.get("entries", [])]
        self.entries_logged = int(health.get("entries_logged", 0))
        self.events = [dict(e) for e in health.get("events", [])]
        rollback = health.get("rollback")
        self.rollback = None if rollback is None else RollbackDecision.from_dict(rollback)
        self.pinned = [str(v) for v in health.get("pinned", [])]  # absent before the frozen evaluation pool
        self.crossplayed = [str(t) for t in health.get("crossplayed", [])]
        canary = state.get("canary") or {}  # absent in states written before canary refusals
        self.refused = {str(k): str(v) for k, v in dict(canary.get("refused") or {}).items()}
        self.registered = {str(p): [str(v) for v in vs] for p, vs in dict(canary.get("registered") or {}).items()}
        self.proven = [str(v) for v in canary.get("proven") or []]  # absent before fallbacks had to be proven
        oldest = {p: vs[0] for p, vs in self.registered.items() if vs}  # a state without "first": the oldest known
        self.first = oldest | {str(p): str(v) for p, v in dict(canary.get("first") or {}).items()}
        log.info("league restored from %s: %d members", self.dir, len(self.members))

    def _save(self) -> None:
        save_state(self.dir, self.state())


def stand_in(version: str, refused: Mapping[str, Any], proven: Sequence[str], first: str | None) -> str:
    """`version`, or when a replica refused it by its canary, the version that plays instead: the newest of
    `proven` (its policy's versions whose canary a replica passed) not newer than it and not refused; with
    none, its policy's `first` version if not refused; `version` itself when nothing is left.

    A version published between two canaries is never chosen: nothing proved it is served as trained."""
    if version not in refused:
        return version
    number = PolicyRef.parse_adapter(version).version
    candidates = [v for v in proven if v not in refused and PolicyRef.parse_adapter(v).version <= number]
    if candidates:
        return max(candidates, key=lambda v: PolicyRef.parse_adapter(v).version)
    return first if first is not None and first not in refused else version


def _version_order(target: str) -> tuple[int, str]:
    try:
        return PolicyRef.parse_adapter(target).version, target
    except UnknownPolicyRef:
        return -1, target


def league_actor(config: LeagueConfig, run_dir: str | Path, name: str = "league", **options: Any) -> Any:
    """The named Ray actor form: restarted after a crash with its state read back from `run_dir/league/`.

    `get_if_exists` returns the running actor when one with this name is already up (a restarted
    driver). Extra `options` (num_cpus, namespace, lifetime...) go to `.options()`.
    """
    import ray

    remote = ray.remote(max_restarts=-1, max_task_retries=-1)(LeagueManager)
    opts: dict[str, Any] = {"name": name, "get_if_exists": True, "num_cpus": 0} | options
    return remote.options(**opts).remote(config, str(run_dir))
