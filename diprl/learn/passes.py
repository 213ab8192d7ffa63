"""The forward passes of a learner: scoring, the no-gradient recompute, and a step's forward/backward.

`TrainedModel` is what every pass runs: the PEFT model (frozen base + LoRA), the `CompletionScorer`
around it and the DeepSpeed engine over that. `Passes` runs them over a step's prepared records:

- **Recompute** (no gradient): `logp_old` under the weights of the version that sampled each record,
  where those are not the current weights; with more than one epoch, under the current weights for the
  rest; with a KL term, `logp_ref` under the reference weights. Weights swapped in for a pass are copied
  back exactly; ZeRO's fp32 master copies are never touched, so swaps cannot leak into training.
- **Forward/backward** over micro-batches packed by a token budget, gradients accumulated, the loss
  normalised by the step's total completion tokens. A micro-batch whose loss is not finite is taken
  apart per record (`blame`): records whose own loss is not finite are left out and quarantined, the
  rest of the micro-batch trains. When no record can be blamed (the weights, not the data), the
  non-finite loss is back-propagated and DeepSpeed's overflow check skips the update.

In a learner group every rank forwards its share of the records (`share`, by tokens), back-propagates as
many times as the busiest rank (ZeRO reduces gradients in each backward), its loss scaled by the number
of ranks (DeepSpeed averages over them); at ZeRO-3 the ranks forward in lockstep, since each forward
gathers the partitioned weights. The figures a pass returns are the whole group's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diprl.learn.batching import MicroBatch, PreparedRecord, micro_batches
from diprl.learn.config import LearnerConfig
from diprl.learn.loss import LossStats, grpo_loss, nll_loss
from diprl.learn.model import (
    CompletionScorer,
    build_peft_model,
    init_distributed,
    load_lora_state_,
    lora_parameters,
    lora_state,
    make_engine,
)
from diprl.learn.quarantine import QuarantineEntry, Screened
from diprl.learn.ranks import Collective, RankSpec, split_by_tokens
from diprl.messages import PolicyRef
from diprl.policy.models import ModelPreset

logger = logging.getLogger(__name__)

LoraState = dict[str, torch.Tensor]


@dataclass
class TrainedModel:
    """The PEFT model, the scorer DeepSpeed wraps, its engine, and the device they live on."""

    peft: Any
    module: CompletionScorer
    engine: Any
    device: torch.device

    @classmethod
    def build(
        cls,
        preset: ModelPreset,
        config: LearnerConfig,
        rank: RankSpec | None,
        adapter_dir: Path | None,
        seed: int,
        base: Any = None,
    ) -> TrainedModel:
        """A LoRA on the preset's base (from `adapter_dir`, else fresh with `seed`) under a new engine.

        `base`: a base model loaded once and shared by several adapters (`diprl.learn.host`)."""
        if config.zero_stage == 3:
            init_distributed(config.use_gpu, rank)  # ZeRO-3 loads the base partitioned
        peft = build_peft_model(preset, replace(config, seed=seed), adapter_dir, base)
        module = CompletionScorer(peft, config.logprob_chunk_tokens)
        engine = make_engine(module, config, rank)
        return cls(peft, module, engine, next(module.parameters()).device)

    def logprobs(self, mb: MicroBatch, with_entropy: bool, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked, tempered logprobs of `mb`'s completion tokens (through the engine when training)."""
        module = self.engine if grad else self.module
        logp, entropy = module(
            mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, mb.temperatures, mb.allowed, mb.prefix,
            with_entropy, mb.free,
        )  # fmt: skip
        return logp, entropy

    @contextmanager
    def weights(self, state: LoraState) -> Iterator[None]:
        """Run the model with other LoRA weights (no gradient) inside the block; the current ones come back exactly."""
        saved = lora_state(self.peft)
        load_lora_state_(self.peft, state)
        try:
            with torch.no_grad():
                yield
        finally:
            load_lora_state_(self.peft, saved)


