"""The order-constraint logits processor never raises inside the engine: a broken row fails closed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from diprl.game import DiplomacyGame
from diprl.inference.logits_processor import CONSTRAINT_KEY, OrderConstraintLogitsProcessor, constraint_args
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table

VOCAB = logits_width(load_preset("tiny"))


def _processor() -> OrderConstraintLogitsProcessor:
    """The processor as the engine builds it, minus the engine: table, device, no rows."""
    proc = object.__new__(OrderConstraintLogitsProcessor)
    proc.table = token_table(load_tokenizer(resolve_model_path(load_preset("tiny"))), VOCAB)
    proc.device = torch.device("cpu")
    proc.rows = {}
    proc.seeded = {}
    return proc


def _batch(added: list[tuple[int, dict[str, Any], list[int]]]) -> Any:
    return SimpleNamespace(
        removed=[],
        moved=[],
        added=[(i, SimpleNamespace(extra_args=args), [], out) for i, args, out in added],
    )


def test_a_constraint_that_breaks_in_the_engine_ends_its_row_only() -> None:
    """Found: `kind: none, n_required: 5` passed the old checks and raised in vLLM's loop (EngineDeadError)."""
    proc = _processor()
    legal = DiplomacyGame().legal_orders("FRANCE")
    poison = {CONSTRAINT_KEY: {"legal": {**legal.to_dict(), "kind": "none", "by_loc": {}, "n_required": 5}}}
    good_out: list[int] = []
    proc.update_state(_batch([(0, poison, []), (1, constraint_args(legal), good_out)]))  # must not raise
    logits = proc.apply(torch.zeros(2, VOCAB))
    eos = proc.table.eos_id
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]
    allowed = torch.isfinite(logits[1]).nonzero().flatten()
    assert len(allowed) > 1 and eos not in allowed.tolist()

    # Mid-request: an output token the grammar never allowed (as if state were corrupted) ends that row.
    banned = int(torch.isinf(logits[1]).nonzero()[0])
    good_out.append(banned)
    logits = proc.apply(torch.zeros(2, VOCAB))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [eos]


def test_a_seeded_row_gets_the_same_token_whatever_else_is_in_the_batch() -> None:
    """Evaluation games differ only by the policy: a seeded request's token depends on its row alone."""
    legal = DiplomacyGame().legal_orders("FRANCE")
    other = DiplomacyGame().legal_orders("ENGLAND")
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))

    def chosen(batch: list[tuple[int, dict[str, Any], list[int]]], rows: torch.Tensor, row: int) -> list[int]:
        proc = _processor()
        proc.update_state(_batch_t(batch))
        out = proc.apply(rows.clone())
        return torch.isfinite(out[row]).nonzero().flatten().tolist()

    seeded = constraint_args(legal, sample_seed=7)
    alone = chosen([(0, seeded, [])], logits[:1], 0)
    crowded = chosen(
        [(0, constraint_args(other), []), (1, constraint_args(other), []), (2, seeded, [])], logits[[1, 2, 0]], 2
    )
    assert len(alone) == 1 and alone == crowded
    unseeded = chosen([(0, constraint_args(legal), [])], logits[:1], 0)
    assert len(unseeded) > 1 and alone[0] in unseeded  # vLLM samples unseeded rows itself, among the same ids


def _batch_t(added: list[tuple[int, dict[str, Any], list[int]]]) -> Any:
    return SimpleNamespace(
        removed=[],
        moved=[],
        added=[(i, SimpleNamespace(extra_args=args, temperature=1.0), [], out) for i, args, out in added],
    )
