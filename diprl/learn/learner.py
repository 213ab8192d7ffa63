"""`Learner`: GRPO (and behaviour cloning) on a LoRA adapter with DeepSpeed; publishes `<policy>@v<N>`.

One `train_step(groups)` is one optimiser step:

1. **Staleness.** Each group's `policy_version` must be a version of this policy no more than
   `max_policy_lag` versions behind the current one; older groups (and groups of other policies)
   are dropped and counted, never trained on.
2. **Screening.** Every record is validated and its constraint masks rebuilt from its legal orders
   (`batching`). A bad record (non-finite logprob or advantage, a completion the constraint rejects,
   longer than `max_model_len`, malformed) is quarantined: appended with its reason and origin (group
   id, policy version, index) to `run_dir/learner/<policy>/quarantine.jsonl`, counted, and left out;
   the rest train.
3. **Recompute** (no gradient). Where the current weights are not those of the version that
   sampled a record, the trainer's logprobs under that version's weights (`logp_old`, from an
   in-memory snapshot or the AdapterStore) so the PPO ratio sees policy change and the truncated
   importance weight sees only engine drift (see `diprl.learn.loss`); with `kl_coef` > 0, the
   logprobs under the KL reference (an EMA of the LoRA weights, or with `ema_decay` 1 the weights the
   learner started from).
4. **Forward/backward** over micro-batches packed by a token budget, gradients accumulated, the loss
   normalised by the step's total completion tokens. A micro-batch whose loss is not finite is
   taken apart per record: records whose own loss is not finite are quarantined and the micro-batch
   trains without their tokens (they weigh zero in the step's token mean). When no record can be
   blamed (every record's logprobs are non-finite: the weights, not the data), the non-finite loss is
   back-propagated, DeepSpeed's overflow check skips the update and clears the gradients, and the
   step is reported as `nonfinite_gradients` without a change to the weights.
5. **Optimiser** step (grad-norm clipping by DeepSpeed), EMA update, then publishing and
   checkpointing at their cadences. A failed publish or checkpoint (a full disk, `ENOSPC`) is a fault
   in the step's metrics, not an exception: the step's weights stay in memory, the store and the
   checkpoint directory hold no partial version, and the publish (or checkpoint) is retried after
   the next step.

Weights swapped in for a no-gradient pass are copied back exactly; ZeRO's fp32 master copies are
never touched, so swaps cannot leak into training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diprl.inference.adapters import AdapterError, AdapterStore, InvalidAdapterName, parse_policy_ref
from diprl.learn.batching import BadRecord, MicroBatch, PreparedRecord, micro_batches, prepare_record
from diprl.learn.checkpoint import Checkpoint, CheckpointDir, Restored
from diprl.learn.config import LearnerConfig, scheduled_lr
from diprl.learn.intake import GroupIntake
from diprl.learn.loss import LossStats, grpo_loss, nll_loss
from diprl.learn.model import (
    CompletionScorer,
    base_model_name,
    build_peft_model,
    init_distributed,
    load_lora_state_,
    lora_parameters,
    lora_state,
    make_engine,
    read_adapter_dir,
    whole_lora,
)
from diprl.learn.ranks import Collective, RankSpec, split_by_tokens
from diprl.learn.state_files import read_state, state_paths, write_state
from diprl.learn.train_state import base_optimizer, engine_state, restore_engine_state, restore_rng_state, rng_state
from diprl.learn.versions import VersionBook
from diprl.messages import ZOO_PREFIX, StepReport, TrainingRecord, TrajectoryGroup
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer, pad_token_id
from diprl.policy.vocab import token_table

logger = logging.getLogger(__name__)

OBJECTIVES = ("grpo", "bc")
ENGINE_STATE = "engine"  # trainable and master weights, optimizer moments, engine counters
LEARNER_STATE = "learner"  # step, versions, counters, EMA reference, RNG states
CHECKPOINT_FILES = tuple(p.name for name in (ENGINE_STATE, LEARNER_STATE) for p in state_paths(Path(), name))
QUARANTINE_FILE = "quarantine.jsonl"


@dataclass(frozen=True)
class Origin:
    """Where a record came from, enough to find it again: its group, the version that sampled it, its index."""

    group_id: str | None
    policy_version: str | None
    index: int


@dataclass
class Screened:
    """A step's records after screening: what trains, and what was quarantined (reason, message, origin)."""

    prepared: list[PreparedRecord]
    records: list[TrainingRecord]
    origins: list[Origin]
    quarantined: list[dict[str, Any]]


@dataclass
class _Passes:
    """What a step's forward and backward passes leave for the optimiser step and its report."""

    loss: float
    stats: LossStats
    excluded: set[int]  # indices into the screened records left out for a non-finite loss
    blamed: list[dict[str, Any]]  # their quarantine entries
    padded_tokens: int
    micro_batches: int


