"""`Learner`: GRPO (and behaviour cloning) on a LoRA adapter with DeepSpeed; publishes `<policy>@v<N>`.

One `train_step(groups)` is one optimiser step:

1. **Staleness.** Each group's `policy_version` must be a version of this policy no more than
   `max_policy_lag` versions behind the current one; older groups (and groups of other policies)
   are dropped and counted, never trained on.
2. **Masks.** Every record's constraint masks are rebuilt from its legal orders (`batching`).
3. **Recompute** (no gradient). Where the current weights are not those of the version that
   sampled a record, the trainer's logprobs under that version's weights (`logp_old`, from an
   in-memory snapshot or the AdapterStore) so the PPO ratio sees policy change and the truncated
   importance weight sees only engine drift (see `diprl.learn.loss`); with `kl_coef` > 0, the
   logprobs under the EMA of the LoRA weights (the KL reference).
4. **Forward/backward** over micro-batches packed by a token budget, gradients accumulated, the loss
   normalised by the step's total completion tokens.
5. **Optimiser** step (grad-norm clipping by DeepSpeed), EMA update, then publishing and
   checkpointing at their cadences.

Weights swapped in for a no-gradient pass are copied back exactly; ZeRO's fp32 master copies are
never touched, so swaps cannot leak into training.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diprl.inference.adapters import AdapterError, AdapterStore, InvalidAdapterName, parse_policy_ref
from diprl.learn.batching import MicroBatch, PreparedRecord, micro_batches, prepare_record
from diprl.learn.checkpoint import Checkpoint, CheckpointDir, Restored
from diprl.learn.config import LearnerConfig
from diprl.learn.loss import LossStats, grpo_loss, nll_loss
from diprl.learn.model import (
    CompletionHidden,
    base_model_name,
    build_peft_model,
    completion_logprobs,
    load_lora_state_,
    lora_state,
    make_engine,
    read_adapter_dir,
)
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table

logger = logging.getLogger(__name__)

OBJECTIVES = ("grpo", "bc")
STATE_FILE = "learner_state.pt"


class Learner:
    """The learner of one trained policy. Plain class; `learner_actor` makes it a restartable Ray actor.

    On construction it restores the newest checkpoint under `run_dir/checkpoints/<policy>/` that
    verifies (corrupt or partial ones are skipped with a warning), or else starts a fresh LoRA (or
    the `init_adapter` warm start) and publishes it as the policy's first version.
    """

    def __init__(
        self, config: LearnerConfig, run_dir: str | Path, adapter_root: str | Path, registry: str | None = None
    ) -> None:
        self.config = config
        self.preset = load_preset(config.model)
        self.run_dir = Path(run_dir)
        self.store = AdapterStore(adapter_root)
        self.registry_name = registry
        self._registry: Any = None
        tokenizer = load_tokenizer(resolve_model_path(self.preset))
        self.vocab_size = self.preset.tiny.vocab_size if self.preset.tiny is not None else None
        self.table = token_table(tokenizer, self.vocab_size)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        self.checkpoints = CheckpointDir(self.run_dir / "checkpoints" / config.policy, keep=config.keep_checkpoints)
        self.metrics_path = self.run_dir / "learner" / config.policy / "metrics.jsonl"

        self.step = 0
        self.version: str | None = None  # latest published "<policy>@v<N>"
        self.weights_version: str | None = None  # the published version the current weights equal, if any
        self.min_version = 1  # versions below this predate a reset: never trained on
        self.counters: dict[str, int] = {
            "groups_trained": 0,
            "records_trained": 0,
            "tokens_trained": 0,
            "dropped_stale": 0,
            "dropped_foreign": 0,
            "old_weights_missing": 0,
            "resets": 0,
            "nonfinite_steps": 0,
        }
        self._snapshots: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.restored: Restored = self.checkpoints.newest_good()
        self.last_checkpoint: Path | None = None

        init_dir = None if self.restored.checkpoint is not None else self._init_adapter_dir()
        self._build(init_dir, seed=config.seed)
        if self.restored.checkpoint is not None:
            self._restore(self.restored.checkpoint)
        else:
            self.publish()

    # ------------------------------------------------------------------ building
    def _init_adapter_dir(self) -> Path | None:
        source = self.config.init_adapter
        if not source:
            return None
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

        self.peft = build_peft_model(self.preset, replace(self.config, seed=seed), adapter_dir)
        self.module = CompletionHidden(self.peft)
        self.engine = make_engine(self.module, self.config)
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
    def latest_version(self) -> str:
        assert self.version is not None
        return self.version

    def publish(self) -> str:
        """Publish the current LoRA weights as the next version of the policy (and register it if configured)."""
        if self.registry is not None:
            from diprl.inference.registry import publish_everywhere

            ref = publish_everywhere(self.store, self.config.policy, self.peft, self.registry)
        else:
            ref = self.store.publish(self.config.policy, self.peft, base_model=base_model_name(self.preset))
        self.version = ref.name
        self.weights_version = ref.name
        self._snapshots[ref.name] = lora_state(self.peft)
        while len(self._snapshots) > self.config.max_policy_lag + 1:
            self._snapshots.popitem(last=False)
        logger.info("published %s at step %d", ref.name, self.step)
        return ref.name

    def reset(self) -> str:
        """A fresh LoRA (exploiter reset): new weights, optimiser state and EMA; published as the next version.

        Groups sampled by versions before the reset are from another network and are dropped as stale.
        """
        self.counters["resets"] += 1
        self.engine.destroy()
        self._build(None, seed=self.config.seed + self.counters["resets"])
        self._snapshots.clear()
        name = self.publish()
        ref = parse_policy_ref(name)
        assert ref is not None
        self.min_version = ref.version
        return name

    def train_step(self, groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One GRPO optimiser step on the fresh-enough groups (TrajectoryGroup dicts); returns the metrics.

        With nothing left to train on (all stale), no step is taken: `step` is unchanged, `trained` 0.
        """
        start = time.perf_counter()
        records: list[dict[str, Any]] = []
        lags: list[int] = []
        stale = foreign = 0
        for group in groups:
            lag = self._lag(str(group.get("policy_version")))
            if lag is None:
                foreign += 1
                continue
            if lag > self.config.max_policy_lag:
                stale += 1
                continue
            lags.append(lag)
            for record in group.get("records", []):
                records.append(
                    record if record.get("policy_version") else {**record, "policy_version": group["policy_version"]}
                )
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
        metrics = self._step(records, "grpo", extra, start)
        self.counters["groups_trained"] += len(lags)
        return metrics

    def train_records(self, records: Sequence[dict[str, Any]], objective: str = "bc") -> dict[str, Any]:
        """One optimiser step on `records` (TrainingRecord dicts).

        `bc`: masked negative log-likelihood of the completions (imitation; behaviour logprobs and
        advantages may be absent). `grpo`: the GRPO step of `train_step`, with staleness judged per record.
        """
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        start = time.perf_counter()
        if objective == "bc":
            if not records:
                raise ValueError("train_records needs at least one record")
            return self._step(list(records), "bc", {}, start)
        return self.train_step([{"policy_version": r.get("policy_version"), "records": [r]} for r in records])

    def save_checkpoint(self) -> Path:
        """Write `step-<N>` atomically (adapter, optimiser, EMA, RNG states, step, version, counters)."""

        def write(tmp: Path) -> None:
            self.engine.save_checkpoint(
                str(tmp / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True
            )
            self.peft.save_pretrained(str(tmp / "adapter"), safe_serialization=True)
            torch.save(self._state_dict(), tmp / STATE_FILE)

        self.last_checkpoint = self.checkpoints.save(
            self.step, write, meta={"policy": self.config.policy, "step": self.step, "version": self.version}
        )
        return self.last_checkpoint

    def state(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "step": self.step,
            "version": self.version,
            "weights_version": self.weights_version,
            "min_version": self.min_version,
            "counters": dict(self.counters),
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "restored_from": str(self.restored.checkpoint.path) if self.restored.checkpoint else None,
            "skipped_checkpoints": [[str(p), why] for p, why in self.restored.skipped],
            "config": asdict(self.config),
        }

    # ------------------------------------------------------------------ the step
    def _lag(self, version: str) -> int | None:
        """Versions between `version` and the current one; None for anything not a version of this policy."""
        try:
            ref = parse_policy_ref(version)
        except InvalidAdapterName:
            return None
        current = parse_policy_ref(self.latest_version())
        if ref is None or current is None or ref.policy != self.config.policy:
            return None
        if ref.version < self.min_version:
            return self.config.max_policy_lag + 1 + (self.min_version - ref.version)
        return max(0, current.version - ref.version)

    def _prepare(self, records: Sequence[dict[str, Any]], rl: bool) -> list[PreparedRecord]:
        return [
            prepare_record(r, self.table, i, need_rl_fields=rl, max_len=self.preset.max_model_len)
            for i, r in enumerate(records)
        ]

    def _batches(self, prepared: Sequence[PreparedRecord], min_batches: int = 1) -> list[tuple[list[int], MicroBatch]]:
        return [
            (idx, mb.to(self.device))
            for idx, mb in micro_batches(prepared, self.config.micro_batch_tokens, min_batches, self.pad_id)
        ]

    def _logprobs(self, mb: MicroBatch, with_entropy: bool, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.engine if grad else self.module
        hidden = module(mb.input_ids, mb.attention_mask, mb.rows, mb.cols)
        return completion_logprobs(
            hidden,
            self.module.lm_head_weight,
            mb.targets,
            mb.temperatures,
            mb.allowed,
            chunk_tokens=self.config.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )

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
    def score(self, records: Sequence[dict[str, Any]]) -> list[list[float]]:
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
        if version in self._snapshots:
            return self._snapshots[version]
        try:
            state = read_adapter_dir(self.store.resolve(version).path, self.peft)
        except (AdapterError, OSError, ValueError) as err:
            logger.warning("no weights for %s (%s): its ratio is taken against the current weights", version, err)
            return None
        self._snapshots[version] = state
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
            subset = [prepared[i] for i in indices]
            with self._weights(state):
                for idx, mb in self._batches(subset):
                    logp, _ = self._logprobs(mb, with_entropy=False, grad=False)
                    for j, (s, e) in zip(idx, mb.record_slices, strict=True):
                        subset[j].logp_old = logp[s:e].tolist()
        if self.config.kl_coef > 0:
            with self._weights(self.ema):
                for idx, mb in self._batches(prepared):
                    logp, _ = self._logprobs(mb, with_entropy=False, grad=False)
                    for j, (s, e) in zip(idx, mb.record_slices, strict=True):
                        prepared[j].logp_ref = logp[s:e].tolist()

    def _step(
        self, records: list[dict[str, Any]], objective: str, extra: dict[str, Any], start: float
    ) -> dict[str, Any]:
        cfg = self.config
        rl = objective == "grpo"
        t0 = time.perf_counter()
        prepared = self._prepare(records, rl)
        self._recompute(prepared, rl)
        t1 = time.perf_counter()
        total_tokens = sum(len(r.completion_ids) for r in prepared)
        batches = self._batches(prepared, cfg.grad_accum)
        stats = LossStats()
        loss_total = 0.0
        self.engine.train()
        for i, (_, mb) in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            logp, entropy = self._logprobs(mb, with_entropy=rl, grad=True)
            if rl:
                logp_old = torch.where(torch.isnan(mb.logp_old), logp.detach(), mb.logp_old)
                has_ref = cfg.kl_coef > 0
                loss, part = grpo_loss(
                    logp,
                    logp_old,
                    mb.behaviour,
                    mb.advantages,
                    total_tokens=total_tokens,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    tis_cap=cfg.tis_cap,
                    entropy=entropy,
                    entropy_coef=cfg.entropy_coef,
                    logp_ref=mb.logp_ref if has_ref else None,
                    kl_coef=cfg.kl_coef,
                )
            else:
                loss, part = nll_loss(logp, total_tokens=total_tokens)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"{cfg.policy} step {self.step + 1}: non-finite loss in micro-batch {i} ({part.summary()})"
                )
            self.engine.backward(loss)
            loss_total += float(loss.detach())
            stats.merge(part)
        t2 = time.perf_counter()
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if not self.engine.was_step_applied():
            # DeepSpeed skips the update on non-finite gradients; say so loudly and take no step.
            self.counters["nonfinite_steps"] += 1
            logger.error("%s: non-finite gradients, optimiser step skipped (%s)", cfg.policy, stats.summary())
            return self._no_step({**extra, "nonfinite_gradients": 1}, start)
        self.step += 1
        self.weights_version = None
        self._update_ema()
        t3 = time.perf_counter()
        published = self.publish() if self.step % cfg.publish_every == 0 else None
        t4 = time.perf_counter()
        checkpoint = None
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            checkpoint = str(self.save_checkpoint())
        t5 = time.perf_counter()
        self.counters["records_trained"] += len(prepared)
        self.counters["tokens_trained"] += total_tokens
        metrics: dict[str, Any] = {
            "step": self.step,
            "objective": objective,
            "trained": 1,
            "published": published,
            "checkpoint": checkpoint,
            "version": self.version,
            "loss": loss_total,
            **stats.summary(),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": cfg.lr,
            "records": len(prepared),
            "tokens": total_tokens,
            "padded_tokens": sum(mb.padded_tokens for _, mb in batches),
            "micro_batches": len(batches),
            "time_recompute_s": t1 - t0,
            "time_fwd_bwd_s": t2 - t1,
            "time_optimizer_s": t3 - t2,
            "time_publish_s": t4 - t3,
            "time_checkpoint_s": t5 - t4,
            "time_step_s": t5 - start,
            **extra,
        }
        metrics["tokens_per_s"] = total_tokens / max(metrics["time_step_s"], 1e-9)
        self._log(metrics)
        return metrics

    def _no_step(self, extra: dict[str, Any], start: float) -> dict[str, Any]:
        metrics = {
            "step": self.step,
            "trained": 0,
            "published": None,
            "checkpoint": None,
            "version": self.version,
            "tokens": 0,
            "time_step_s": time.perf_counter() - start,
            **extra,
        }
        self._log(metrics)
        return metrics

    @torch.no_grad()
    def _update_ema(self) -> None:
        decay = self.config.ema_decay
        for name, value in lora_state(self.peft).items():
            self.ema[name].mul_(decay).add_(value, alpha=1.0 - decay)

    def _log(self, metrics: dict[str, Any]) -> None:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({"time": time.time(), "policy": self.config.policy, **metrics}) + "\n")

    # ------------------------------------------------------------------ checkpoint state
    def _state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "weights_version": self.weights_version,
            "min_version": self.min_version,
            "counters": dict(self.counters),
            "ema": {k: v.clone() for k, v in self.ema.items()},
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            "config": asdict(self.config),
        }

    def _restore(self, checkpoint: Checkpoint) -> None:
        _, client = self.engine.load_checkpoint(
            str(checkpoint.path / "deepspeed"),
            tag="state",
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if client is None:
            raise RuntimeError(f"{checkpoint.path}: DeepSpeed could not load its checkpoint")
        state = torch.load(checkpoint.path / STATE_FILE, map_location="cpu", weights_only=False)
        self.step = int(state["step"])
        self.version = state["version"]
        self.weights_version = state["weights_version"]
        self.min_version = int(state["min_version"])
        self.counters.update(state["counters"])
        self.ema = {k: v.float() for k, v in state["ema"].items()}
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.last_checkpoint = checkpoint.path
        latest = self.store.latest(self.config.policy)
        if latest is not None and self.version is not None and latest.name != self.version:
            logger.warning(
                "%s: restored %s at step %d, but the store's latest is %s (published after that checkpoint)",
                self.config.policy,
                self.version,
                self.step,
                latest.name,
            )
        logger.info("restored %s from %s (step %d)", self.config.policy, checkpoint.path, self.step)


def learner_actor(
    config: LearnerConfig,
    run_dir: str | Path,
    adapter_root: str | Path,
    registry: str | None = None,
    name: str | None = None,
    namespace: str | None = None,
) -> Any:
    """The Ray actor form: named `learner-<policy>` (get-if-exists), restarted forever, tasks retried.

    A restarted actor runs `__init__` again and so resumes from its newest good checkpoint; a retried
    `train_step` then trains the same groups again, so a killed learner loses none. It asks for one
    GPU when `config.use_gpu`, else one CPU with DeepSpeed on its CPU accelerator.
    """
    import ray

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
    remote_cls: Any = ray.remote(Learner)
    return remote_cls.options(**options).remote(config, str(run_dir), str(adapter_root), registry)
