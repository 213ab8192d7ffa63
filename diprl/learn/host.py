"""`LearnerHost`: several trained policies in one process, one LoRA adapter each on one frozen base.

A league trains several policies (`main`, its exploiters) on the same base model. With one learner per
policy every learner loads the base; a host loads it once (`diprl.learn.model.load_base`) and gives each
policy's adapter a module tree over the same weight tensors (`sharing_copy`). Everything else stays the
policy's own: each is a whole `Learner` with its LoRA weights, DeepSpeed engine and optimiser state, KL
reference, version counter and staleness window, quarantine, queue, pending batch and checkpoints, and it
publishes `<policy>@v<N>` as before. A reset (a league exploiter's) or a rollback (main's, to its best version)
rebuilds that adapter alone.

Each step is one policy's, on its own policy's batch, exactly the step a learner of its own would take
(`python -m diprl.bench learner` compares them weight for weight), counted once its checkpoint is durable;
a host killed mid-step resumes each adapter at its own last durable step. How the steps share the process:

- serial (the default, and always on a GPU: one device, and the plan counts one step's activations): one
  call at a time, adapter by adapter. While one policy waits for its batch it gives way as soon as another
  has a whole batch ready, so the process never idles on one empty queue while another is full.
- `parallel` (a CPU host with `learner.host_parallel`; `diprl.learn.actor.learner_host_actor`): the policies
  step at once, each call in a thread of the actor's own and each one torch thread, so a host of N policies
  uses the N cores that N learners would hold. The base's weights are frozen and only read; all that a step
  writes is its policy's. A lock per policy keeps one call of a policy at a time (a `prune_versions` sent
  while its step runs waits for it); the driver sends a policy's next step only after a reset or rollback it
  asked for has run (`diprl.run.learning`), the one order between calls of a policy that matters.

The host serves a learner's calls with the policy first (`train_next(policy, timeout_s)`);
`diprl.learn.actor.HostedLearner` is the per-policy handle that makes it look like a learner to the driver.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from diprl.inference.adapters.pins import use_key
from diprl.learn.config import LearnerConfig, shared_base_refusal
from diprl.learn.learner import Learner
from diprl.learn.model import load_base
from diprl.learn.site import LearnerSite
from diprl.messages import StepReport, TrainingRecord, TrajectoryGroup
from diprl.policy.models import load_preset
from diprl.torch_threads import set_torch_threads

# What must be the same for every policy of a host: the base and how it is held.
SHARED_FIELDS = (
    "model",
    "bf16",
    "use_gpu",
    "zero_stage",
    "ranks",
    "prefix_sharing",
    "gradient_checkpointing",
    "host_parallel",
)


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
        self,
        configs: Sequence[LearnerConfig],
        site: LearnerSite,
        queues: dict[str, str] | None = None,
    ) -> None:
        use_key(site.pin_key)  # the run's pin key, for every learner of this process (`Learner`)
        check_shareable(configs)
        self.parallel = configs[0].host_parallel  # the same for every policy (`check_shareable`), CPU only
        queues = queues or {}
        if self.parallel:  # a torch thread a step (process-wide: the threads the actor starts use it too)
            set_torch_threads(1)
        self.base = load_base(load_preset(configs[0].model), configs[0])
        self.learners = {c.policy: Learner(c, site, queues.get(c.policy), base=self.base) for c in configs}
        self.locks = {policy: threading.Lock() for policy in self.learners}

    def learner(self, policy: str) -> Learner:
        try:
            return self.learners[policy]
        except KeyError:
            raise HostError(f"this learner host trains {sorted(self.learners)}, not {policy!r}") from None

    @contextlib.contextmanager
    def _calling(self, policy: str) -> Iterator[Learner]:
        """`policy`'s learner, held by this call alone (see the module doc)."""
        learner = self.learner(policy)
        with self.locks[policy]:
            yield learner

    def policies(self) -> list[str]:
        return list(self.learners)

    # ------------------------------------------------------------------ a learner's calls, policy first
    def train_next(self, policy: str, timeout_s: float = 1.0) -> StepReport | None:
        """`Learner.train_next` of `policy`; on a serial host it gives way as soon as another policy has a
        whole batch ready."""
        others = [learner for name, learner in self.learners.items() if name != policy]
        give_way = None if self.parallel else (lambda: any(o.ready() for o in others))
        with self._calling(policy) as learner:
            return learner.train_next(timeout_s, give_way=give_way)

    def train_step(self, policy: str, groups: Sequence[TrajectoryGroup]) -> StepReport:
        with self._calling(policy) as learner:
            return learner.train_step(groups)

    def train_records(self, policy: str, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport:
        with self._calling(policy) as learner:
            return learner.train_records(records, objective)

    def score(self, policy: str, records: Sequence[TrainingRecord]) -> list[list[float]]:
        with self._calling(policy) as learner:
            return learner.score(records)

    def publish(self, policy: str) -> str:
        with self._calling(policy) as learner:
            return learner.publish()

    def save_checkpoint(self, policy: str) -> Path:
        with self._calling(policy) as learner:
            return learner.save_checkpoint()

    def reset(self, policy: str) -> str:
        with self._calling(policy) as learner:
            return learner.reset()

    def rollback(self, policy: str, to_version: str, decision: str | None = None) -> str:
        """`policy`'s adapter alone back to `to_version`'s weights (`Learner.rollback`); the others are untouched."""
        with self._calling(policy) as learner:
            return learner.rollback(to_version, decision)

    def prune_versions(self, policy: str, keep: Iterable[str] = ()) -> list[str]:
        with self._calling(policy) as learner:
            return learner.prune_versions(keep)

    def latest_version(self, policy: str) -> str:
        with self._calling(policy) as learner:
            return learner.latest_version()

    def state(self, policy: str) -> dict[str, Any]:
        with self._calling(policy) as learner:
            return {**learner.state(), "host": self.policies(), "parallel": self.parallel}

    def pid_of(self, policy: str | None = None) -> int:
        if policy is not None:
            self.learner(policy)
        return os.getpid()