class Learner:
    """The learner of one trained policy. Plain class; `learner_actor` makes it a restartable Ray actor.

    On construction it restores the newest checkpoint under `run_dir/checkpoints/<policy>/` that
    verifies (corrupt or partial ones are skipped with a warning), or else starts a fresh LoRA (or
    the `init_adapter` warm start), publishes it as the policy's first version and checkpoints it
    as step 0, so a run is resumable from its first moment.

    Versions are immutable and never reused. Steps taken after the newest checkpoint are lost with
    the process and are taken again after a restore; the versions they published stay in the
    AdapterStore (the league may hold snapshots of them). So when the store holds versions newer
    than the checkpoint's, the restored weights are published again under the next free number:
    the learner's current version is always the newest of its policy, which the league accepts as
    newer than anything it was told. The superseded steps' records leave this learner's metrics log
    (moved to `metrics.superseded.jsonl` beside it), so the log holds every step once.
    """

    def __init__(
        self,
        config: LearnerConfig,
        run_dir: str | Path,
        adapter_root: str | Path,
        registry: str | None = None,
        queue: str | None = None,
        rank: RankSpec | None = None,
    ) -> None:
        self.config = config
        self.rank_spec = rank  # None: the learner is one process; else one rank of a group (`diprl.learn.group`)
        self.dist = Collective(rank)
        self.preset = load_preset(config.model)
        self.run_dir = Path(run_dir)
        self.store = AdapterStore(adapter_root)
        self.registry_name = registry
        self._registry: Any = None
        tokenizer = load_tokenizer(resolve_model_path(self.preset))
        self.vocab_size = self.preset.tiny.vocab_size if self.preset.tiny is not None else None
        self.table = token_table(tokenizer, self.vocab_size)
        self.pad_id = pad_token_id(tokenizer)
        self.checkpoints = CheckpointDir(
            self.run_dir / "checkpoints" / config.policy, keep=config.keep_checkpoints, required=CHECKPOINT_FILES
        )
        self.metrics_path = self.run_dir / "learner" / config.policy / "metrics.jsonl"
        self.quarantine_path = self.metrics_path.with_name(QUARANTINE_FILE)
        self._publish_due = False  # a publish failed (full disk, ...): retry after the next step
        self._checkpoint_due = False

        self.step = 0
        self.versions = VersionBook(config.policy, config.max_policy_lag)
        self.weights_version: str | None = None  # the published version the current weights equal, if any
        self.intake = GroupIntake(
            queue, self.metrics_path.parent, config.groups_per_step, holdover=max(2 * config.groups_per_step, 16)
        )
        self.counters: dict[str, int] = {
            "groups_trained": 0,
            "records_trained": 0,
            "tokens_trained": 0,
            "dropped_stale": 0,
            "dropped_foreign": 0,
            "old_weights_missing": 0,
            "resets": 0,
            "nonfinite_steps": 0,
            "quarantined": 0,
            "publish_failures": 0,
            "checkpoint_failures": 0,
            "versions_pruned": 0,
        }
        self.restored: Restored = self.checkpoints.newest_good()
        self.last_checkpoint: Path | None = None

        init_dir = None if self.restored.checkpoint is not None else self._init_adapter_dir()
        self._build(init_dir, seed=config.seed)
        if self.restored.checkpoint is not None:
            self._restore(self.restored.checkpoint)
            self._continue_numbering()
        else:
            self.publish()
            if config.checkpoint_every:
                self.save_checkpoint()

    # ------------------------------------------------------------------ building
    def _init_adapter_dir(self) -> Path | None:
        source = self.config.init_adapter
        if not source:
            return None
        if source.startswith(ZOO_PREFIX):  # a shipped policy: its adapter, or a fresh LoRA on its base
            from diprl.policy.zoo import warm_start_dir

            return warm_start_dir(source, self.config.model)
        try:
            ref = parse_policy_ref(source)
        except InvalidAdapterName:
            ref = None
        if ref is not None:
            return self.store.resolve(ref.name).path
        path = Path(source)
        if not path.is_dir():
            raise FileNotFoundError(
                f"init_adapter {source!r} is neither a version in {self.store.root} nor a directory"
            )
        return path

    def _build(self, adapter_dir: Path | None, seed: int) -> None:
        from dataclasses import replace

        if self.config.zero_stage == 3:
            init_distributed(self.config.use_gpu, self.rank_spec)  # ZeRO-3 loads the base partitioned
        self.peft = build_peft_model(self.preset, replace(self.config, seed=seed), adapter_dir)
        self.module = CompletionScorer(self.peft, self.config.logprob_chunk_tokens)
        self.engine = make_engine(self.module, self.config, self.rank_spec)
        self.device = next(self.module.parameters()).device
        self.ema = lora_state(self.peft)

    @property
    def registry(self) -> Any:
        if self.registry_name and self._registry is None:
            import ray

            from diprl.inference.registry import NAMESPACE

            self._registry = ray.get_actor(self.registry_name, namespace=NAMESPACE)
        return self._registry

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> str | None:
        """The latest published version of this policy."""
        return self.versions.latest

    def latest_version(self) -> str:
        assert self.version is not None
        return self.version

    def publish(self) -> str:
        """Publish the current LoRA weights as the next version of the policy (and register it if configured).

        In a group every rank calls it at the same point: rank 0 writes the version, the others learn
        its number (their weights are the same) and fail alike when rank 0's write failed.
        """
        name, error = None, None
        with whole_lora(self.peft):  # every rank: rank 0 saves whole weights
            if self.dist.writer:
                try:
                    if self.registry is not None:
                        from diprl.inference.registry import publish_everywhere

                        name = publish_everywhere(self.store, self.config.policy, self.peft, self.registry).name
                    else:
                        name = self.store.publish(
                            self.config.policy, self.peft, base_model=base_model_name(self.preset)
                        ).name
                except (OSError, AdapterError) as err:
                    if not self.dist.grouped:
                        raise
                    error = err
        if self.dist.grouped:
            number = self.dist.broadcast_int(self.versions.number(name) if name is not None else -1)
            if error is not None:
                raise error
            if number < 0:
                raise OSError(f"{self.config.policy}: rank 0 could not publish the next version")
            name = f"{self.config.policy}@v{number}"
        assert name is not None
        self.versions.published(name, lora_state(self.peft))
        self.weights_version = name
        logger.info("published %s at step %d", name, self.step)
        return name

    def reset(self) -> str:
        """A fresh LoRA (exploiter reset): new weights, optimiser state and EMA; published as the next version.

        Groups sampled by versions before the reset are from another network and are dropped as stale.
        The reset is checkpointed at once (whatever the cadence): the league forgets the old network's
        statistics when it asks for a reset, so a restore must not bring that network back.
        """
        self.counters["resets"] += 1
        self.engine.destroy()
        self._build(None, seed=self.config.seed + self.counters["resets"])
        name = self.publish()
        self.versions.reset()
        self.save_checkpoint()
        return name

    def train_next(self, timeout_s: float = 1.0) -> StepReport | None:
        """One step on the next batch from this learner's own queue; None when no batch came in time.

        A batch taken by a previous life of this learner (killed mid-step) is trained first, unless its
        step was checkpointed (see `diprl.learn.intake`).
        """
        batch = self.intake.pending(self.step)
        if batch is None:
            batch = self.intake.take(self.versions.trainable, timeout_s)
            if batch is None:
                return None
        self.intake.hold(batch, self.step + 1)
        report = self.train_step(batch)
        self.intake.release()
        return report

    def train_step(self, groups: Sequence[TrajectoryGroup]) -> StepReport:
        """One GRPO optimiser step on the fresh-enough groups; returns what happened.

        With nothing left to train on (all stale), no step is taken: `step` is unchanged, `trained` False.
        """
        start = time.perf_counter()
        records: list[TrainingRecord] = []
        origins: list[Origin] = []
        lags: list[int] = []
        stale, foreign = self.intake.dropped_stale, 0
        self.intake.dropped_stale = 0
        for group in groups:
            lag = self.versions.lag(group.policy_version) if isinstance(group, TrajectoryGroup) else None
            if lag is None:
                foreign += 1
                continue
            if lag > self.config.max_policy_lag:
                stale += 1
                continue
            lags.append(lag)
            for index, record in enumerate(group.records):
                records.append(record)
                origins.append(Origin(group.group_id, group.policy_version, index))
        self.counters["dropped_stale"] += stale
        self.counters["dropped_foreign"] += foreign
        if stale or foreign:
            logger.warning(
                "%s: dropped %d stale groups (lag > %d) and %d groups of other policies",
                self.config.policy,
                stale,
                self.config.max_policy_lag,
                foreign,
            )
        extra: dict[str, Any] = {
            "groups": len(lags),
            "dropped_stale": stale,
            "dropped_foreign": foreign,
            "policy_lag_mean": float(np.mean(lags)) if lags else 0.0,
            "policy_lag_max": float(max(lags)) if lags else 0.0,
        }
        if not records:
            return self._no_step(extra, start)
        try:
            report = self._step(records, "grpo", extra, start, origins)
        except Exception as err:
            # Not a bad record (those are quarantined inside the step): keep the batch, then let the
            # caller record the fault and go on.
            self._quarantine(
                [
                    {
                        "reason": "learner_error",
                        "error": f"{type(err).__name__}: {err}"[:1000],
                        "group_id": getattr(g, "group_id", None),
                        "policy_version": getattr(g, "policy_version", None),
                        "group": _plain(g),
                    }
                    for g in groups
                ]
            )
            raise
        self.counters["groups_trained"] += len(lags)
        return report

    def train_records(self, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport:
        """One optimiser step on `records`.

        `bc`: masked negative log-likelihood of the completions (imitation; behaviour logprobs and
        advantages are ignored). `grpo`: the GRPO step of `train_step`, with staleness judged per record.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        start = time.perf_counter()
        if objective == "bc":
            if not records:
                raise ValueError("train_records needs at least one record")
            return self._step(list(records), "bc", {}, start)
        return self.train_step(
            [
                TrajectoryGroup(
                    group_id=f"record-{i}",
                    match_id="",
                    power=r.power,
                    phase=r.phase,
                    policy_version=r.policy_version,
                    records=[r],
                    returns=[],
                    advantage_std=0.0,
                )
                for i, r in enumerate(records)
            ]
        )

    def prune_versions(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove this policy's old versions from the AdapterStore; returns the names removed.

        Kept: every name in `keep` (what the league holds: pool members, current versions, refs of
        matches in flight), the versions still trainable (`max_policy_lag` behind the latest) and the
        newest `keep_versions`. `keep_versions` 0 keeps everything. A failure to delete is logged:
        a version left behind costs disk, never a step.
        """
        cfg = self.config
        if cfg.keep_versions == 0:
            return []
        protected = {*keep, *self.versions.snapshots}
        if self.version is not None:
            protected.add(self.version)
        try:
            removed = self.store.prune(
                cfg.policy, keep=protected, keep_last=max(cfg.keep_versions, cfg.max_policy_lag + 1)
            )
        except OSError as err:
            logger.warning("%s: pruning old adapter versions failed (%s)", cfg.policy, err)
            return []
        self.versions.forget([ref.name for ref in removed])
        self.counters["versions_pruned"] += len(removed)
        if removed:
            logger.info(
                "%s: pruned %d old versions (%s .. %s)", cfg.policy, len(removed), removed[0].name, removed[-1].name
            )
        return [ref.name for ref in removed]

    def save_checkpoint(self) -> Path:
        """Write `step-<N>` atomically (adapter, optimiser, EMA, RNG states, step, version, counters).

        Nothing is pickled (see `state_files`): DeepSpeed's own checkpoint is not used, its state is
        taken through the engine (`train_state`). The PEFT `adapter/` copy is for people and tools.
        In a group every rank calls it at once: ZeRO partitions the master weights and Adam moments,
        so rank 0 gathers each rank's partition (and RNG states) and writes them as `rank<r>` beside
        its own; the checkpoint's meta records the number of ranks that can restore it.
        """
        dist = self.dist
        own = _cpu(engine_state(self.engine))  # every rank at once (at ZeRO-3 it gathers the LoRA weights)
        parts = dist.gather_plain(None if dist.writer else {"engine": own, "rng": rng_state()})
        meta: dict[str, Any] = {"policy": self.config.policy, "step": self.step, "version": self.version}
        if dist.grouped:
            meta["ranks"] = dist.world_size

        def write(tmp: Path) -> None:
            write_state(tmp, ENGINE_STATE, own)
            for r, part in enumerate((parts or [])[1:], start=1):
                write_state(tmp, _rank_state(r), part)
            write_state(tmp, LEARNER_STATE, self._state_dict())
            self.peft.save_pretrained(str(tmp / "adapter"), safe_serialization=True)

        path, error = None, None
        with whole_lora(self.peft):  # every rank: rank 0 saves the PEFT copy
            if dist.writer:
                try:
                    path = self.checkpoints.save(self.step, write, meta=meta)
                except OSError as err:
                    if not dist.grouped:
                        raise
                    error = err
        if dist.grouped:
            if not dist.broadcast_int(int(path is not None)):
                raise error or OSError(f"{self.config.policy}: rank 0 could not write checkpoint step-{self.step}")
            path = path or self.checkpoints.root / f"step-{self.step}"
        assert path is not None
        self.last_checkpoint = path
        return path

    def pid_of(self) -> int:
        return os.getpid()

    def state(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "step": self.step,
            "version": self.version,
            "weights_version": self.weights_version,
            "min_version": self.versions.min_version,
            "counters": dict(self.counters),
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "restored_from": str(self.restored.checkpoint.path) if self.restored.checkpoint else None,
            "skipped_checkpoints": [[str(p), why] for p, why in self.restored.skipped],
            "config": asdict(self.config),
        }

    # ------------------------------------------------------------------ the step
    def _prepare(self, records: Sequence[TrainingRecord], rl: bool) -> list[PreparedRecord]:
        return [
            prepare_record(r, self.table, i, need_rl_fields=rl, max_len=self.preset.max_model_len)
            for i, r in enumerate(records)
        ]

    def _screen(self, records: Sequence[TrainingRecord], origins: Sequence[Origin], rl: bool) -> Screened:
        """Validate every record; the bad ones go to quarantine (not trained), the rest are prepared."""
        out = Screened([], [], [], [])
        for i, (record, origin) in enumerate(zip(records, origins, strict=True)):
            try:
                if not isinstance(record, TrainingRecord):
                    raise BadRecord("malformed", f"record {i}: a {type(record).__name__}, not a TrainingRecord")
                prepared = prepare_record(record, self.table, i, need_rl_fields=rl, max_len=self.preset.max_model_len)
            except BadRecord as err:
                out.quarantined.append(_quarantine_entry(err.reason, str(err), origin, record))
                continue
            out.prepared.append(prepared)
            out.records.append(record)
            out.origins.append(origin)
        return out

    def _quarantine(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append quarantined records to `quarantine.jsonl` (nothing is lost: the whole record is kept).

        A failing write (a full disk) is logged, not raised: the step's metrics still name every entry.
        """
        if not entries or not self.dist.writer:
            return
        step = self.step + 1
        lines = "".join(
            json.dumps({"time": time.time(), "policy": self.config.policy, "step": step, **e}, default=str) + "\n"
            for e in entries
        )
        try:
            self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
            with self.quarantine_path.open("a") as fh:
                fh.write(lines)
        except OSError as err:
            logger.error("%s: could not write %d quarantined records (%s)", self.config.policy, len(entries), err)

    def _batches(self, prepared: Sequence[PreparedRecord], min_batches: int = 1) -> list[tuple[list[int], MicroBatch]]:
        """Micro-batches for every forward pass (training, recompute, scoring): prefix trees when sharing."""
        cfg = self.config
        min_prefix = cfg.prefix_min_tokens if cfg.prefix_sharing else None
        return [
            (idx, mb.to(self.device))
            for idx, mb in micro_batches(prepared, cfg.micro_batch_tokens, min_batches, self.pad_id, min_prefix)
        ]

    def _logprobs(self, mb: MicroBatch, with_entropy: bool, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.engine if grad else self.module
        logp, entropy = module(
            mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, mb.temperatures, mb.allowed, mb.prefix,
            with_entropy,
        )  # fmt: skip
        return logp, entropy

    @contextmanager
    def _weights(self, state: dict[str, torch.Tensor]) -> Iterator[None]:
        """Temporarily run the model with other LoRA weights (no gradient); the current ones are restored exactly."""
        saved = lora_state(self.peft)
        load_lora_state_(self.peft, state)
        try:
            with torch.no_grad():
                yield
        finally:
            load_lora_state_(self.peft, saved)

    @torch.no_grad()
    def score(self, records: Sequence[TrainingRecord]) -> list[list[float]]:
        """The current policy's masked, tempered logprob of every completion token of `records` (no training)."""
        prepared = self._prepare(records, rl=False)
        out: list[list[float]] = [[] for _ in prepared]
        for idx, mb in self._batches(prepared):
            logp, _ = self._logprobs(mb, with_entropy=False, grad=False)
            for i, (s, e) in zip(idx, mb.record_slices, strict=True):
                out[i] = logp[s:e].tolist()
        return out

    def _weights_of(self, version: str) -> dict[str, torch.Tensor] | None:
        """LoRA weights of a published version: in-memory snapshot, else read back from the store."""
        if version in self.versions.snapshots:
            return dict(self.versions.snapshots[version])
        try:
            state = read_adapter_dir(self.store.resolve(version).path, self.peft)
        except (AdapterError, OSError, ValueError) as err:
            logger.warning("no weights for %s (%s): its ratio is taken against the current weights", version, err)
            return None
        self.versions.keep(version, state)
        return state

    def _recompute(self, prepared: list[PreparedRecord], rl: bool) -> None:
        """Fill `logp_old` (behaviour version's weights, where they differ from the current) and `logp_ref` (EMA)."""
        if not rl:
            return
        by_version: dict[str, list[int]] = {}
        for i, r in enumerate(prepared):
            if r.policy_version and r.policy_version != self.weights_version:
                by_version.setdefault(r.policy_version, []).append(i)
        for version, indices in sorted(by_version.items()):
            state = self._weights_of(version)
            if state is None:
                self.counters["old_weights_missing"] += len(indices)
                continue
            with self._weights(state):
                self._fill_logp_old([prepared[i] for i in indices])
        if self.config.epochs > 1:
            # Later epochs move the weights: the current weights' logprobs are the old ones only for the first.
            self._fill_logp_old([r for r in prepared if r.logp_old is None])
        if self.config.kl_coef > 0:
            with self._weights(self.ema):
                for idx, mb in self._batches(prepared):
                    logp, _ = self._logprobs(mb, with_entropy=False, grad=False)
                    for j, (s, e) in zip(idx, mb.record_slices, strict=True):
                        prepared[j].logp_ref = logp[s:e].tolist()

    def _fill_logp_old(self, records: list[PreparedRecord]) -> None:
        """Set `logp_old` of `records` to the logprobs under the weights loaded now."""
        for idx, mb in self._batches(records):
            logp, _ = self._logprobs(mb, with_entropy=False, grad=False)
            for j, (s, e) in zip(idx, mb.record_slices, strict=True):
                records[j].logp_old = logp[s:e].tolist()

    def _set_lr(self) -> float:
        """Put this step's lr (`learner.lr_decay_steps`) into the optimiser; a function of the step alone, so a
        resumed learner continues the schedule from its checkpointed step with nothing else saved."""
        lr = scheduled_lr(self.config, self.step)
        for group in base_optimizer(self.engine).param_groups:
            group["lr"] = lr
        return lr

    def _later_epochs(self, screened: Screened, mine: list[int]) -> tuple[int, _Passes | None]:
        """Epochs 2..`epochs` of a GRPO step on the same records (`mine`, less what the first pass
        quarantined): their ratios are against the fixed `logp_old`, so the clip bounds the step. A later
        update that is not finite is skipped and ends the step's epochs. Returns the epochs applied and
        the last epoch's passes (None when there was only the first)."""
        epochs, last = 1, None
        while epochs < self.config.epochs:
            last = self._forward_backward(screened, mine, rl=True)
            self.engine.step()
            if not self.engine.was_step_applied():
                self.counters["nonfinite_steps"] += 1
                logger.error(
                    "%s: non-finite gradients in epoch %d, later epochs skipped", self.config.policy, epochs + 1
                )
                break
            epochs += 1
        return epochs, last

    def _step(
        self,
        records: list[TrainingRecord],
        objective: str,
        extra: dict[str, Any],
        start: float,
        origins: Sequence[Origin] | None = None,
    ) -> StepReport:
        cfg = self.config
        rl = objective == "grpo"
        t0 = time.perf_counter()
        if origins is None:
            origins = [Origin(None, getattr(r, "policy_version", None), i) for i, r in enumerate(records)]
        screened = self._screen(records, origins, rl)
        self._record_quarantine(screened.quarantined)  # written before the step: kept whatever happens next
        quarantined = list(screened.quarantined)
        prepared = screened.prepared
        if not prepared:
            return self._no_step(extra, start, quarantined)
        mine = self._share(prepared)
        # ZeRO-3 gathers the base weights layer by layer in every forward, a collective: the ranks of a
        # group must forward in lockstep, so each recomputes the whole batch (the same passes everywhere).
        self._recompute(prepared if self._lockstep else [prepared[i] for i in mine], rl)
        t1 = time.perf_counter()
        passes = self._forward_backward(screened, mine, rl)
        t2 = time.perf_counter()
        lr = self._set_lr()
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        self._record_quarantine(passes.blamed)
        quarantined += passes.blamed
        if not self.engine.was_step_applied():
            # DeepSpeed skips the update on non-finite gradients (and clears them): no step is taken.
            self.counters["nonfinite_steps"] += 1
            logger.error("%s: non-finite gradients, optimiser step skipped (%s)", cfg.policy, passes.stats.summary())
            fault = {"fault": "nonfinite_gradients", "step": self.step + 1}
            return self._no_step({**extra, "nonfinite_gradients": 1}, start, quarantined, [fault])
        te = time.perf_counter()
        epochs, last = self._later_epochs(screened, [i for i in mine if i not in passes.excluded]) if rl else (1, None)
        te = time.perf_counter() - te
        self.step += 1
        self.weights_version = None
        self._update_ema()
        t3 = time.perf_counter()
        faults: list[dict[str, Any]] = []
        published = self._publish_in_step(faults)
        t4 = time.perf_counter()
        checkpoint = self._checkpoint_in_step(faults)
        t5 = time.perf_counter()
        trained = [r for k, r in enumerate(prepared) if k not in passes.excluded]
        trained_tokens = sum(len(r.completion_ids) for r in trained)
        self.counters["records_trained"] += len(trained)
        self.counters["tokens_trained"] += trained_tokens
        metrics: dict[str, Any] = {
            "objective": objective,
            "loss": passes.loss,
            **passes.stats.summary(),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "records": len(trained),
            "tokens": trained_tokens,
            "padded_tokens": passes.padded_tokens,
            "micro_batches": passes.micro_batches,
            "time_recompute_s": t1 - t0,
            "time_fwd_bwd_s": t2 - t1,
            "time_optimizer_s": t3 - t2 - te,
            "time_publish_s": t4 - t3,
            "time_checkpoint_s": t5 - t4,
            "time_step_s": t5 - start,
            "quarantined": len(quarantined),
            **extra,
        }
        metrics["tokens_per_s"] = trained_tokens / max(metrics["time_step_s"], 1e-9)
        if cfg.epochs > 1 and rl:
            # What the clip saw in the last epoch: how far the earlier epochs had moved the policy.
            metrics.update(epochs=epochs, time_epochs_s=te)
            if last is not None:
                summary = last.stats.summary()
                metrics.update({f"last_{k}": v for k, v in summary.items() if k.startswith(("ratio", "clip_frac"))})
        if self.dist.grouped:
            metrics["ranks"] = self.dist.world_size
        return self._report(
            StepReport(
                policy=cfg.policy,
                step=self.step,
                trained=True,
                version=self.version,
                published=published,
                checkpoint=checkpoint,
                faults=faults,
                quarantined=_origins(quarantined),
                metrics=metrics,
            )
        )

    def _forward_backward(self, screened: Screened, mine: list[int], rl: bool) -> _Passes:
        """Forward and backward over this rank's micro-batches, gradients accumulated for one optimiser step.

        A micro-batch whose loss is not finite is searched for the records that cause it (`_blame`): they
        are left out of the step and quarantined, the rest of the micro-batch trains. With a learner group
        every rank back-propagates as many times (ZeRO reduces gradients in each backward: a rank with
        fewer micro-batches adds empty ones, real passes at ZeRO-3), its loss scaled by the number of
        ranks (DeepSpeed averages over them), and the figures returned are the whole group's.
        """
        cfg = self.config
        prepared = screened.prepared
        total_tokens = sum(len(r.completion_ids) for r in prepared)
        own = [prepared[i] for i in mine]
        batches = [([mine[j] for j in idx], mb) for idx, mb in self._batches(own, cfg.grad_accum)] if own else []
        steps = self.dist.max_int(len(batches))
        scale = self.dist.world_size
        stats = LossStats()
        loss_total = 0.0
        excluded: set[int] = set()
        blamed_entries: list[dict[str, Any]] = []
        self.engine.train()
        for i, (idx, mb) in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(i == steps - 1)
            logp, entropy = self._logprobs(mb, with_entropy=rl, grad=True)
            loss, part = self._micro_loss(mb, logp, entropy, rl, total_tokens)
            if not torch.isfinite(loss):
                blamed = self._blame(mb, logp, entropy, rl, total_tokens)
                if blamed:
                    for j in blamed:
                        excluded.add(idx[j])
                        blamed_entries.append(
                            _quarantine_entry(
                                "nonfinite_loss",
                                f"{cfg.policy} step {self.step + 1}: the record's own loss is not finite "
                                f"({loss.item()} for its micro-batch)",
                                screened.origins[idx[j]],
                                screened.records[idx[j]],
                            )
                        )
                    keep = [t for j, (s, e) in enumerate(mb.record_slices) if j not in blamed for t in range(s, e)]
                    tokens = torch.tensor(keep, dtype=torch.long, device=logp.device)
                    loss, part = self._micro_loss(mb, logp, entropy, rl, total_tokens, tokens)
                else:
                    logger.error(
                        "%s step %d: non-finite loss in micro-batch %d that no record explains (%s)",
                        cfg.policy,
                        self.step + 1,
                        i,
                        part.summary(),
                    )
            self.engine.backward(loss * scale if scale > 1 else loss)
            loss_total += float(loss.detach())
            stats.merge(part)
        for i in range(len(batches), steps):
            self.engine.set_gradient_accumulation_boundary(i == steps - 1)
            if self._lockstep:  # a real pass (its gathers match the other ranks'), contributing nothing
                pad = batches[0][1] if batches else self._batches([prepared[0]])[0][1]
                logp, _ = self._logprobs(pad, with_entropy=False, grad=True)
                self.engine.backward(logp.sum() * 0.0)
            else:
                self.engine.backward(sum((p * 0.0).sum() for p in lora_parameters(self.module).values()))
        counts = [sum(mb.padded_tokens for _, mb in batches), len(batches)]
        if self.dist.grouped:  # the whole group's figures, and the records any rank quarantined
            blamed_entries, excluded, stats = self._gather_step(screened, blamed_entries, excluded, stats)
            loss_total, *summed = self.dist.sum_floats([loss_total, *counts])
            counts = [int(c) for c in summed]
        return _Passes(loss_total, stats, excluded, blamed_entries, int(counts[0]), int(counts[1]))

    @property
    def _lockstep(self) -> bool:
        """Whether every rank must run the same forward passes: a ZeRO-3 group (its weights are gathered in each)."""
        return self.dist.grouped and self.config.zero_stage == 3

    def _share(self, prepared: Sequence[PreparedRecord]) -> list[int]:
        """Indices of the records this rank trains: all of them alone, else its share by tokens (prompts kept whole)."""
        if not self.dist.grouped:
            return list(range(len(prepared)))
        costs = [r.length for r in prepared]
        keys = [tuple(r.prompt_ids) for r in prepared]
        return split_by_tokens(costs, keys, self.dist.world_size)[self.dist.rank]

    def _gather_step(
        self, screened: Screened, entries: list[dict[str, Any]], excluded: set[int], stats: LossStats
    ) -> tuple[list[dict[str, Any]], set[int], LossStats]:
        """The whole group's quarantined records (every rank, rank 0 writes them) and loss statistics."""
        everywhere = self.dist.union(excluded, len(screened.prepared))
        for i in sorted(everywhere - excluded):
            entries.append(
                _quarantine_entry(
                    "nonfinite_loss",
                    f"{self.config.policy} step {self.step + 1}: the record's own loss is not finite (another rank)",
                    screened.origins[i],
                    screened.records[i],
                )
            )
        merged = LossStats()
        for part in self.dist.all_plain(asdict(stats)):
            merged.merge(LossStats(**part))
        return entries, everywhere, merged

    def _micro_loss(
        self,
        mb: MicroBatch,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        rl: bool,
        total_tokens: int,
        tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        """The micro-batch's share of the step loss, over all its tokens or only the positions `tokens`."""
        cfg = self.config

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if tokens is None else t.index_select(0, tokens)

        if not rl:
            return nll_loss(pick(logp), total_tokens=total_tokens)
        lp = pick(logp)
        old = pick(mb.logp_old)
        has_ref = cfg.kl_coef > 0
        return grpo_loss(
            lp,
            torch.where(torch.isnan(old), lp.detach(), old),
            pick(mb.behaviour),
            pick(mb.advantages),
            total_tokens=total_tokens,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap,
            entropy=pick(entropy) if entropy is not None else None,
            entropy_coef=cfg.entropy_coef,
            logp_ref=pick(mb.logp_ref) if has_ref else None,
            kl_coef=cfg.kl_coef,
        )

    @torch.no_grad()
    def _blame(
        self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None, rl: bool, total_tokens: int
    ) -> set[int]:
        """Positions (in `mb.record_slices`) of the records whose own loss is not finite.

        Every term of the loss is a sum over tokens, so a non-finite micro-batch loss has at least one
        such record. Empty when every record's logprobs are themselves non-finite: then the weights
        (or the engine) are at fault, not the data, and quarantining the batch would lose good records.
        """
        logp = logp.detach()
        entropy = entropy.detach() if entropy is not None else None
        bad: set[int] = set()
        for j, (s, e) in enumerate(mb.record_slices):
            tokens = torch.arange(s, e, device=logp.device)
            loss, _ = self._micro_loss(mb, logp, entropy, rl, total_tokens, tokens)
            if not torch.isfinite(loss):
                bad.add(j)
        if bad and all(not torch.isfinite(logp[s:e]).all() for s, e in mb.record_slices):
            return set()
        return bad

    def _record_quarantine(self, quarantined: list[dict[str, Any]]) -> None:
        if not quarantined:
            return
        self.counters["quarantined"] += len(quarantined)
        for entry in quarantined:
            logger.warning("%s: quarantined a record (%s): %s", self.config.policy, entry["reason"], entry["error"])
        self._quarantine(quarantined)

    def _publish_in_step(self, faults: list[dict[str, Any]]) -> str | None:
        """Publish at the cadence, or now if the last try failed; a storage failure becomes a fault."""
        if not (self._publish_due or self.step % self.config.publish_every == 0):
            return None
        try:
            name = self.publish()
        except (OSError, AdapterError) as err:
            self._publish_due = True
            self.counters["publish_failures"] += 1
            logger.error(
                "%s step %d: publish failed, retried after the next step (%s)", self.config.policy, self.step, err
            )
            faults.append({"fault": "publish_failed", "step": self.step, "error": f"{type(err).__name__}: {err}"[:500]})
            return None
        self._publish_due = False
        return name

    def _checkpoint_in_step(self, faults: list[dict[str, Any]]) -> str | None:
        """Checkpoint at the cadence, or now if the last try failed; a storage failure becomes a fault."""
        every = self.config.checkpoint_every
        if not (self._checkpoint_due or (every and self.step % every == 0)):
            return None
        try:
            path = str(self.save_checkpoint())
        except OSError as err:
            self._checkpoint_due = True
            self.counters["checkpoint_failures"] += 1
            logger.error(
                "%s step %d: checkpoint failed, retried after the next step (%s)", self.config.policy, self.step, err
            )
            faults.append(
                {"fault": "checkpoint_failed", "step": self.step, "error": f"{type(err).__name__}: {err}"[:500]}
            )
            return None
        self._checkpoint_due = False
        return path

    def _no_step(
        self,
        extra: dict[str, Any],
        start: float,
        quarantined: Sequence[dict[str, Any]] = (),
        faults: Sequence[dict[str, Any]] = (),
    ) -> StepReport:
        metrics = {"tokens": 0, "time_step_s": time.perf_counter() - start, "quarantined": len(quarantined), **extra}
        report = StepReport(
            policy=self.config.policy,
            step=self.step,
            trained=False,
            version=self.version,
            faults=list(faults),
            quarantined=_origins(quarantined),
            metrics=metrics,
        )
        return self._report(report)

    def _report(self, report: StepReport) -> StepReport:
        """Log the step to the learner's own metrics file and return it (with this process's pid)."""
        report.pid = os.getpid()
        self._log(report.record())
        return report

    @torch.no_grad()
    def _update_ema(self) -> None:
        decay = self.config.ema_decay
        if decay == 1.0:  # a fixed reference: the weights the learner started from
            return
        for name, value in lora_state(self.peft).items():
            self.ema[name].mul_(decay).add_(value, alpha=1.0 - decay)

    def _log(self, metrics: dict[str, Any]) -> None:
        """Append to the learner's own metrics file; a failing write (full disk) is logged, never raised.

        The metrics also return to the driver, whose `metrics.jsonl` is the run's record.
        """
        if not self.dist.writer:
            return
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with self.metrics_path.open("a") as fh:
                fh.write(json.dumps({"time": time.time(), "policy": self.config.policy, **metrics}) + "\n")
        except OSError as err:
            logger.error("%s: could not append to %s (%s)", self.config.policy, self.metrics_path, err)

    # ------------------------------------------------------------------ checkpoint state
    def _state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "weights_version": self.weights_version,
            "min_version": self.versions.min_version,
            "counters": dict(self.counters),
            "ema": {k: v.clone() for k, v in self.ema.items()},
            "rng": rng_state(),
            "config": asdict(self.config),
        }

    def _restore(self, checkpoint: Checkpoint) -> None:
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
            restore_engine_state(self.engine, read_state(checkpoint.path, ENGINE_STATE))
        else:  # this rank's ZeRO partition and its own RNG states
            part = read_state(checkpoint.path, _rank_state(self.dist.rank))
            restore_engine_state(self.engine, part["engine"])
            rng = part["rng"]
        self.step = int(state["step"])
        self.versions.restore(state)
        self.weights_version = state["weights_version"]
        self.counters.update(state["counters"])
        self.ema = {k: v.float() for k, v in state["ema"].items()}
        restore_rng_state(rng)
        self.last_checkpoint = checkpoint.path
        logger.info("restored %s from %s (step %d)", self.config.policy, checkpoint.path, self.step)

    def _continue_numbering(self) -> None:
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
                self.metrics_path,
                self.metrics_path.with_name("metrics.superseded.jsonl"),
                lambda r: int(r.get("step", 0)) > self.step,
            )
            latest = self.store.latest(self.config.policy)
            if latest is not None and self.version is not None and latest.name != self.version:
                lost = latest.name
        if not self.dist.broadcast_int(int(lost is not None)):  # rank 0 decides; every rank publishes
            return
        restored_weights = self.weights_version
        self.publish()
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
            self.version,
        )


