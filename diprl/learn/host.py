"""`LearnerHost`: several trained policies in one process, one LoRA adapter each on one frozen base.

A league trains several policies (`main`, its exploiters) on the same base model. With one learner per
policy every learner loads the base; a host loads it once (`diprl.learn.model.load_base`) and gives each
policy's adapter a module tree over the same weight tensors (`sharing_copy`). Everything else stays the
policy's own: each is a whole `Learner` with its LoRA weights, DeepSpeed engine and optimiser state, KL
reference, version counter and staleness window, quarantine, queue, pending batch and checkpoints, and it
publishes `<policy>@v<N>` as before. A reset (a league exploiter's) or a rollback (main's, to its best version)
rebuilds that adapter alone.

Steps run adapter by adapter, each on its own policy's batch, exactly the step a learner of its own would
take (`python -m diprl.bench learner` compares them weight for weight): one step is one policy's, counted
once its checkpoint is durable, and a host killed mid-step resumes each adapter at its own last durable
step. While one policy waits for its batch it gives way as soon as another has a whole batch ready, so
the process never idles on one empty queue while another is full.

The host serves a learner's calls with the policy first (`train_next(policy, timeout_s)`);
`diprl.learn.actor.HostedLearner` is the per-policy handle that makes it look like a learner to the driver.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from diprl.inference.adapters.pins import use_key
from diprl.learn.config import LearnerConfig, shared_base_refusal
from diprl.learn.learner import Learner
from diprl.learn.model import load_base
from diprl.learn.site import LearnerSite
from diprl.messages import StepReport, TrainingRecord, TrajectoryGroup
from diprl.policy.models import load_preset

# What must be the same for every policy of a host: the base and how it is held.
SHARED_FIELDS = ("model", "bf16", "use_gpu", "zero_stage", "ranks", "prefix_sharing", "gradient_checkpointing")


class HostError(ValueError):
    """The policies given to a host cannot share one base (or a call names a policy it does not hold)."""


def check_shareable(configs: Sequence[LearnerConfig]) -> None:
    """Raise `HostError` unless `configs` are distinct policies that can share one base model."""
    if not configs:
        raise HostError("a learner host needs at least one policy")
    policies = [c.policy for c in configs]
    if len(set(policies)) != len(policies):
        raise HostError(f"a learner host holds each policy once, got {policies}")
    first = configs[0]
    for config in configs[1:]:
        differ = [f for f in SHARED_FIELDS if getattr(config, f) != getattr(first, f)]
        if differ:
            raise HostError(
                f"policies {first.policy!r} and {config.policy!r} differ in {differ}: one base cannot serve both "
                "(give them learner hosts of their own: learner.adapters_per_actor=1)"
            )
    unshareable = shared_base_refusal(first)
    if unshareable is not None:
        raise HostError(
            f"a learner host {unshareable}: use learner.adapters_per_actor=1 for grouped or ZeRO-3 learners"
        )


class LearnerHost:
    """One `Learner` per policy of `configs`, all on one base model loaded once. Plain class;
    `diprl.learn.actor.learner_host_actor` makes it a Ray actor."""

    def __init__(
        self, configs: Sequence[LearnerConfig], site: LearnerSite, queues: dict[str, str] | None = None
    ) -> None:
        use_key(site.pin_key)  # the run's pin key, for every learner of this process (`Learner`)
        check_shareable(configs)
        queues = queues or {}
        self.base = load_base(load_preset(configs[0].model), configs[0])
        self.learners = {c.policy: Learner(c, site, queues.get(c.policy), base=self.base) for c in configs}

    def learner(self, policy: str) -> Learner:
        try:
            return self.learners[policy]
        except KeyError:
            raise HostError(f"this learner host trains {sorted(self.learners)}, not {policy!r}") from None

    def policies(self) -> list[str]:
        return list(self.learners)

    # ------------------------------------------------------------------ a learner's calls, policy first
    def train_next(self, policy: str, timeout_s: float = 1.0) -> StepReport | None:
        """`Learner.train_next` of `policy`, giving way as soon as another policy has a whole batch ready."""
        others = [learner for name, learner in self.learners.items() if name != policy]
        return self.learner(policy).train_next(timeout_s, give_way=lambda: any(o.ready() for o in others))

    def train_step(self, policy: str, groups: Sequence[TrajectoryGroup]) -> StepReport:
        return self.learner(policy).train_step(groups)

    def train_records(self, policy: str, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport:
        return self.learner(policy).train_records(records, objective)

    def score(self, policy: str, records: Sequence[TrainingRecord]) -> list[list[float]]:
        return self.learner(policy).score(records)

    def publish(self, policy: str) -> str:
        return self.learner(policy).publish()

    def save_checkpoint(self, policy: str) -> Path:
        return self.learner(policy).save_checkpoint()

    def reset(self, policy: str) -> str:
        return self.learner(policy).reset()

    def rollback(self, policy: str, to_version: str, decision: str | None = None) -> str:
        """`policy`'s adapter alone back to `to_version`'s weights (`Learner.rollback`); the others are untouched."""
        return self.learner(policy).rollback(to_version, decision)

    def prune_versions(self, policy: str, keep: Iterable[str] = ()) -> list[str]:
        return self.learner(policy).prune_versions(keep)

    def latest_version(self, policy: str) -> str:
        return self.learner(policy).latest_version()

    def state(self, policy: str) -> dict[str, Any]:
        return {**self.learner(policy).state(), "host": self.policies()}

    def pid_of(self, policy: str | None = None) -> int:
        if policy is not None:
            self.learner(policy)
        return os.getpid()
