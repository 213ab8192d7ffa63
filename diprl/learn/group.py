"""`LearnerGroup`: one policy's learner as `learner.ranks` data-parallel ranks behind the one actor the driver knows.

The driver talks to `learner-<policy>` exactly as to a one-rank learner (`train_next`, `state`, `reset`, `rollback`,
`prune_versions`, `save_checkpoint`, `pid_of`). With `learner.ranks` > 1 that actor is a `LearnerGroup`:
it holds no model and no process group, only the policy's intake (its queue and `pending.json`, see
`diprl.learn.intake`) and N rank actors in a Ray placement group (PACK, one bundle per rank with its
CPU or GPU and the role's placement resources). Each rank runs a `Learner` with its `RankSpec`: one
torch.distributed group (NCCL on GPUs, gloo on CPU), DeepSpeed ZeRO-2 across it. Every call is sent to
all ranks at once with the same arguments (the ranks split each batch by tokens themselves, see
`diprl.learn.ranks`); rank 0 publishes, checkpoints, writes the metrics and answers.

**A failed rank.** The group is one unit: a rank that dies (or raises) leaves the others blocked in a
collective or with a broken process group, which no process can trust again. So on the first failed
rank the group is torn down (every rank actor killed) and built again from fresh processes on a new
port; every rank restores the newest good checkpoint, like a restarted one-rank learner. A lost rank's
batch is then trained again in the same call (it is still in `pending.json`; unless the restored
checkpoint already holds its step), and the report carries a `learner_group_restarted` fault saying
which rank, why, and what was replayed. A rank that raised is not retried: its error goes to the
driver (the batch stays pending for the next call, as with a one-rank learner). If the group's own
actor dies, Ray restarts it (its rank actors die with it), and the retried `train_next` replays the
pending batch the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.inference.adapters.pins import PinKey, use_key
from diprl.learn.config import LearnerConfig
from diprl.learn.intake import GroupIntake
from diprl.learn.ranks import RankSpec
from diprl.learn.site import LearnerSite
from diprl.learn.versions import VersionBook
from diprl.messages import GroupRestart, StepReport, TrainingRecord, TrajectoryGroup
from diprl.ports import free_port
from diprl.torch_threads import set_torch_threads

logger = logging.getLogger(__name__)

RESTARTS_PER_STEP = 2  # group restarts after lost ranks within one step before its failure goes to the driver
PLACEMENT_TIMEOUT_S = 300.0  # how long the ranks' bundles may wait for room before the group gives up
GRACE_S = 10.0  # after a first failed rank, how long the others get to report (a lost rank tells itself apart)


class GroupFailure(Exception):
    """A rank failed; the group was torn down and restarted from its newest checkpoint."""

    def __init__(self, rank: int, died: bool, error: BaseException) -> None:
        super().__init__(f"learner rank {rank} {'was lost' if died else 'failed'}: {error!r:.500}")
        self.rank = rank
        self.died = died
        self.error = error

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (RuntimeError, (str(self),))  # what reaches a caller in another process: the message


class LearnerRank:
    """One rank's process: its `Learner` is built by `start`, on every rank at once (they meet in the process group)."""

    def __init__(self, use_gpu: bool, pin_key: PinKey | None = None) -> None:
        use_key(pin_key)  # the run's adapter pin key: this rank's Learner publishes and reads versions
        if not use_gpu:
            set_torch_threads(1)  # ranks share the node's cores: one thread each, no oversubscription
        self.learner: Any = None

    def address(self) -> str:
        """Where the group meets: a free port on this (rank 0's) node."""
        import ray

        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def start(self, config: LearnerConfig, site: LearnerSite, spec: RankSpec) -> int:
        from diprl.learn.learner import Learner  # here, not at the top: the group's own actor holds no model

        self.learner = Learner(config, site, rank=spec)
        return int(self.learner.step)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.learner, method)(*args)


