"""What outlives a learner step: the policy's versions, its checkpoints, and a resume from them.

`Lifecycle` holds one policy's durable state (step, version book, the weights version, counters, the
KL reference) and does everything that writes it down or reads it back:

- **Start.** Restore the newest checkpoint under `run_dir/checkpoints/<policy>/` that verifies (corrupt
  or partial ones are skipped with a warning), or else publish the fresh LoRA (or the `init_adapter`
  warm start) as the policy's first version and checkpoint it as step 0, so a run is resumable from
  its first moment.
- **Versions are immutable and never reused.** Steps taken after the newest checkpoint are lost with
  the process and are taken again after a restore; the versions they published stay in the
  AdapterStore (the league may hold snapshots of them). So when the store holds versions newer than
  the checkpoint's, the restored weights are published again under the next free number: the current
  version is always the newest of its policy. The superseded steps' records leave the learner's
  metrics log (moved to `metrics.superseded.jsonl` beside it), so the log holds every step once.
- **Cadence.** Publishing and checkpointing after a step happen at their cadences; a failed publish or
  checkpoint (a full disk, `ENOSPC`) is a fault in the step's metrics, not an exception: the weights
  stay in memory, the store and the checkpoint directory hold no partial version, and the write is
  retried after the next step.
- **A learner group.** Every rank calls each of these at the same point; rank 0 writes (versions,
  checkpoints, metrics) and the others learn the outcome (`Collective.rank0_writes`). ZeRO partitions
  the master weights and Adam moments, so rank 0 gathers each rank's partition into the checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch

from diprl.inference.adapters import AdapterError, AdapterStore, InvalidAdapterName, model_ref
from diprl.inference.canary import Canary
from diprl.learn.canary import version_canary
from diprl.learn.checkpoint import Checkpoint, CheckpointDir, Restored
from diprl.learn.config import LearnerConfig
from diprl.learn.model import base_model_name, lora_state, read_adapter_dir, whole_lora
from diprl.learn.passes import LoraState, TrainedModel
from diprl.learn.ranks import Collective
from diprl.learn.report import MetricsLog
from diprl.learn.state_files import read_state, state_paths, write_state
from diprl.learn.train_state import engine_state, restore_engine_state, restore_rng_state, rng_state
from diprl.learn.versions import VersionBook
from diprl.messages import ZOO_PREFIX, PolicyRef, StepFault, StepFaultKind, UnknownPolicyRef
from diprl.policy.models import ModelPreset

logger = logging.getLogger(__name__)

ROLLBACK_MEMORY = 16  # rollbacks remembered (decision -> the version that carried it out), for retried calls
ENGINE_STATE = "engine"  # trainable and master weights, optimizer moments, engine counters
LEARNER_STATE = "learner"  # step, versions, counters, EMA reference, RNG states
CHECKPOINT_FILES = tuple(p.name for name in (ENGINE_STATE, LEARNER_STATE) for p in state_paths(Path(), name))
COUNTERS = (
    "groups_trained",
    "records_trained",
    "tokens_trained",
    "dropped_stale",
    "dropped_foreign",
    "old_weights_missing",
    "resets",
    "rollbacks",
    "nonfinite_steps",
    "quarantined",
    "publish_failures",
    "checkpoint_failures",
    "versions_pruned",
)


class Lifecycle:
    """One policy's durable state and its writes: publish, checkpoint, resume, prune (see the module doc)."""

    def __init__(
        self,
        config: LearnerConfig,
        dist: Collective,
        run_dir: Path,
        store: AdapterStore,
        preset: ModelPreset,
    ) -> None:
        self.config = config
        self.dist = dist
        self.store = store
        self.preset = preset
        self.checkpoints = CheckpointDir(
            run_dir / "checkpoints" / config.policy, keep=config.keep_checkpoints, required=CHECKPOINT_FILES
        )
        self.metrics = MetricsLog(run_dir / "learner" / config.policy / "metrics.jsonl", config.policy, dist.writer)
        self.step = 0
        self.versions = VersionBook(config.policy, config.max_policy_lag)
        self.weights_version: str | None = None  # the published version the current weights equal, if any
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.ema: LoraState = {}  # the KL reference: an EMA of the LoRA weights, or the weights started from
        self.restored: Restored = self.checkpoints.newest_good()
        self.last_checkpoint: Path | None = None
        self._publish_due = False  # a publish failed (full disk, ...): retry after the next step
        self._checkpoint_due = False
        self._publishes = 0  # in this process: every `canary_every`-th carries a canary, the first included
        self.last_canary: Canary | None = None  # the last one published: the next is checked against it first
        self.canary_s = 0.0  # what the last publish spent making its canary (0: it carried none)
        self.rollbacks: dict[str, str] = {}  # rollback decision -> the version that carried it out (checkpointed)

    # ------------------------------------------------------------------ start, reset
    def start_dir(self) -> Path | None:
        """The adapter to build the model from: the warm start, or None (a checkpoint to restore, or a fresh LoRA)."""
        source = self.config.init_adapter
        if self.restored.checkpoint is not None or not source:
            return None
        if source.startswith(ZOO_PREFIX):  # a shipped policy: its adapter, or a fresh LoRA on its base
            from diprl.policy.zoo import warm_start_dir

            return warm_start_dir(source, self.config.model)
        try:
            ref = model_ref(source)
        except InvalidAdapterName:
            ref = None
        if ref is not None and ref.is_adapter:
            return self.store.resolve(str(ref)).path
        path = Path(source)
        if not path.is_dir():
            raise FileNotFoundError(
                f"init_adapter {source!r} is neither a version in {self.store.root} nor a directory"
            )
        return path

    def start(self, model: TrainedModel) -> None:
        """Resume from the newest good checkpoint, or publish the first version and checkpoint it as step 0."""
        self.ema = lora_state(model.peft)
        if self.restored.checkpoint is not None:
            self._restore(model, self.restored.checkpoint)
            self._continue_numbering(model)
            return
        self.publish(model)
        if self.config.checkpoint_every:
            self.save_checkpoint(model)

    def reset(self, model: TrainedModel) -> str:
        """`model` is a fresh LoRA: it is the reference, the next version, and checkpointed at once."""
        self.ema = lora_state(model.peft)
        name = self.publish(model)
        self.versions.reset()
        self.save_checkpoint(model)
        return name

    def source_of(self, version: str) -> Path:
        """The AdapterStore directory of a published `version` of this policy (what a rollback restores)."""
        try:
            ref = PolicyRef.parse(version)
        except UnknownPolicyRef:
            ref = None
        if ref is None or not ref.is_adapter or ref.policy != self.config.policy:
            raise ValueError(f"{self.config.policy}: cannot roll back to {version!r}, not a version of this policy")
        return self.store.resolve(version).path

    def rolled_back(self, model: TrainedModel, to_version: str, decision: str | None) -> str:
        """`model` holds `to_version`'s weights under a fresh optimiser: they are the KL reference and the next
        version; groups sampled before it are the collapsed network's (stale). Checkpointed at once, with
        `decision` remembered, so a retried or resumed rollback of the same decision is not carried out twice."""
        self.ema = lora_state(model.peft)
        name = self.publish(model)
        self.versions.reset()
        self.counters["rollbacks"] += 1
        if decision is not None:
            self.rollbacks[decision] = name
            for old in list(self.rollbacks)[:-ROLLBACK_MEMORY]:
                del self.rollbacks[old]
        self.save_checkpoint(model)
        logger.warning("%s: rolled back to %s's weights, published as %s", self.config.policy, to_version, name)
        return name

    # ------------------------------------------------------------------ after a step
    @torch.no_grad()
    def stepped(self, model: TrainedModel) -> None:
        """The optimiser stepped: count it, and move the EMA reference (unless it is the fixed start)."""
        self.step += 1
        self.weights_version = None
        decay = self.config.ema_decay
        if decay == 1.0:  # a fixed reference: the weights the learner started from
            return
        for name, value in lora_state(model.peft).items():
            self.ema[name].mul_(decay).add_(value, alpha=1.0 - decay)

    def publish_due(self, model: TrainedModel, faults: list[StepFault]) -> str | None:
        """Publish at the cadence, or now if the last try failed; a storage failure becomes a fault."""
        if not (self._publish_due or self.step % self.config.publish_every == 0):
            return None
        try:
            name = self.publish(model)
        except (OSError, AdapterError) as err:
            self._publish_due = True
            self._fault(faults, "publish", err)
            return None
        self._publish_due = False
        return name

    def checkpoint_due(self, model: TrainedModel, faults: list[StepFault]) -> str | None:
        """Checkpoint at the cadence, or now if the last try failed; a storage failure becomes a fault."""
        every = self.config.checkpoint_every
        if not (self._checkpoint_due or (every and self.step % every == 0)):
            return None
        try:
            path = str(self.save_checkpoint(model))
        except OSError as err:
            self._checkpoint_due = True
            self._fault(faults, "checkpoint", err)
            return None
        self._checkpoint_due = False
        return path

    def _fault(self, faults: list[StepFault], what: Literal["publish", "checkpoint"], err: Exception) -> None:
        self.counters[f"{what}_failures"] += 1
        logger.error(
            "%s step %d: %s failed, retried after the next step (%s)", self.config.policy, self.step, what, err
        )
        kind: StepFaultKind = "publish_failed" if what == "publish" else "checkpoint_failed"
        faults.append(StepFault(kind, self.step, f"{type(err).__name__}: {err}"[:500]))

    # ------------------------------------------------------------------ versions
    def publish(self, model: TrainedModel) -> str:
        """Publish the current LoRA weights as the next version of the policy.

        In a group rank 0 writes the version and the others learn its number (their weights are the same).
        """
        policy = self.config.policy
        canaried = self._publishes % self.config.canary_every == 0

        def write() -> str:
            # The weights' canary travels in the version: a replica refuses the version unless it reproduces it.
            began = time.perf_counter()
            canary = (
                version_canary(model.peft, self.preset, self.config.zero_stage, self.last_canary) if canaried else None
            )
            self.canary_s = time.perf_counter() - began if canary is not None else 0.0
            data = None if canary is None else canary.to_bytes()
            name = str(self.store.publish(policy, model.peft, base_model=base_model_name(self.preset), canary=data))
            self.last_canary = canary or self.last_canary
            return name

        with whole_lora(model.peft):  # every rank: rank 0 saves whole weights
            _, number = self.dist.rank0_writes(
                write, self.versions.number, f"publish the next version of {policy}", (OSError, AdapterError)
            )
        self._publishes += 1  # after the write: a failed publish is retried with the canary it was due
        name = f"{policy}@v{number}"
        self.versions.published(name, lora_state(model.peft))
        self.weights_version = name
        logger.info("published %s at step %d", name, self.step)
        return name

    def weights_of(self, version: str, model: TrainedModel) -> LoraState | None:
        """LoRA weights of a published version: in-memory snapshot, else read back from the store."""
        if version in self.versions.snapshots:
            return dict(self.versions.snapshots[version])
        try:
            state = read_adapter_dir(self.store.resolve(version).path, model.peft)
        except (AdapterError, OSError, ValueError) as err:
            logger.warning("no weights for %s (%s): its ratio is taken against the current weights", version, err)
            return None
        self.versions.keep(version, state)
        return state

    def prune(self, keep: list[str]) -> list[str]:
        """Remove old versions from the store (see `Learner.prune_versions`); returns the names removed."""
        cfg = self.config
        if cfg.keep_versions == 0:
            return []
        protected = {*keep, *self.versions.snapshots}
        if self.versions.latest is not None:
            protected.add(self.versions.latest)
        try:
            removed = self.store.prune(
                cfg.policy, keep=protected, keep_last=max(cfg.keep_versions, cfg.max_policy_lag + 1)
            )
        except OSError as err:
            logger.warning("%s: pruning old adapter versions failed (%s)", cfg.policy, err)
            return []
        names = [str(ref) for ref in removed]
        self.versions.forget(names)
        self.counters["versions_pruned"] += len(names)
        if names:
            logger.info("%s: pruned %d old versions (%s .. %s)", cfg.policy, len(names), names[0], names[-1])
        return names

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, model: TrainedModel) -> Path:
        """Write `step-<N>` atomically (adapter, optimiser, EMA, RNG states, step, version, counters).

        Nothing is pickled (see `state_files`): DeepSpeed's own checkpoint is not used, its state is
        taken through the engine (`train_state`). The PEFT `adapter/` copy is for people and tools.
        In a group rank 0 gathers each rank's partition (and RNG states) and writes them as `rank<r>`
        beside its own; the checkpoint's meta records the number of ranks that can restore it.
        """
        dist = self.dist
        own = _cpu(engine_state(model.engine))  # every rank at once (at ZeRO-3 it gathers the LoRA weights)
        parts = dist.gather_plain(None if dist.writer else {"engine": own, "rng": rng_state()})
        meta: dict[str, Any] = {"policy": self.config.policy, "step": self.step, "version": self.versions.latest}
        if dist.grouped:
            meta["ranks"] = dist.world_size

        def write(tmp: Path) -> None:
            write_state(tmp, ENGINE_STATE, own)
            for r, part in enumerate((parts or [])[1:], start=1):
                write_state(tmp, rank_state(r), part)
            write_state(tmp, LEARNER_STATE, self._state_dict())
            model.peft.save_pretrained(str(tmp / "adapter"), safe_serialization=True)

        with whole_lora(model.peft):  # every rank: rank 0 saves the PEFT copy
            path, _ = dist.rank0_writes(
                lambda: self.checkpoints.save(self.step, write, meta=meta),
                lambda _: 1,
                f"write checkpoint step-{self.step} of {self.config.policy}",
            )
        self.last_checkpoint = path or self.checkpoints.root / f"step-{self.step}"
        return self.last_checkpoint

    def _state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.versions.latest,
            "weights_version": self.weights_version,
            "min_version": self.versions.min_version,
            "counters": dict(self.counters),
            "rollbacks": dict(self.rollbacks),
            "ema": {k: v.clone() for k, v in self.ema.items()},
            "rng": rng_state(),
            "config": asdict(self.config),
        }

    def _restore(self, model: TrainedModel, checkpoint: Checkpoint) -> None:
        written_by = int(checkpoint.meta.get("ranks", 1))
        if written_by != self.dist.world_size:
            raise ValueError(
                f"{checkpoint.path} was written by a group of {written_by} learner rank(s) and learner.ranks is "
                f"{self.dist.world_size}: ZeRO partitions its optimiser state by rank, so resume it with "
                f"learner.ranks={written_by} (or start a new run)"
            )
        state = read_state(checkpoint.path, LEARNER_STATE)
        rng = state["rng"]
        if self.dist.writer:
            restore_engine_state(model.engine, read_state(checkpoint.path, ENGINE_STATE))
        else:  # this rank's ZeRO partition and its own RNG states
            part = read_state(checkpoint.path, rank_state(self.dist.rank))
            restore_engine_state(model.engine, part["engine"])
            rng = part["rng"]
        self.step = int(state["step"])
        self.versions.restore(state)
        self.weights_version = state["weights_version"]
        self.counters.update(state["counters"])
        self.rollbacks = {
            str(k): str(v) for k, v in dict(state.get("rollbacks") or {}).items()
        }  # absent before rollbacks
        self.ema = {k: v.float() for k, v in state["ema"].items()}
        restore_rng_state(rng)
        self.last_checkpoint = checkpoint.path
        logger.info("restored %s from %s (step %d)", self.config.policy, checkpoint.path, self.step)

    def _continue_numbering(self, model: TrainedModel) -> None:
        """After a restore: supersede the steps taken after the checkpoint and never reuse their versions.

        The restored weights are those of the checkpoint's version; when the store has newer ones
        (published by the lost steps) they are published again as the next number. `weights_version`
        keeps naming the checkpoint's version: records sampled by it are then replayed exactly as the
        first time (no recomputed old logprobs), and records sampled by the new number, the same
        weights, are recomputed under them.
        """
        from diprl.atomic_io import move_jsonl_records

        moved, lost = 0, None
        if self.dist.writer:
            moved = move_jsonl_records(
                self.metrics.path,
                self.metrics.path.with_name("metrics.superseded.jsonl"),
                lambda r: int(r.get("step", 0)) > self.step,
            )
            latest = self.store.latest(self.config.policy)
            if latest is not None and self.versions.latest is not None and str(latest) != self.versions.latest:
                lost = str(latest)
        if not self.dist.broadcast_int(int(lost is not None)):  # rank 0 decides; every rank publishes
            return
        restored_weights = self.weights_version
        self.publish(model)
        if restored_weights is not None:
            self.weights_version = restored_weights
        logger.warning(
            "%s: restored step %d (%s); steps after it were lost (%d logged, up to %s): "
            "its weights are published again as %s",
            self.config.policy,
            self.step,
            restored_weights,
            moved,
            lost,
            self.versions.latest,
        )


def rank_state(rank: int) -> str:
    """The checkpoint file name of rank `rank`'s ZeRO partition and RNG states (rank 0's are `engine`, `learner`)."""
    return f"rank{rank}"


def _cpu(tree: Any) -> Any:
    """`tree` with every tensor moved to the CPU (what crosses to rank 0 for its checkpoint)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cpu(v) for v in tree)
    return tree
