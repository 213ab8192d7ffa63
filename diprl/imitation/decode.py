"""The policy's greedy order set for a state: transformers' `generate` under the `OrderConstraint`.

Agreement asks what the policy would play at temperature 0. Three ways were open: the learner's own
scoring (`Learner.score`) ranks given completions but cannot produce one (the legal order sets of a
movement phase are a product over units, far too many to score); vLLM in-process through the
PolicyServer's logits processor is the served path, but it is a second engine with its own start-up
(about 15 s on CPU) and memory beside the learner, and it needs the weights on disk; `generate`
decodes the learner's model as it is in memory, with the KV cache, batching, left padding and stopping
that transformers already does. The constraint is the same `OrderConstraint` and the same one-scatter
mask (`diprl.policy.logprobs.mask_rows_`) that the vLLM processor applies, and the CPU models are
float32, where greedy output of transformers and vLLM is identical; so `generate` with a logits
processor is the simplest correct choice, and what it measures is what the server would write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diprl.game import PowerOrders
from diprl.imitation.teacher import TeacherExample
from diprl.policy.constraint import OrderConstraint
from diprl.policy.logprobs import constrained_greedy
from diprl.policy.vocab import TokenTable


def greedy_completions(
    model: Any,
    examples: Sequence[TeacherExample],
    table: TokenTable,
    pad_id: int,
    batch_size: int = 32,
    max_new_tokens: int = 384,
) -> list[list[int]]:
    """The model's greedy completion ids for each example's prompt under its legal orders (EOS included).

    Batched by similar prompt length (less padding), returned in the examples' order.
    """
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].prompt_ids))
    out: list[list[int]] = [[] for _ in examples]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        constraints = [OrderConstraint(PowerOrders.from_dict(examples[i].legal), table) for i in rows]
        completions, _ = constrained_greedy(
            model, [examples[i].prompt_ids for i in rows], constraints, table.eos_id, pad_id, max_new_tokens
        )
        for i, completion in zip(rows, completions, strict=True):
            out[i] = completion
    return out
