"""Who is in the league: anchors, the learning members, and their frozen snapshots.

A member is keyed by a string. Anchors and snapshots are keyed by the PolicyRef that plays them
(`bot:dumbbot`, `base`, `main@v12`); a learning member by its policy name (`main`): its current
version changes every publish, but its payoff and rating follow the learner across versions (with
decay) until it is snapshotted (a new frozen member) or reset (its statistics are forgotten).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diprl.messages import PolicyRef, UnknownPolicyRef

POWERS: tuple[str, ...] = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")
"""The seven powers of the standard map, sorted (what `DiplomacyGame().powers` returns)."""

ANCHOR = "anchor"
LEARNER = "learner"
SNAPSHOT = "snapshot"


def validate_anchor(ref: str) -> str:
    """An anchor is a rule bot (`bot:<name>` of a registered bot), `base`, or a frozen adapter version
    `<policy>@v<N>` (another run's policy brought into this run's store, `train.frozen_adapters`: what an
    exploiter trained against a fixed main plays); anything else is an error."""
    parsed = PolicyRef.parse(ref)
    if parsed.is_bot:
        from diprl.bots import BOT_NAMES

        if parsed.name not in BOT_NAMES:
            raise UnknownPolicyRef(f"unknown bot {ref!r} as a league anchor; known bots: {', '.join(BOT_NAMES)}")
    elif not (parsed.is_base or parsed.is_adapter):
        raise UnknownPolicyRef(f"a league anchor must be 'base', 'bot:<name>' or '<policy>@v<N>', got {ref!r}")
    return ref


@dataclass(frozen=True)
class Member:
    key: str
    kind: str  # anchor | learner | snapshot
    role: str  # "anchor" for anchors; the trained role (= policy name) that produced it otherwise
    ref: str  # the PolicyRef that plays it (a learner's is its current version, set by the manager)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "role": self.role, "ref": self.ref}
