"""`Learner`: GRPO (and behaviour cloning) on a LoRA adapter with DeepSpeed; publishes `<policy>@v<N>`.

One `train_step(groups)` is one optimiser step:

1. **Staleness.** Each group's `policy_version` must be a version of this policy no more than
   `max_policy_lag` versions behind the current one; older groups (and groups of other policies)
   are dropped and counted, never trained on.
2. **Screening.** Every record is validated and its constraint masks rebuilt from its legal orders
   (`batching`). A bad record is quarantined (`quarantine`): kept with its reason and origin in
   `run_dir/learner/<policy>/quarantine.jsonl`, counted, and left out; the rest train.
3. **Recompute** (no gradient, `passes`): the old-policy logprobs under the weights of the version
   that sampled each record, where those are not the current weights, so the PPO ratio sees policy
   change and the truncated importance weight sees only engine drift (see `diprl.learn.loss`); with
   `kl_coef` > 0, the logprobs under the KL reference (an EMA of the LoRA weights, or with `ema_decay`
   1 the weights the learner started from).
4. **Forward/backward** (`passes`) over micro-batches packed by a token budget, the loss normalised by
   the step's completion tokens. Records whose own loss is not finite are quarantined and the rest
   train; when no record can be blamed (the weights, not the data), DeepSpeed's overflow check skips
   the update and the step is reported as `nonfinite_gradients` without a change to the weights.
5. **Optimiser** step (grad-norm clipping by DeepSpeed) and later epochs, then EMA, publishing and
   checkpointing at their cadences (`lifecycle`: a failed publish or checkpoint is a fault in the
   step's metrics, retried after the next step), and the report (`StepReport`, the metrics log).

The learner alone or as one rank of a group (`diprl.learn.group`) runs this same code; what differs
between ranks lives in `passes` (each rank's share) and `lifecycle` (rank 0 writes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from diprl.inference.adapters import AdapterStore
from diprl.inference.adapters.pins import use_key
from diprl.learn.batching import PreparedRecord, prepare_record
from diprl.learn.config import LearnerConfig, scheduled_lr
from diprl.learn.intake import GroupIntake
from diprl.learn.lifecycle import Lifecycle
from diprl.learn.passes import Passes, PassResult, TrainedModel
from diprl.learn.quarantine import (
    QUARANTINE_FILE,
    Origin,
    QuarantineEntry,
    QuarantineFile,
    Screened,
    loose_origins,
    origins_of,
    screen,
)
from diprl.learn.ranks import Collective, RankSpec
from diprl.learn.report import StepTimer
from diprl.learn.site import LearnerSite
from diprl.learn.train_state import base_optimizer
from diprl.learn.versions import VersionBook
from diprl.messages import PolicyRef, StepFault, StepReport, TrainingRecord, TrajectoryGroup
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer, pad_token_id
from diprl.policy.vocab import token_table

logger = logging.getLogger(__name__)

OBJECTIVES = ("grpo", "bc")


class Learner:
    """The learner of one trained policy. Plain class; `diprl.learn.actor.learner_actor` makes it a Ray actor.

    On construction it resumes from its newest good checkpoint or publishes its first version (see
    `diprl.learn.lifecycle`). `site`: its run directory, adapter store and pin key (installed for
    this process before it touches the store). `rank` None: the learner is one process; else one rank of a group.
    """

    def __init__(
        self,
        config: LearnerConfig,
        site: LearnerSite,
        queue: str | None = None,
        rank: RankSpec | None = None,
        base: Any = None,
    ) -> None:
        use_key(site.pin_key)
        self.config = config
        self.base = base  # a base model shared with other adapters (`diprl.learn.host`), or None: its own
        self.rank_spec = rank
        self.dist = Collective(rank)
        self.preset = load_preset(config.model)
        self.run_dir = Path(site.run_dir)
        tokenizer = load_tokenizer(resolve_model_path(self.preset))
        self.vocab_size = self.preset.tiny.vocab_size if self.preset.tiny is not None else None
        self.table = token_table(tokenizer, self.vocab_size)
        self.pad_id = pad_token_id(tokenizer)
        self.life = Lifecycle(config, self.dist, self.run_dir, AdapterStore(site.adapter_root), self.preset)
        self.quarantine = QuarantineFile(self.metrics_path.with_name(QUARANTINE_FILE), config.policy, self.dist.writer)
        self._answered: float | None = None  # when train_next last returned (its idle time)
        self.intake = GroupIntake(
            queue, self.metrics_path.parent, config.groups_per_step, holdover=max(2 * config.groups_per_step, 16)
        )
        model = TrainedModel.build(self.preset, config, rank, self.life.start_dir(), config.seed, base)
        self.passes = Passes(config, self.dist, self.pad_id, model)
        self.life.start(model)

    # ------------------------------------------------------------------ what the learner holds
    @property
    def model(self) -> TrainedModel:
        return self.passes.model

    @property
    def peft(self) -> Any:
        return self.model.peft

    @property
    def engine(self) -> Any:
        return self.model.engine

    @property
    def device(self) -> Any:
        return self.model.device

    @property
    def step(self) -> int:
        return self.life.step

    @property
    def versions(self) -> VersionBook:
        return self.life.versions

    @property
    def counters(self) -> dict[str, int]:
        return self.life.counters

    @property
    def ema(self) -> dict[str, Any]:
        return self.life.ema

    @property
    def store(self) -> AdapterStore:
        return self.life.store

    @property
    def checkpoints(self) -> Any:
        return self.life.checkpoints

    @property
    def metrics_path(self) -> Path:
        return self.life.metrics.path

    @property
    def version(self) -> str | None:
        """The latest published version of this policy."""
        return self.life.versions.latest

    # ------------------------------------------------------------------ public API
    def latest_version(self) -> str:
        assert self.version is not None
        return self.version

    def publish(self) -> str:
        """Publish the current LoRA weights as the next version of the policy."""
        return self.life.publish(self.model)

    def save_checkpoint(self) -> Path:
        """Write `step-<N>` atomically: adapter, optimiser, EMA, RNG states, step, version, counters."""
        return self.life.save_checkpoint(self.model)

    def reset(self) -> str:
        """A fresh LoRA (exploiter reset): new weights, optimiser state and EMA; published as the next version.

        Groups sampled by versions before the reset are from another network and are dropped as stale.
        The reset is checkpointed at once (whatever the cadence): the league forgets the old network's
        statistics when it asks for a reset, so a restore must not bring that network back.
        """
        self.counters["resets"] += 1
        self.engine.destroy()
        seed = self.config.seed + self.counters["resets"]
        self.passes.model = TrainedModel.build(self.preset, self.config, self.rank_spec, None, seed, self.base)
        return self.life.reset(self.model)

    def rollback(self, to_version: str, decision: str | None = None) -> str:
        """Restore `to_version`'s published weights (the league's best version) and publish them as the next version.

        The weights are read back from the AdapterStore, so the new version's adapter equals `to_version`'s
        exactly. The optimiser state is fresh, not kept: Adam's moments at the collapsed version are those of
        the updates that led into the collapse, and would push the restored weights straight back along them.
        The KL reference becomes the restored weights, groups sampled before the rollback are dropped as stale
        (the collapsed network's), and the step counter (and with it the learning-rate schedule) goes on.
        Checkpointed at once. `decision` names the league's rollback decision: the same decision asked again
        (a retried call, a driver resumed before it told the league) answers the version that carried it out,
        without rolling back twice. A version the store no longer holds is an error; nothing changes then.
        """
        if decision is not None and decision in self.life.rollbacks:
            return self.life.rollbacks[decision]
        source = self.life.source_of(to_version)
        self.engine.destroy()
        self.passes.model = TrainedModel.build(
            self.preset, self.config, self.rank_spec, source, self.config.seed, self.base
        )
        return self.life.rolled_back(self.model, to_version, decision)

    def prune_versions(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove this policy's old versions from the AdapterStore; returns the names removed.

        Kept: every name in `keep` (what the league holds: pool members, current versions, refs of
        matches in flight), the versions still trainable (`max_policy_lag` behind the latest) and the
        newest `keep_versions`. `keep_versions` 0 keeps everything. A failure to delete is logged:
        a version left behind costs disk, never a step.
        """
        return self.life.prune(list(keep))

    def score(self, records: Sequence[TrainingRecord]) -> list[list[float]]:
        """The current policy's masked, tempered logprob of every completion token of `records` (no training)."""
        return self.passes.score(self._prepare(records, rl=False))

    def train_next(self, timeout_s: float = 1.0, give_way: Callable[[], bool] | None = None) -> StepReport | None:
        """One step on the next batch from this learner's own queue; None when no batch came in time.

        A batch taken by a previous life of this learner (killed mid-step) is trained first, unless its
        step was checkpointed (see `diprl.learn.intake`). `give_way`: stop waiting (None) as soon as it
        says true, as when another adapter of the same process has a batch ready (`diprl.learn.host`).

        Where the learner's time between steps goes, in the report's metrics: `time_idle_s`, from its
        previous answer to this call (the driver's bookkeeping and Ray's round trip; on a host, also the
        other adapters' steps), and `time_wait_s`, waiting in this call for the queue to fill a batch.
        """
        called = time.monotonic()
        idle = called - self._answered if self._answered is not None else 0.0
        batch = self.intake.pending(self.step)
        if batch is None:
            batch = self.intake.take(self.versions.trainable, timeout_s, give_way)
            if batch is None:
                self._answered = time.monotonic()
                return None
        waited = time.monotonic() - called
        self.intake.hold(batch, self.step + 1)
        report = self.train_step(batch)
        self.intake.release()
        report.metrics.update(time_idle_s=idle, time_wait_s=waited)
        self._answered = time.monotonic()
        return report

    def train_step(self, groups: Sequence[TrajectoryGroup]) -> StepReport:
        """One GRPO optimiser step on the fresh-enough groups; returns what happened.

        With nothing left to train on (all stale), no step is taken: `step` is unchanged, `trained` False.
        """
        timer = StepTimer()
        fresh, extra = self._fresh(groups)
        records, origins = origins_of(fresh)
        if not records:
            return self._no_step(extra, timer)
        try:
            report = self._step(records, "grpo", extra, timer, origins)
        except Exception as err:
            # Not a bad record (those are quarantined inside the step): keep the batch, then let the
            # caller record the fault and go on.
            self.quarantine.append([QuarantineEntry.of_group(err, g) for g in groups], self.step + 1)
            raise
        self.counters["groups_trained"] += len(fresh)
        return report

    def train_records(self, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport:
        """One optimiser step on `records`.

        `bc`: masked negative log-likelihood of the completions (imitation; behaviour logprobs and
        advantages are ignored). `grpo`: the GRPO step of `train_step`, with staleness judged per record.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if objective == "grpo":
            return self.train_step([_one_record_group(i, r) for i, r in enumerate(records)])
        if not records:
            raise ValueError("train_records needs at least one record")
        return self._step(list(records), "bc", {}, StepTimer())

    def ready(self) -> bool:
        """Whether `train_next` would find a batch without waiting."""
        return self.intake.has_pending() or self.intake.ready(self.versions.trainable)

    def pid_of(self) -> int:
        return os.getpid()

    def state(self) -> dict[str, Any]:
        life = self.life
        return {
            "policy": self.config.policy,
            "step": self.step,
            "version": self.version,
            "weights_version": life.weights_version,
            "min_version": self.versions.min_version,
            "counters": dict(self.counters),
            "last_checkpoint": str(life.last_checkpoint) if life.last_checkpoint else None,
            "restored_from": str(life.restored.checkpoint.path) if life.restored.checkpoint else None,
            "skipped_checkpoints": [[str(p), why] for p, why in life.restored.skipped],
            "config": asdict(self.config),
        }

    # ------------------------------------------------------------------ the step
    def _step(
        self,
        records: list[TrainingRecord],
        objective: str,
        extra: dict[str, Any],
        timer: StepTimer,
        origins: Sequence[Origin] | None = None,
    ) -> StepReport:
        """Screen -> recompute -> forward/backward -> optimiser -> EMA, publish, checkpoint -> report."""
        rl = objective == "grpo"
        with timer.phase("recompute"):
            screened = self._screen(records, origins, rl)
            if not screened.prepared:
                return self._no_step(extra, timer, screened.quarantined)
            mine = self.passes.share(screened.prepared)
            self._recompute(screened.prepared, mine, rl)
        with timer.phase("fwd_bwd"):
            passes = self.passes.forward_backward(screened, mine, rl, self.step + 1)
        with timer.phase("optimizer"):
            lr, grad_norm, applied = self._optimiser_step(passes)
        quarantined = [*screened.quarantined, *passes.blamed]
        if not applied:
            return self._skipped(passes, extra, timer, quarantined)
        with timer.phase("epochs"):
            epochs, last = self._later_epochs(screened, [i for i in mine if i not in passes.excluded], rl)
        with timer.phase("optimizer"):
            self.life.stepped(self.model)
        faults: list[StepFault] = []
        with timer.phase("publish"):
            published = self.life.publish_due(self.model, faults)
        with timer.phase("checkpoint"):
            checkpoint = self.life.checkpoint_due(self.model, faults)
        metrics = self._metrics(objective, screened, passes, (lr, grad_norm), (epochs, last), timer, quarantined, extra)
        return self._report(True, metrics, quarantined, faults, published, checkpoint)

    def _fresh(self, groups: Sequence[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], dict[str, Any]]:
        """The groups fresh enough to train on (step 1 of the module doc), and what was dropped."""
        fresh: list[TrajectoryGroup] = []
        lags: list[int] = []
        stale, foreign = self.intake.dropped_stale, 0
        self.intake.dropped_stale = 0
        for group in groups:
            lag = self.versions.lag(group.policy_version) if isinstance(group, TrajectoryGroup) else None
            if lag is None:
                foreign += 1
            elif lag > self.config.max_policy_lag:
                stale += 1
            else:
                lags.append(lag)
                fresh.append(group)
        self.counters["dropped_stale"] += stale
        self.counters["dropped_foreign"] += foreign
        if stale or foreign:
            logger.warning(
                "%s: dropped %d stale groups (lag > %d) and %d groups of other policies",
                self.config.policy, stale, self.config.max_policy_lag, foreign,
            )  # fmt: skip
        return fresh, {
            "groups": len(lags),
            "dropped_stale": stale,
            "dropped_foreign": foreign,
            "policy_lag_mean": float(np.mean(lags)) if lags else 0.0,
            "policy_lag_max": float(max(lags)) if lags else 0.0,
        }

    def _prepare(self, records: Sequence[TrainingRecord], rl: bool) -> list[PreparedRecord]:
        return [
            prepare_record(r, self.table, i, need_rl_fields=rl, max_len=self.preset.max_model_len)
            for i, r in enumerate(records)
        ]

    def _screen(self, records: Sequence[TrainingRecord], origins: Sequence[Origin] | None, rl: bool) -> Screened:
        """Validate every record; the bad ones are quarantined at once (kept whatever happens next)."""
        if origins is None:
            origins = loose_origins(records)
        max_len = self.preset.max_model_len
        screened = screen(
            records, origins, lambda r, i: prepare_record(r, self.table, i, need_rl_fields=rl, max_len=max_len)
        )
        self._quarantine(screened.quarantined)
        return screened

    def _quarantine(self, entries: Sequence[QuarantineEntry]) -> None:
        self.counters["quarantined"] += self.quarantine.record(entries, self.step + 1)

    def _recompute(self, prepared: list[PreparedRecord], mine: list[int], rl: bool) -> None:
        """Old-policy and reference logprobs (GRPO only). At ZeRO-3 each forward gathers the base weights, a
        collective: the ranks of a group then recompute the whole batch (the same passes everywhere)."""
        if not rl:
            return
        records = prepared if self.passes.lockstep else [prepared[i] for i in mine]
        weights = self.life.weights_version
        current = None if weights is None else PolicyRef.parse(weights)
        missing = self.passes.recompute(records, current, self._weights_of, self.ema)
        self.counters["old_weights_missing"] += missing

    def _weights_of(self, version: PolicyRef) -> dict[str, Any] | None:
        """The weights of `version` (the version book and the store name versions by their text)."""
        return self.life.weights_of(str(version), self.model)

    def _optimiser_step(self, passes: PassResult) -> tuple[float, Any, bool]:
        """This step's lr into the optimiser, its step, and the records the passes blamed quarantined.

        The lr (`learner.lr_decay_steps`) is a function of the step alone, so a resumed learner continues
        the schedule from its checkpointed step with nothing else saved. Returns the lr, the gradient
        norm and whether DeepSpeed applied the update (it skips one with non-finite gradients).
        """
        lr = scheduled_lr(self.config, self.step)
        for group in base_optimizer(self.engine).param_groups:
            group["lr"] = lr
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        self._quarantine(passes.blamed)
        return lr, grad_norm, bool(self.engine.was_step_applied())

    def _later_epochs(self, screened: Screened, mine: list[int], rl: bool) -> tuple[int, PassResult | None]:
        """Epochs 2..`epochs` of a GRPO step on the same records (`mine`, less what the first pass
        quarantined): their ratios are against the fixed `logp_old`, so the clip bounds the step. A later
        update that is not finite is skipped and ends the step's epochs. Returns the epochs applied and
        the last epoch's passes (None when there was only the first; always for behaviour cloning)."""
        epochs, last = 1, None
        while rl and epochs < self.config.epochs:
            last = self.passes.forward_backward(screened, mine, True, self.step + 1)
            self.engine.step()
            if not self.engine.was_step_applied():
                self.counters["nonfinite_steps"] += 1
                logger.error(
                    "%s: non-finite gradients in epoch %d, later epochs skipped", self.config.policy, epochs + 1
                )
                break
            epochs += 1
        return epochs, last

    # ------------------------------------------------------------------ the report
    def _metrics(
        self,
        objective: str,
        screened: Screened,
        passes: PassResult,
        optimiser: tuple[float, Any],
        epochs: tuple[int, PassResult | None],
        timer: StepTimer,
        quarantined: Sequence[QuarantineEntry],
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """A taken step's metrics; counts what it trained."""
        trained = [r for k, r in enumerate(screened.prepared) if k not in passes.excluded]
        tokens = sum(len(r.completion_ids) for r in trained)
        forced = sum(r.forced for r in trained)  # no head, no gradient
        self.counters["records_trained"] += len(trained)
        self.counters["tokens_trained"] += tokens
        lr, grad_norm = optimiser
        metrics: dict[str, Any] = {
            "objective": objective,
            "loss": passes.loss,
            **passes.stats.summary(),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "records": len(trained),
            "tokens": tokens,
            "forced_token_share": forced / max(tokens, 1),
            "padded_tokens": passes.padded_tokens,
            "micro_batches": passes.micro_batches,
            **timer.metrics(),
            "quarantined": len(quarantined),
            **extra,
        }
        metrics["tokens_per_s"] = tokens / max(metrics["time_step_s"], 1e-9)
        if objective == "grpo" and self.config.epochs > 1:
            # What the clip saw in the last epoch: how far the earlier epochs had moved the policy.
            taken, last = epochs
            metrics.update(epochs=taken, time_epochs_s=timer.spent.get("epochs", 0.0))
            if last is not None:
                summary = last.stats.summary()
                metrics.update({f"last_{k}": v for k, v in summary.items() if k.startswith(("ratio", "clip_frac"))})
        if self.dist.grouped:
            metrics["ranks"] = self.dist.world_size
        return metrics

    def _skipped(
        self, passes: PassResult, extra: dict[str, Any], timer: StepTimer, quarantined: list[QuarantineEntry]
    ) -> StepReport:
        """DeepSpeed skipped the update on non-finite gradients (and cleared them): no step is taken."""
        self.counters["nonfinite_steps"] += 1
        logger.error(
            "%s: non-finite gradients, optimiser step skipped (%s)",
            self.config.policy,
            passes.stats.summary(),
        )
        fault = StepFault("nonfinite_gradients", self.step + 1)
        return self._no_step({**extra, "nonfinite_gradients": 1}, timer, quarantined, [fault])

    def _no_step(
        self,
        extra: dict[str, Any],
        timer: StepTimer,
        quarantined: Sequence[QuarantineEntry] = (),
        faults: Sequence[StepFault] = (),
    ) -> StepReport:
        metrics = {"tokens": 0, "time_step_s": timer.total(), "quarantined": len(quarantined), **extra}
        return self._report(False, metrics, quarantined, faults)

    def _report(
        self,
        trained: bool,
        metrics: dict[str, Any],
        quarantined: Sequence[QuarantineEntry] = (),
        faults: Sequence[StepFault] = (),
        published: str | None = None,
        checkpoint: str | None = None,
    ) -> StepReport:
        """The step's report (with this process's pid), logged to the learner's own metrics file."""
        report = StepReport(
            policy=self.config.policy,
            step=self.step,
            trained=trained,
            version=None if self.version is None else PolicyRef.parse(self.version),
            published=None if published is None else PolicyRef.parse(published),
            checkpoint=checkpoint,
            faults=list(faults),
            quarantined=[e.origin() for e in quarantined],
            metrics=metrics,
            pid=os.getpid(),
        )
        self.life.metrics.append(report.record())
        return report


def _one_record_group(i: int, record: TrainingRecord) -> TrajectoryGroup:
    """A record as a group of its own (GRPO through `train_records`: staleness judged per record)."""
    return TrajectoryGroup(
        group_id=f"record-{i}",
        match_id="",
        power=record.power,
        phase=record.phase,
        policy_version=record.policy_version,
        records=[record],
        returns=[],
        advantage_std=0.0,
    )
