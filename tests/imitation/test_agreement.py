"""Agreement: the metric checked by hand, and the greedy constrained decode it scores checked against a
plain argmax loop (no cache, no padding) and against the PolicyServer's engine at temperature 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.imitation.agreement import agreement
from diprl.imitation.data import TeacherData
from diprl.imitation.decode import greedy_completions
from diprl.imitation.teacher import TeacherExample, ordered_lines, teacher_completion
from diprl.messages import GenerationRequest
from diprl.policy.constraint import OrderConstraint
from diprl.policy.vocab import TokenTable
from diprl.torch_threads import set_torch_threads


def _example(legal: PowerOrders, orders: list[str], tok: tuple[Any, TokenTable]) -> TeacherExample:
    tokenizer, table = tok
    ids = teacher_completion(legal, orders, tokenizer, table)
    return TeacherExample(
        0, 0, "heldout", legal.power, legal.phase, legal.kind.value, [], ids, legal.to_dict(),
        ordered_lines(legal, orders), "dumbbot", "dumbbot", True,
    )  # fmt: skip


def test_agreement_by_hand(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    france = DiplomacyGame().legal_orders("FRANCE")
    build = PowerOrders(
        "FRANCE", "W1901A", PhaseKind.BUILD, {"BRE": ("A BRE B", "F BRE B"), "PAR": ("A PAR B",)}, n_required=2
    )
    examples = [
        _example(france, ["F BRE - MAO", "A MAR H", "A PAR - BUR"], tok),
        _example(build, ["F BRE B", "WAIVE"], tok),
    ]
    policy = [
        teacher_completion(france, ["F BRE - MAO", "A MAR - SPA", "A PAR - BUR"], tokenizer, table),  # 2 of 3
        teacher_completion(build, ["WAIVE", "A PAR B"], tokenizer, table),  # the WAIVE matches: 1 of 2
    ]
    result = agreement(examples, policy, table)
    assert result.per_unit == pytest.approx(3 / 5)
    assert result.exact == 0.0
    assert result.by_kind == {"movement": pytest.approx(2 / 3), "build": 0.5}
    assert result.units_by_kind == {"movement": 3, "build": 2}
    same = agreement(examples, [e.completion_ids for e in examples], table)
    assert (same.per_unit, same.exact, same.incomplete) == (1.0, 1.0, 0)
    cut = agreement(examples[:1], [policy[0][:-1]], table)  # no EOS: counted as incomplete
    assert cut.incomplete == 1
    with pytest.raises(ValueError, match="1 examples but 2 completions"):
        agreement(examples[:1], policy, table)


def _argmax_loop(model: Any, example: TeacherExample, table: TokenTable) -> list[int]:
    """The greedy constrained completion the slow, obvious way: the whole sequence forwarded each step."""
    import torch

    constraint = OrderConstraint(PowerOrders.from_dict(example.legal), table)
    out: list[int] = []
    with torch.no_grad():
        while not out or out[-1] != table.eos_id:
            logits = model(input_ids=torch.tensor([example.prompt_ids + out])).logits[0, -1]
            allowed = constraint.allowed_token_ids(out)
            out.append(int(allowed[int(np.argmax(logits[torch.from_numpy(allowed)].numpy()))]))
    return out


@pytest.fixture(scope="module")
def lora_model() -> Any:
    """A tiny model whose LoRA weights are random (not the base's B = 0), so the decode is not trivial."""

    from diprl.policy.models import random_lora_model

    set_torch_threads(1)
    return random_lora_model(seed=3)


def _mixed(data: TeacherData) -> list[TeacherExample]:
    """Held-out states of every phase kind, prompts of different lengths (left padding matters)."""
    pool = data.train + data.heldout
    picked = []
    for kind in ("movement", "retreat", "build", "disband"):
        picked += [e for e in pool if e.kind == kind][:2]
    return picked


def test_the_greedy_decode_is_the_argmax_under_the_constraint(lora_model: Any, data: TeacherData, tok: Any) -> None:
    _, table = tok
    examples = _mixed(data)
    assert len({len(e.prompt_ids) for e in examples}) > 1 and {e.kind for e in examples} >= {"movement", "build"}
    batched = greedy_completions(lora_model, examples, table, pad_id=0, batch_size=8)
    assert batched == [_argmax_loop(lora_model, e, table) for e in examples]
    for example, completion in zip(examples, batched, strict=True):
        constraint = OrderConstraint(PowerOrders.from_dict(example.legal), table)
        constraint.masks_for(completion)
        assert constraint.done and completion[-1] == table.eos_id
    # Batch composition does not change a row: one at a time gives the same completions.
    assert [greedy_completions(lora_model, [e], table, pad_id=0)[0] for e in examples[:3]] == batched[:3]


@pytest.mark.slow
def test_the_greedy_decode_is_what_the_policy_server_writes_at_temperature_zero(
    data: TeacherData, tok: Any, tmp_path: Path
) -> None:
    """The same adapter, served by the PolicyServer's engine (vLLM, the V1 logits processor) with
    temperature 0, writes token for token what `greedy_completions` decodes."""
    from diprl.inference.adapters import AdapterStore
    from diprl.inference.config import ServerConfig
    from diprl.learn.config import LearnerConfig
    from diprl.learn.model import base_model_name, build_peft_model
    from diprl.policy.models import load_preset, random_lora_model, resolve_model_path
    from tests.inference.lora_fixtures import serve_in_process

    _, table = tok
    preset = load_preset("tiny")
    store = AdapterStore(tmp_path / "adapters")
    version = str(store.publish("greedy", random_lora_model(seed=5), base_model=base_model_name(preset)))
    model = build_peft_model(preset, LearnerConfig(), store.resolve(version).path)
    examples = _mixed(data)
    local = greedy_completions(model, examples, table, pad_id=0)

    requests = [
        GenerationRequest(policy=version, prompt=list(e.prompt_ids), legal=e.legal, temperature=0.0) for e in examples
    ]
    config = ServerConfig(
        model=str(resolve_model_path(preset)),
        dtype="float32",
        adapter_root=str(store.root),
        max_num_seqs=8,
    )

    served = serve_in_process(config, requests)
    assert all(r.error is None for r in served), [r.error for r in served]
    assert [list(r.token_ids) for r in served] == local