@dataclass
class PassResult:
    """What a step's forward and backward passes leave for the optimiser step and its report."""

    loss: float
    stats: LossStats
    excluded: set[int]  # indices into the screened records left out for a non-finite loss
    blamed: list[QuarantineEntry]  # their quarantine entries
    padded_tokens: int
    micro_batches: int


class Passes:
    """Every forward pass of one learner rank over its `TrainedModel` (see the module doc)."""

    def __init__(self, config: LearnerConfig, dist: Collective, pad_id: int, model: TrainedModel) -> None:
        self.config = config
        self.dist = dist
        self.pad_id = pad_id
        self.model = model

    # ------------------------------------------------------------------ batches and shares
    def batches(self, prepared: Sequence[PreparedRecord], min_batches: int = 1) -> list[tuple[list[int], MicroBatch]]:
        """Micro-batches for every forward pass (training, recompute, scoring): prefix trees when sharing."""
        cfg = self.config
        min_prefix = cfg.prefix_min_tokens if cfg.prefix_sharing else None
        return [
            (idx, mb.to(self.model.device))
            for idx, mb in micro_batches(prepared, cfg.micro_batch_tokens, min_batches, self.pad_id, min_prefix)
        ]

    def share(self, prepared: Sequence[PreparedRecord]) -> list[int]:
        """Indices of the records this rank trains: all of them alone, else its share by tokens (prompts kept whole)."""
        if not self.dist.grouped:
            return list(range(len(prepared)))
        costs = [r.length for r in prepared]
        keys = [tuple(r.prompt_ids) for r in prepared]
        return split_by_tokens(costs, keys, self.dist.world_size)[self.dist.rank]

    @property
    def lockstep(self) -> bool:
        """Whether every rank must run the same forward passes: a ZeRO-3 group (its weights are gathered in each)."""
        return self.dist.grouped and self.config.zero_stage == 3

    # ------------------------------------------------------------------ no-gradient passes
    @torch.no_grad()
    def score(self, prepared: Sequence[PreparedRecord]) -> list[list[float]]:
        """The loaded weights' logprob of every completion token of `prepared`."""
        out: list[list[float]] = [[] for _ in prepared]
        for idx, mb in self.batches(prepared):
            logp, _ = self.model.logprobs(mb, with_entropy=False, grad=False)
            for i, (s, e) in zip(idx, mb.record_slices, strict=True):
                out[i] = logp[s:e].tolist()
        return out

    def recompute(
        self,
        prepared: list[PreparedRecord],
        current: PolicyRef | None,
        weights_of: Callable[[PolicyRef], LoraState | None],
        reference: LoraState,
    ) -> int:
        """Fill `logp_old` (the behaviour version's weights where they are not `current`) and, with a KL term,
        `logp_ref` (the `reference` weights). Returns how many records had no old weights to be found:
        their ratio is taken against the current weights."""
        by_version: dict[PolicyRef, list[int]] = {}
        for i, r in enumerate(prepared):
            if r.policy_version != current:
                by_version.setdefault(r.policy_version, []).append(i)
        missing = 0
        for version, indices in sorted(by_version.items()):
            state = weights_of(version)
            if state is None:
                missing += len(indices)
                continue
            with self.model.weights(state):
                self._fill_logp_old([prepared[i] for i in indices])
        if self.config.epochs > 1:
            # Later epochs move the weights: the current weights' logprobs are the old ones only for the first.
            self._fill_logp_old([r for r in prepared if r.logp_old is None])
        if self.config.kl_coef > 0:
            with self.model.weights(reference):
                for r, logp in zip(prepared, self.score(prepared), strict=True):
                    r.logp_ref = logp
        return missing

    def _fill_logp_old(self, records: list[PreparedRecord]) -> None:
        """Set `logp_old` of `records` to the logprobs under the weights loaded now."""
        for r, logp in zip(records, self.score(records), strict=True):
            r.logp_old = logp

    # ------------------------------------------------------------------ the step's passes
    def forward_backward(self, screened: Screened, mine: list[int], rl: bool, step: int) -> PassResult:
        """Forward and backward over this rank's micro-batches (of the records `mine`), gradients accumulated
        for optimiser step `step`; records whose own loss is not finite are left out, for quarantine."""
        prepared = screened.prepared
        total_tokens = sum(len(r.completion_ids) for r in prepared)
        own = [prepared[i] for i in mine]
        batches = [([mine[j] for j in idx], mb) for idx, mb in self.batches(own, self.config.grad_accum)] if own else []
        steps = self.dist.max_int(len(batches))
        scale = self.dist.world_size
        stats, loss_total = LossStats(), 0.0
        excluded: set[int] = set()
        blamed: list[QuarantineEntry] = []
        engine = self.model.engine
        engine.train()
        for i, (idx, mb) in enumerate(batches):
            engine.set_gradient_accumulation_boundary(i == steps - 1)
            logp, entropy = self.model.logprobs(mb, with_entropy=rl, grad=True)
            loss, part = self._micro_loss(mb, logp, entropy, rl, total_tokens)
            if not torch.isfinite(loss):
                bad = sorted(self._blame(mb, logp, entropy, rl, total_tokens))
                why = (
                    f"{self.config.policy} step {step}: the record's own loss is not finite "
                    f"({loss.item()} for its micro-batch)"
                )
                blamed += [screened.entry(idx[j], "nonfinite_loss", why) for j in bad]
                excluded.update(idx[j] for j in bad)
                if bad:
                    kept = [t for j, (s, e) in enumerate(mb.record_slices) if j not in bad for t in range(s, e)]
                    tokens = torch.tensor(kept, dtype=torch.long, device=logp.device)
                    loss, part = self._micro_loss(mb, logp, entropy, rl, total_tokens, tokens)
                else:
                    logger.error(
                        "%s step %d: non-finite loss in micro-batch %d that no record explains (%s)",
                        self.config.policy, step, i, part.summary(),
                    )  # fmt: skip
            engine.backward(loss * scale if scale > 1 else loss)
            loss_total += float(loss.detach())
            stats.merge(part)
        for i in range(len(batches), steps):
            engine.set_gradient_accumulation_boundary(i == steps - 1)
            self._empty_backward(batches[0][1] if batches else None, prepared)
        counts = [sum(mb.padded_tokens for _, mb in batches), len(batches)]
        if self.dist.grouped:  # the whole group's figures, and the records any rank quarantined
            blamed, excluded, stats = self._gather(screened, blamed, excluded, stats, step)
            loss_total, *summed = self.dist.sum_floats([loss_total, *counts])
            counts = [int(c) for c in summed]
        return PassResult(loss_total, stats, excluded, blamed, int(counts[0]), int(counts[1]))

    def _empty_backward(self, own: MicroBatch | None, prepared: Sequence[PreparedRecord]) -> None:
        """A backward that adds nothing, for a rank with fewer micro-batches than the busiest (ZeRO reduces in
        each backward); at ZeRO-3 a real pass, so its gathers match the other ranks'."""
        if self.lockstep:
            pad = own if own is not None else self.batches([prepared[0]])[0][1]
            logp, _ = self.model.logprobs(pad, with_entropy=False, grad=True)
            self.model.engine.backward(logp.sum() * 0.0)
        else:
            self.model.engine.backward(sum((p * 0.0).sum() for p in lora_parameters(self.model.module).values()))

    def _gather(
        self, screened: Screened, blamed: list[QuarantineEntry], excluded: set[int], stats: LossStats, step: int
    ) -> tuple[list[QuarantineEntry], set[int], LossStats]:
        """The whole group's quarantined records (every rank, rank 0 writes them) and loss statistics."""
        everywhere = self.dist.union(excluded, len(screened.prepared))
        why = f"{self.config.policy} step {step}: the record's own loss is not finite (another rank)"
        blamed = [*blamed, *(screened.entry(i, "nonfinite_loss", why) for i in sorted(everywhere - excluded))]
        merged = LossStats()
        for part in self.dist.all_plain(asdict(stats)):
            merged.merge(LossStats(**part))
        return blamed, everywhere, merged

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
            logp_ref=pick(mb.logp_ref) if cfg.kl_coef > 0 else None,
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
