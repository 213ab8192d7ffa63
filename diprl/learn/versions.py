"""The version bookkeeping of one learner: which versions exist, which are still trainable, and the
weights of the recent ones.

A group sampled by `<policy>@v<N>` is trained on only while N is at most `max_policy_lag` versions
behind the latest published version, and never when it predates an exploiter's reset (another
network). The learner recomputes a lagged record's old-policy logprobs under the weights of the
version that sampled it: the newest `max_policy_lag + 1` versions' LoRA weights are kept in memory
for that (older ones are read back from the AdapterStore on demand).

Kept apart from the learner so that what "stale" means is one small, testable object; the learner
holds the weights, swaps and checkpoints.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from diprl.messages import PolicyRef


class VersionBook:
    def __init__(self, policy: str, max_lag: int) -> None:
        self.policy = policy
        self.max_lag = max_lag
        self.latest: str | None = None  # the latest published "<policy>@v<N>"
        self.min_version = 1  # versions below this predate a reset: never trained on
        self.snapshots: OrderedDict[str, Any] = OrderedDict()  # version -> LoRA state, newest last

    def published(self, name: str, weights: Any) -> None:
        """`name` was just published with these weights: it is the latest, and kept for recompute."""
        self.latest = name
        self.keep(name, weights)
        while len(self.snapshots) > self.max_lag + 1:
            self.snapshots.popitem(last=False)

    def keep(self, name: str, weights: Any) -> None:
        self.snapshots[name] = weights

    def reset(self) -> None:
        """The latest version is a fresh network: everything before it is another network's."""
        self.snapshots = OrderedDict((k, v) for k, v in self.snapshots.items() if k == self.latest)
        self.min_version = self.number(self.latest) if self.latest else 1

    def forget(self, names: list[str]) -> None:
        for name in names:
            self.snapshots.pop(name, None)

    def number(self, name: str) -> int:
        return PolicyRef.parse(name).version

    def lag(self, ref: PolicyRef) -> int | None:
        """Versions between `ref` and the latest; None for anything not a version of this policy.

        A version from before the last reset lags by more than `max_lag` (it is stale whatever its number).
        """
        if not ref.is_adapter or ref.policy != self.policy or self.latest is None:
            return None
        if ref.version < self.min_version:
            return self.max_lag + 1 + (self.min_version - ref.version)
        return max(0, self.number(self.latest) - ref.version)

    def trainable(self, version: PolicyRef) -> bool:
        lag = self.lag(version)
        return lag is not None and lag <= self.max_lag

    def state(self) -> dict[str, Any]:
        return {"version": self.latest, "min_version": self.min_version}

    def restore(self, state: dict[str, Any]) -> None:
        self.latest = state["version"]
        self.min_version = int(state["min_version"])
        self.snapshots.clear()