class LearnerGroup:
    """The ranks of one policy's learner and their intake (see the module doc). Made by `learner_actor`."""

    def __init__(
        self,
        config: LearnerConfig,
        site: LearnerSite,
        queue: str | None = None,
        resources: dict[str, float] | None = None,
        namespace: str | None = None,
    ) -> None:
        if config.ranks < 2:
            raise ValueError(f"a learner group needs learner.ranks >= 2, got {config.ranks}")
        self.config = config
        self.site = site  # handed to every rank (its pin key too), fresh ones after a restart as well
        self.resources = dict(resources or {})
        self.namespace = namespace
        self.intake = GroupIntake(
            queue,
            Path(site.run_dir) / "learner" / config.policy,
            config.groups_per_step,
            holdover=max(2 * config.groups_per_step, 16),
        )
        self.versions = VersionBook(config.policy, config.max_policy_lag)
        self.step = 0
        self.restarts = 0
        self.faults: list[GroupRestart] = []  # group restarts not yet reported with a step
        self.ranks: list[Any] = []
        self.placement = self._placement_group()
        self._start()

    # ------------------------------------------------------------------ the ranks
    def bundle(self) -> dict[str, float]:
        """One rank's share of the placement group: its CPU or GPU, and the learner role's placement resources."""
        out: dict[str, float] = {"CPU": 1.0}
        if self.config.use_gpu:
            out["GPU"] = 1.0
        for name, amount in self.resources.items():
            out[name] = out.get(name, 0.0) + float(amount)
        return out

    def _placement_group(self) -> Any:
        import ray
        from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

        n, bundle = self.config.ranks, self.bundle()
        total = ray.cluster_resources()
        short = {k: (n * v, total.get(k, 0.0)) for k, v in bundle.items() if total.get(k, 0.0) < n * v}
        if short:
            lacking = ", ".join(f"{k}: needs {need:g}, the cluster has {have:g}" for k, (need, have) in short.items())
            raise ValueError(
                f"learner.ranks={n} for {self.config.policy} needs {n} bundles of {bundle} and the cluster cannot "
                f"hold them ({lacking}): lower learner.ranks or add nodes"
            )
        name = f"learner-{self.config.policy}-ranks"
        with contextlib.suppress(ValueError):  # left by a previous life of this actor: it outlives its maker
            remove_placement_group(get_placement_group(name))
        group = placement_group([bundle] * n, strategy="PACK", name=name)
        if not group.wait(PLACEMENT_TIMEOUT_S):
            remove_placement_group(group)
            raise TimeoutError(
                f"the {n} learner ranks of {self.config.policy} ({bundle} each) found no room in "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: other actors hold the resources"
            )
        return group

    def _start(self) -> None:
        """Fresh rank processes meeting on a new port; each builds its Learner and restores the newest checkpoint."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        env = {"DS_BUILD_OPS": "0"} if cfg.use_gpu else {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
        remote: Any = ray.remote(LearnerRank)
        options: dict[str, Any] = {
            "num_cpus": 1,
            "num_gpus": 1 if cfg.use_gpu else 0,
            "max_restarts": 0,
            "runtime_env": {"env_vars": env},
        }
        if self.resources:
            options["resources"] = dict(self.resources)
        self.ranks = [
            remote.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r),
            ).remote(cfg.use_gpu, self.site.pin_key)
            for r in range(cfg.ranks)
        ]
        meet = ray.get(self.ranks[0].address.remote())
        refs = [actor.start.remote(cfg, self.site, RankSpec(r, cfg.ranks, meet)) for r, actor in enumerate(self.ranks)]
        try:
            self._gather(refs)
        except GroupFailure as failure:
            self._stop()
            raise failure.error from None
        self._sync()

    def _stop(self) -> None:
        import ray

        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        self.ranks = []

    def _sync(self) -> None:
        """Step and versions from rank 0 (what the intake judges staleness by)."""
        import ray

        state = ray.get(self.ranks[0].call.remote("state"))
        self.step = int(state["step"])
        self.versions.restore({"version": state["version"], "min_version": state["min_version"]})

    def _gather(self, refs: Sequence[Any]) -> list[Any]:
        """Every rank's answer, or `GroupFailure` naming the first rank that failed (a lost one first)."""
        import ray
        from ray.exceptions import RayActorError

        index = {ref: r for r, ref in enumerate(refs)}
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as first:
                failed = [(index[done[0]], first)]
                grace = 0.0 if isinstance(first, RayActorError) or not waiting else GRACE_S
                late, _ = ray.wait(waiting, num_returns=len(waiting), timeout=grace) if waiting else ([], [])
                for ref in late:
                    try:
                        ray.get(ref)
                    except Exception as err:
                        failed.append((index[ref], err))
                lost = [(r, e) for r, e in failed if isinstance(e, RayActorError)]
                rank, error = (lost or failed)[0]
                raise GroupFailure(rank, bool(lost), error) from None
        return list(ray.get(list(refs)))

    def _run(self, method: str, *args: Any) -> Any:
        """`method` on every rank at once; rank 0's answer. A failed rank restarts the group, then raises."""
        try:
            return self._gather([actor.call.remote(method, *args) for actor in self.ranks])[0]
        except GroupFailure as failure:
            self._restart(failure)
            raise

    def _restart(self, failure: GroupFailure) -> None:
        before = self.step
        logger.error("%s: %s; restarting the group from its newest checkpoint", self.config.policy, failure)
        self._stop()
        self._start()
        self.restarts += 1
        self.faults.append(
            GroupRestart(
                rank=failure.rank,
                cause="rank_lost" if failure.died else "rank_error",
                error=repr(failure.error)[:500],
                step_before=before,
                restored_step=self.step,
                time=time.time(),
            )
        )

    def _train(self, method: str, args: tuple[Any, ...], for_step: int) -> StepReport | None:
        """One step on every rank; after a lost rank, again on the restored group (None: its checkpoint holds it)."""
        for attempt in range(RESTARTS_PER_STEP + 1):
            try:
                report: StepReport = self._run(method, *args)
            except GroupFailure as failure:
                if not failure.died or attempt == RESTARTS_PER_STEP:
                    raise RuntimeError(f"{self.config.policy} learner group: {failure}") from failure.error
                if self.step >= for_step:
                    return None
                self.faults[-1] = replace(self.faults[-1], replayed_step=for_step)
                continue
            return self._reported(report)
        raise AssertionError("unreachable")

    def _reported(self, report: StepReport) -> StepReport:
        self.step = report.step
        if report.version is not None:
            self.versions.latest = str(report.version)
        report.faults = [*self.faults, *report.faults]
        self.faults = []
        return report

    # ------------------------------------------------------------------ the learner's API
    def train_next(self, timeout_s: float = 1.0) -> StepReport | None:
        """`Learner.train_next` for the group: the batch in flight stays in `pending.json` until the step is done."""
        batch = self.intake.pending(self.step)
        if batch is None:
            batch = self.intake.take(self.versions.trainable, timeout_s)
            if batch is None:
                return None
        self.intake.hold(batch, self.step + 1)
        report = self._train("train_step", (batch,), self.step + 1)  # None: the restored checkpoint holds it
        self.intake.release()
        return report

    def train_step(self, groups: Sequence[TrajectoryGroup]) -> StepReport | None:
        return self._train("train_step", (list(groups),), self.step + 1)

    def train_records(self, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport | None:
        return self._train("train_records", (list(records), objective), self.step + 1)

    def reset(self) -> str:
        name = str(self._run("reset"))
        self._sync()
        return name

    def rollback(self, to_version: str, decision: str | None = None) -> str:
        name = str(self._run("rollback", to_version, decision))
        self._sync()
        return name

    def publish(self) -> str:
        name = str(self._run("publish"))
        self.versions.latest = name
        return name

    def save_checkpoint(self) -> Path:
        return Path(self._run("save_checkpoint"))

    def prune_versions(self, keep: Iterable[str] = ()) -> list[str]:
        """Rank 0 alone: the store is its to change (the other ranks read old weights only while trainable)."""
        import ray

        return list(ray.get(self.ranks[0].call.remote("prune_versions", list(keep))))

    def score(self, records: Sequence[TrainingRecord]) -> list[list[float]]:
        import ray

        return list(ray.get(self.ranks[0].call.remote("score", list(records))))

    def latest_version(self) -> str:
        assert self.versions.latest is not None
        return self.versions.latest

    def pid_of(self) -> int:
        return os.getpid()

    def state(self) -> dict[str, Any]:
        import ray

        state: dict[str, Any] = ray.get(self.ranks[0].call.remote("state"))
        return {**state, "ranks": self.config.ranks, "group_restarts": self.restarts}


def group_actor(
    config: LearnerConfig,
    site: LearnerSite,
    name: str,
    namespace: str | None,
    queue: str | None,
    resources: dict[str, float] | None,
) -> Any:
    """The group's own actor: no CPU of its own (its ranks hold them), restarted forever, tasks retried."""
    import ray

    options: dict[str, Any] = {
        "name": name,
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 0,
    }
    if namespace is not None:
        options["namespace"] = namespace
    remote_cls: Any = ray.remote(LearnerGroup)
    return remote_cls.options(**options).remote(replace(config), site, queue, resources, namespace)
