"""A trained role's state in the league, and the league's answer when its learner publishes a version.

Both are persisted in the league's state file (`LeagueManager.state`, schema `STATE_VERSION`). State
files written before these types existed (schema 1, each role an untyped dict whose last answer sat
under `decision.answer`) are read by `upgrade_state`; any other schema is refused with what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

STATE_VERSION = 2
"""1: roles as untyped dicts (`decision: {"step", "answer"}`); 2: `RoleState.to_dict` (a `VersionDecision`)."""


class LeagueStateError(RuntimeError):
    """A league state file this code cannot continue from (another schema, or a malformed role)."""


@dataclass(frozen=True)
class VersionDecision:
    """The league's answer to `register_version`.

    `snapshot`: the version was frozen into the pool as member `member`. `reset`: the learner must
    start over from a fresh adapter (`Learner.reset()`, then register the version it publishes).
    `steps_since_snapshot` and `win_rate` are what the snapshot rule read.
    """

    snapshot: bool
    reset: bool
    member: str | None
    steps_since_snapshot: int
    win_rate: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VersionDecision:
        return cls(
            snapshot=bool(data["snapshot"]),
            reset=bool(data["reset"]),
            member=None if data["member"] is None else str(data["member"]),
            steps_since_snapshot=int(data["steps_since_snapshot"]),
            win_rate=float(data["win_rate"]),
        )


@dataclass
class RoleState:
    """What the league keeps about one trained role between calls."""

    current: str | None = None  # the learner's current version (<policy>@v<N>); None before the first
    baseline_step: int | None = None  # the learner step the snapshot clock counts from
    awaiting_reset: bool = False  # a reset was asked for and its fresh version has not arrived
    snapshots: int = 0
    resets: int = 0
    matches: int = 0  # handed out (numbers the match ids)
    hero_cycle: list[str] = field(default_factory=list)  # powers left in the current shuffled cycle of seven
    decision: VersionDecision | None = None  # the answer for `current`, repeated to a retried call

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["decision"] = None if self.decision is None else self.decision.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], role: str = "?") -> RoleState:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, Mapping) or set(data) != names:
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise LeagueStateError(f"league state: role {role!r} must have the keys {sorted(names)}, got {got}")
        try:
            decision = data["decision"]
            return cls(
                current=None if data["current"] is None else str(data["current"]),
                baseline_step=None if data["baseline_step"] is None else int(data["baseline_step"]),
                awaiting_reset=bool(data["awaiting_reset"]),
                snapshots=int(data["snapshots"]),
                resets=int(data["resets"]),
                matches=int(data["matches"]),
                hero_cycle=[str(p) for p in data["hero_cycle"]],
                decision=None if decision is None else VersionDecision.from_dict(decision),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LeagueStateError(f"league state: role {role!r} is malformed ({exc!r})") from None


def upgrade_state(state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`state` in the current schema: schema 1 is converted, schema 2 passed through, anything else refused.

    Schema 1 kept the last answer as `{"step": learner_step, "answer": {...}}`; the step was never
    read, so the answer alone carries over.
    """
    version = state.get("version")
    if version == STATE_VERSION:
        return dict(state)
    if version == 1:
        roles = {}
        for name, role in dict(state.get("roles") or {}).items():
            role = dict(role)
            decision = role.get("decision")
            if isinstance(decision, Mapping) and "answer" in decision:
                role["decision"] = decision["answer"]
            roles[name] = role
        return dict(state) | {"version": STATE_VERSION, "roles": roles}
    raise LeagueStateError(
        f"{where}: league state schema {version!r} is not one this diprl reads (1 or {STATE_VERSION}). "
        "Resume the run with the diprl version that wrote it, or move that directory aside to start a fresh league."
    )
