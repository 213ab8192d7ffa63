"""The learner's canary checks the previous version's completions in one forward instead of decoding: the
result is the greedy decode's, token for token and log-probability for log-probability, and a completion
that is not the new weights' greedy one sends it back to decoding."""

from __future__ import annotations

from typing import Any

import pytest

import diprl.learn.canary as learner_canary_module
from diprl.inference.canary import Canary, canary_prompts
from diprl.learn.canary import learner_canary
from diprl.policy.constraint import OrderConstraint
from diprl.policy.logprobs import verify_greedy
from diprl.policy.models import load_preset, random_lora_model, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table

OTHER_SEED = 9
"""Other weights whose greedy completions differ from `random_lora_model(1)`'s in one canary row of two, not
both (seed 2 differs in none, seed 6 in both): the rows that changed and the rows that did not are
both exercised."""


@pytest.fixture(scope="module")
def setting() -> tuple[Any, Any, list[Any], Canary]:
    """A LoRA model, its token table, the canary set and the model's canary decoded token by token."""
    preset = load_preset("tiny")
    tokenizer = load_tokenizer(resolve_model_path(preset))
    model = random_lora_model(1)
    table = token_table(tokenizer, model.config.vocab_size)
    prompts = canary_prompts(tokenizer)
    return model, table, prompts, learner_canary(model, table, prompts)


def _no_decoding(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("decoded token by token where one forward should have done")


def test_a_canary_checked_against_its_own_completions_is_the_decoded_one_without_decoding(
    setting: tuple[Any, Any, list[Any], Canary], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, table, prompts, decoded = setting
    monkeypatch.setattr(learner_canary_module, "constrained_greedy", _no_decoding)
    checked = learner_canary(model, table, prompts, previous=decoded)
    assert [i.token_ids for i in checked.items] == [i.token_ids for i in decoded.items]
    for a, b in zip(checked.items, decoded.items, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Forced tokens (one allowed id) score exactly 0 either way: the masked softmax has one entry.
    assert all(lp == 0.0 for a, b in zip(checked.items, decoded.items, strict=True)
               for lp, ref in zip(a.logprobs, b.logprobs, strict=True) if ref == 0.0)  # fmt: skip


def _same(a: Canary, b: Canary) -> bool:
    return a.same_completions(b) and all(
        x.logprobs == pytest.approx(y.logprobs, abs=1e-5) for x, y in zip(a.items, b.items, strict=True)
    )


def test_completions_of_other_weights_are_refused_and_only_those_rows_decoded(
    setting: tuple[Any, Any, list[Any], Canary], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, table, prompts, decoded = setting
    other = learner_canary(random_lora_model(OTHER_SEED), table, prompts)
    changed = [r for r, (a, b) in enumerate(zip(other.items, decoded.items, strict=True)) if a.token_ids != b.token_ids]
    assert 0 < len(changed) < len(prompts)  # else this pair of weights tests less than it should
    rows_decoded: list[int] = []
    decode = learner_canary_module.constrained_greedy

    def counted(model: Any, prompts: list[Any], *args: Any, **kwargs: Any) -> Any:
        rows_decoded.append(len(prompts))
        return decode(model, prompts, *args, **kwargs)

    monkeypatch.setattr(learner_canary_module, "constrained_greedy", counted)
    assert _same(learner_canary(model, table, prompts, previous=other), decoded)
    assert rows_decoded == [len(changed)]


def test_a_completion_that_is_not_the_greedy_one_fails_the_check(setting: tuple[Any, Any, list[Any], Canary]) -> None:
    model, table, prompts, decoded = setting
    constraints = [OrderConstraint(p.legal, table) for p in prompts]
    ids = [p.prompt_ids for p in prompts]
    completions = [list(i.token_ids) for i in decoded.items]
    assert all(r is not None for r in verify_greedy(model, ids, completions, constraints, table.eos_id))
    # One row's completion swapped for another legal order of its unit (other weights' greedy choice):
    # that row fails the check, every other row passes.
    other = learner_canary(random_lora_model(OTHER_SEED), table, prompts)
    row = next(r for r, item in enumerate(other.items) if list(item.token_ids) != completions[r])
    swapped = [list(other.items[row].token_ids) if r == row else c for r, c in enumerate(completions)]
    checked = verify_greedy(model, ids, swapped, constraints, table.eos_id)
    assert [r for r, c in enumerate(checked) if c is None] == [row]
    # A completion the constraint refuses (cut before its end, EOS appended) fails, and is not raised.
    cut = [[*c[:2], table.eos_id] if r == 0 else c for r, c in enumerate(completions)]
    assert verify_greedy(model, ids, cut, constraints, table.eos_id)[0] is None
