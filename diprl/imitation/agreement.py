"""Order agreement with the teacher on held-out states: how much of the teacher the policy plays.

Scored on the policy's own greedy constrained decode (`diprl.imitation.decode`), i.e. on what the
PolicyServer would write at temperature 0, not on teacher-forced likelihoods.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diprl.game import PowerOrders
from diprl.imitation.teacher import PHASE_KINDS, TeacherExample, completion_orders
from diprl.policy.vocab import TokenTable


@dataclass
class Agreement:
    """Order agreement with the teacher.

    `per_unit`: over all units (movement, retreat) and adjustment slots, the fraction where the
    policy gave the teacher's order (adjustments compare the multisets of build/disband/WAIVE
    orders, since sites are chosen, not given). `exact`: the fraction of decisions whose whole
    order set equals the teacher's. `by_kind`: per-unit agreement per phase kind, `units_by_kind`
    the units (or slots) it is measured on. `incomplete`: completions that did not end in EOS.
    """

    per_unit: float
    exact: float
    units: int
    decisions: int
    by_kind: dict[str, float] = field(default_factory=dict)
    units_by_kind: dict[str, int] = field(default_factory=dict)
    incomplete: int = 0


def agreement(examples: Sequence[TeacherExample], completions: Sequence[Sequence[int]], table: TokenTable) -> Agreement:
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    if not examples:
        raise ValueError("agreement needs at least one held-out example")
    matched: Counter[str] = Counter()
    slots: Counter[str] = Counter()
    exact = incomplete = 0
    for example, completion in zip(examples, completions, strict=True):
        legal = PowerOrders.from_dict(example.legal)
        teacher = Counter(example.orders)
        policy = Counter(completion_orders(completion, table))
        if not completion or completion[-1] != table.eos_id:
            incomplete += 1
        kind = legal.kind.value
        matched[kind] += sum((teacher & policy).values())
        slots[kind] += legal.n_required
        exact += int(teacher == policy)
    units = sum(slots.values())
    return Agreement(
        per_unit=sum(matched.values()) / units,
        exact=exact / len(examples),
        units=units,
        decisions=len(examples),
        by_kind={k: matched[k] / slots[k] for k in PHASE_KINDS if slots[k]},
        units_by_kind={k: slots[k] for k in PHASE_KINDS if slots[k]},
        incomplete=incomplete,
    )


def evaluate_agreement(
    model: Any, examples: Sequence[TeacherExample], table: TokenTable, pad_id: int, batch_size: int = 32
) -> Agreement:
    """Agreement of `model`'s greedy constrained decode with the teacher on `examples`."""
    from diprl.imitation.decode import greedy_completions

    return agreement(examples, greedy_completions(model, examples, table, pad_id, batch_size), table)