def _rank_state(rank: int) -> str:
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


def _quarantine_entry(reason: str, error: str, origin: Origin, record: Any) -> dict[str, Any]:
    """One quarantine line: why, where the record came from, and the record itself (so nothing is lost)."""
    return {"reason": reason, "error": error[:1000], **asdict(origin), "record": _plain(record)}


def _origins(quarantined: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reason and origin of each quarantined record, without the record (the quarantine file keeps it)."""
    return [{k: v for k, v in e.items() if k != "record"} for e in quarantined]


def _plain(obj: Any) -> Any:
    """A record or group as JSON-ready data for the quarantine file (whatever it is: nothing is lost)."""
    return asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else obj


def learner_actor(
    config: LearnerConfig,
    run_dir: str | Path,
    adapter_root: str | Path,
    registry: str | None = None,
    name: str | None = None,
    namespace: str | None = None,
    queue: str | None = None,
    resources: dict[str, float] | None = None,
) -> Any:
    """The Ray actor form: named `learner-<policy>` (get-if-exists), restarted forever, tasks retried.

    A restarted actor runs `__init__` again and so resumes from its newest good checkpoint; a retried
    `train_next` then trains the batch it was training again (kept on disk, see `diprl.learn.intake`),
    so a killed learner loses none. `queue` names the policy's queue actor it pulls its batches from. It asks for one
    GPU when `config.use_gpu`, else one CPU with DeepSpeed on its CPU accelerator. The GPU is a whole one:
    Ray never hands a fraction of it to a PolicyServer replica (`python -m diprl.plan` counts the same way).
    `resources` (custom resources, `placement.learner`) keep it on the nodes that declare them, restarts too.
    With `config.ranks` > 1 it is a `diprl.learn.group.LearnerGroup` of that many ranks with the same API.
    """
    import ray

    if config.ranks > 1:
        from diprl.learn.group import group_actor

        return group_actor(
            config, run_dir, adapter_root, registry, name or f"learner-{config.policy}", namespace, queue, resources
        )
    env = {"DS_BUILD_OPS": "0"} if config.use_gpu else {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    options: dict[str, Any] = {
        "name": name or f"learner-{config.policy}",
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 1,
        "num_gpus": 1 if config.use_gpu else 0,
        "runtime_env": {"env_vars": env},
    }
    if namespace is not None:
        options["namespace"] = namespace
    if resources:
        options["resources"] = dict(resources)
    remote_cls: Any = ray.remote(Learner)
    return remote_cls.options(**options).remote(config, str(run_dir), str(adapter_root), registry, queue)
