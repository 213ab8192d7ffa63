"""vLLM V1 logits processor that applies `OrderConstraint` to each request that asks for it.

A request opts in through `SamplingParams.extra_args[CONSTRAINT_KEY]`, a dict with the power's legal
orders (`PowerOrders.to_dict()`) and optionally `reasoning_max_tokens` and `sample_seed`. Requests
without it pass through untouched, so constrained and free requests share a batch. With `sample_seed`
the token is drawn here, reproducibly whatever else is in the batch (`diprl.policy.sampling`): for
evaluation games that must differ only by the policy.

This is the interface of vLLM's V1 model runner (`update_state(BatchUpdate)`, `apply(logits)`), which
the CPU build runs. GPU builds from mid-2026 default to Model Runner V2 with another interface and
reject this class with a clear error; GPU runs therefore set `VLLM_USE_V2_MODEL_RUNNER=0` (see
`diprl.inference.engine.engine_env` and docker/Dockerfile), so CPU and GPU run the same code.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from diprl.game.legal import PowerOrders
from diprl.policy.constraint import OrderConstraint, ReasoningOptions
from diprl.policy.logprobs import mask_rows_
from diprl.policy.sampling import seeded_choice
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CONSTRAINT_KEY = "diprl_orders"
log = logging.getLogger(__name__)


def constraint_args(
    legal: PowerOrders, reasoning_max_tokens: int | None = None, sample_seed: int | None = None
) -> dict[str, Any]:
    """The `extra_args` a request needs to be decoded under the order constraint (and, seeded, sampled here)."""
    payload: dict[str, Any] = {"legal": legal.to_dict()}
    if reasoning_max_tokens is not None:
        payload["reasoning_max_tokens"] = int(reasoning_max_tokens)
    if sample_seed is not None:
        payload["sample_seed"] = int(sample_seed)
    return {CONSTRAINT_KEY: payload}


def _seed_of(payload: Any) -> int | None:
    seed = payload.get("sample_seed") if isinstance(payload, dict) else None
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"sample_seed must be a non-negative int, got {seed!r}")
    return seed


def _parse(payload: Any) -> tuple[PowerOrders, ReasoningOptions | None]:
    if not isinstance(payload, dict) or "legal" not in payload:
        raise ValueError(f"extra_args[{CONSTRAINT_KEY!r}] must be a dict with 'legal' (PowerOrders.to_dict())")
    legal = PowerOrders.from_dict(payload["legal"])
    if not legal.by_loc:
        raise ValueError(f"{legal.power} has nothing to order in {legal.phase}: no request should be made")
    budget = payload.get("reasoning_max_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ValueError(f"reasoning_max_tokens must be a non-negative int, got {budget!r}")
    return legal, None if budget is None else ReasoningOptions(max_tokens=budget)


class OrderConstraintLogitsProcessor(LogitsProcessor):
    """Masks every token the order grammar does not allow next, row by row, in one scatter.

    It never raises: an exception here is raised inside vLLM's engine loop and kills the engine for
    every request. A row whose constraint cannot be built or advanced fails closed instead: only EOS
    stays allowed, so that request ends at once (an empty or cut-off completion the server reports
    as failed) and the batch goes on. The server validates requests so this should never happen.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        if CONSTRAINT_KEY in args:
            _parse(args[CONSTRAINT_KEY])  # a clear error at the API boundary, not mid-batch
            _seed_of(args[CONSTRAINT_KEY])

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        model_config = vllm_config.model_config
        tokenizer = load_tokenizer(model_config.tokenizer)
        self.table: TokenTable = token_table(tokenizer, model_config.get_vocab_size())
        self.device = device
        self.rows: dict[int, tuple[OrderConstraint | None, list[int]]] = {}  # None: failed, EOS only
        self.seeded: dict[int, tuple[int, float]] = {}  # row -> (sample_seed, temperature)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
            self.seeded.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            args = params.extra_args or {}
            self.seeded.pop(index, None)
            if CONSTRAINT_KEY in args:
                try:
                    legal, reasoning = _parse(args[CONSTRAINT_KEY])
                    constraint: OrderConstraint | None = OrderConstraint(legal, self.table, reasoning)
                    seed = _seed_of(args[CONSTRAINT_KEY])
                    if seed is not None:
                        self.seeded[index] = (seed, float(getattr(params, "temperature", 1.0) or 0.0))
                except Exception:
                    log.exception("order constraint cannot be built; the request is ended (EOS only)")
                    constraint = None
                self.rows[index] = (constraint, output_ids)
            else:
                self.rows.pop(index, None)
        for src, dst, direction in batch_update.moved:
            for table in (self.rows, self.seeded):
                a, b = table.pop(src, None), table.pop(dst, None)
                if a is not None:
                    table[dst] = a  # type: ignore[assignment]
                if direction == MoveDirectionality.SWAP and b is not None:
                    table[src] = b  # type: ignore[assignment]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = sorted(self.rows)
        eos = np.array([self.table.eos_id], dtype=np.int64)
        allowed = [self._allowed(i, eos) for i in indices]
        # A finished request is normally retired on EOS; if a step still comes, keep EOS open
        # rather than masking the whole row (an all -inf row is NaN after softmax).
        allowed = [a if len(a) else eos for a in allowed]
        for row, (index, ids) in enumerate(zip(indices, allowed, strict=True)):
            if index in self.seeded and len(ids) > 1:
                seed, temperature = self.seeded[index]
                step = len(self.rows[index][1])
                allowed[row] = np.array([seeded_choice(logits[index], ids, temperature, seed, step)], dtype=np.int64)
        return mask_rows_(logits, indices, allowed)

    def _allowed(self, index: int, eos: np.ndarray) -> np.ndarray:
        constraint, output_ids = self.rows[index]
        if constraint is None:
            return eos
        try:
            return constraint.allowed_token_ids(output_ids)
        except Exception:
            log.exception("order constraint failed mid-request; the request is ended (EOS only)")
            self.rows[index] = (None, output_ids)
            return eos
