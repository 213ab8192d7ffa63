"""GRPO advantages and per-order token credit on groups and completions checkable by hand."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diprl.policy.vocab import TokenTable
from diprl.rollout.credit import (
    CreditAssigner,
    CreditConfig,
    group_advantages,
    order_token_spans,
    token_advantages,
)

COMPLETION = "A PAR - BUR\nA MAR S A PAR - BUR\nF BRE H\n</orders>"
ORDERS = ["A PAR - BUR", "A MAR S A PAR - BUR", "F BRE H"]
EOS = 151645  # <|im_end|>


# -------------------------------------------------------------------------------- group advantages
def test_group_advantages_by_hand() -> None:
    # mean 2; population variance ((1-2)^2 + 0 + (3-2)^2) / 3 = 2/3; std = sqrt(2/3) = 0.8165;
    # advantages (r - 2) / 0.8165 = -1.2247, 0, +1.2247.
    advantages, std = group_advantages([1.0, 2.0, 3.0])
    assert std == pytest.approx(math.sqrt(2 / 3))
    assert advantages == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)


def test_the_floor_keeps_a_bounce_from_weighing_like_five_centres() -> None:
    # One bounce of shaping: 0.1 * (-0.1) / 18 = -5.6e-4 of return in one fork of four.
    bounce = [0.0, -5.6e-4, 0.0, 0.0]
    # Five centres more in one fork: 0.9 * 5 / 18 = 0.25.
    five_centres = [0.0, 0.25, 0.0, 0.0]
    unfloored, _ = group_advantages(bounce)
    assert unfloored == pytest.approx([0.577, -1.732, 0.577, 0.577], abs=1e-3)  # the defect: full weight
    small, _ = CreditAssigner().group_advantages(bounce)
    big, big_std = CreditAssigner().group_advantages(five_centres)
    assert small is not None and big is not None
    # Below the floor (0.05) the bounce is divided by the floor: (-5.6e-4 - mean) / 0.05, about -0.0084.
    assert small == pytest.approx([(r - sum(bounce) / 4) / 0.05 for r in bounce])
    assert max(abs(a) for a in small) < 0.01
    # Five centres: std 0.108 > floor, ordinary GRPO advantages.
    assert big_std > 0.05 and big == pytest.approx([-0.577, 1.732, -0.577, -0.577], abs=1e-3)


def test_flat_group_is_skipped() -> None:
    assert group_advantages([5.0, 5.0, 5.0]) == (None, 0.0)
    assert group_advantages([5.0]) == (None, 0.0)  # a group of one compares with nothing
    advantages, std = group_advantages([1.0, 1.0 + 1e-9])  # std 5e-10 < eps
    assert advantages is None and std < 1e-6


def test_unnormalised_advantages_are_centred_returns() -> None:
    advantages, _ = group_advantages([1.0, 2.0, 3.0], normalise=False)
    assert advantages == pytest.approx([-1.0, 0.0, 1.0])


@pytest.mark.parametrize("returns", [[], [1.0, math.nan], [math.inf, 0.0]])
def test_bad_returns_are_a_clear_error(returns: list[float]) -> None:
    with pytest.raises(ValueError):
        group_advantages(returns)


# ------------------------------------------------------------------------------------ token spans
@pytest.fixture(scope="module")
def qwen() -> tuple[Any, TokenTable]:
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table

    tokenizer = load_tokenizer()
    return tokenizer, token_table(tokenizer, 151936)


def test_spans_under_the_real_tokenizer(qwen: tuple[Any, TokenTable]) -> None:
    tokenizer, table = qwen
    ids = [*tokenizer.encode(COMPLETION, add_special_tokens=False), EOS]
    pieces = [table.texts[i] for i in ids]
    assert "".join(p or "" for p in pieces) == COMPLETION and pieces[-1] is None
    owners = order_token_spans(ids, table.texts, ORDERS)
    # Rebuild each order's text from the tokens assigned to it: every character of the order (and
    # its newline) is there, and nothing else.
    for order in ORDERS:
        assert "".join(p or "" for p, o in zip(pieces, owners, strict=True) if o == order) == order + "\n"
    close = COMPLETION.index("</orders>")
    starts = [sum(len(p or "") for p in pieces[:k]) for k in range(len(pieces))]
    assert all(o is None for s, o in zip(starts, owners, strict=True) if s >= close)  # the tag's tokens
    assert owners[-1] is None  # EOS

    rewards = {"A MAR S A PAR - BUR": 1.0, "A PAR - BUR": -0.25}
    advantages = token_advantages(0.0, owners, rewards, order_coef=1.0)
    support = [a for a, o in zip(advantages, owners, strict=True) if o == "A MAR S A PAR - BUR"]
    assert len(support) >= 6 and all(a == 1.0 for a in support)
    assert all(a == 0.0 for a, o in zip(advantages, owners, strict=True) if o is None or o == "F BRE H")


def test_open_tag_newline_token_and_reasoning_lines_get_no_order_credit(qwen: tuple[Any, TokenTable]) -> None:
    # With reasoning on, the completion writes "<orders>\n" itself; Qwen merges ">\n" into one token
    # (it starts with the tag's '>', so it belongs to no order). An order-like line in the reasoning
    # must not take the order's credit.
    tokenizer, table = qwen
    text = "A PAR - BUR\nis tempting.\n<orders>\n" + COMPLETION
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [table.texts[i] or "" for i in ids]
    assert ">\n" in pieces
    owners = order_token_spans(ids, table.texts, ORDERS)
    assert owners[pieces.index(">\n")] is None
    block = text.index("<orders>\n") + len("<orders>\n")
    starts = [sum(map(len, pieces[:k])) for k in range(len(pieces))]
    assert all(o is None for s, o in zip(starts, owners, strict=True) if s < block)
    assert "".join(p for p, o in zip(pieces, owners, strict=True) if o == "A PAR - BUR") == "A PAR - BUR\n"


def test_qwen_has_no_token_merging_an_order_end_with_its_newline(qwen: tuple[Any, TokenTable]) -> None:
    # Why the merged-token case below is synthetic: Qwen's pre-tokenizer never joins a letter to a
    # newline, so no vocabulary token spans an order's last letter and the newline.
    _, table = qwen
    assert not [t for t in table.texts if t and "\n" in t and t.split("\n")[0][-1:].isalpha()]


def _synthetic(pieces: list[str]) -> tuple[list[int], TokenTable]:
    """A TokenTable whose tokens are exactly `pieces` (ids 0..n-1) plus an EOS special token."""
    texts: list[str | None] = [*dict.fromkeys(pieces), None]
    table = TokenTable.from_texts(texts, eos_id=len(texts) - 1)
    return [texts.index(p) for p in pieces] + [table.eos_id], table


def test_merged_tokens_belong_to_the_order_of_their_first_character() -> None:
    # " BUR\nA" spans the first order's end, its newline and the second order's first letter;
    # "H\n</" spans the last order's end, its newline and the close tag.
    pieces = ["A", " PAR", " - BUR\nA", " MAR S A PAR", " - BUR", "\n", "F BRE ", "H\n</", "orders>"]
    ids, table = _synthetic(pieces)
    owners = order_token_spans(ids, table.texts, ORDERS)
    assert owners == [
        "A PAR - BUR",
        "A PAR - BUR",
        "A PAR - BUR",  # first character ' ' is in A PAR - BUR
        "A MAR S A PAR - BUR",
        "A MAR S A PAR - BUR",
        "A MAR S A PAR - BUR",  # the newline ending an order is the order's
        "F BRE H",
        "F BRE H",  # first character 'H'
        None,  # the rest of the close tag
        None,  # EOS
    ]


def test_lines_that_are_not_given_orders_get_none() -> None:
    pieces = ["A PAR - BUR\n", "A PAR - BUR\n", "garbage\n", "F BRE H\n", "</orders>"]
    ids, table = _synthetic(pieces)
    # A duplicate line takes nothing (each order is matched once, first come); unknown lines neither.
    assert order_token_spans(ids, table.texts, ORDERS) == ["A PAR - BUR", None, None, "F BRE H", None, None]
    assert order_token_spans([], table.texts, ORDERS) == []
    assert order_token_spans([10_000], table.texts, ORDERS) == [None]  # out-of-table id: no text


@given(cuts=st.sets(st.integers(min_value=1, max_value=len(COMPLETION) - 1)))
def test_any_tokenisation_assigns_by_first_character(cuts: set[int]) -> None:
    bounds = [0, *sorted(cuts), len(COMPLETION)]
    pieces = [COMPLETION[a:b] for a, b in pairwise(bounds)]
    ids, table = _synthetic(pieces)
    owners = order_token_spans(ids, table.texts, ORDERS)
    lines = COMPLETION.split("\n")
    for start, owner in zip(bounds[:-1], owners[:-1], strict=True):
        line = lines[COMPLETION.count("\n", 0, start)]  # a newline belongs to the line it ends
        assert owner == (line if line in ORDERS else None)
    assert owners[-1] is None


# ----------------------------------------------------------------------------- token advantages
def test_void_down_critical_up_within_one_completion() -> None:
    # group advantage 0.5, order_coef 0.2: void support 0.5 + 0.2 * -1 = 0.3, critical support
    # 0.5 + 0.2 * 1 = 0.7, every other token keeps the group advantage 0.5.
    orders = ["A MUN - BUR", "A RUH S A MUN - BUR", "A KIE S A HOL - BEL"]
    completion = "A MUN - BUR\nA RUH S A MUN - BUR\nA KIE S A HOL - BEL\n</orders>"
    pieces = ["A MUN", " - BUR\n", "A RUH S", " A MUN - BUR", "\n", "A KIE S A", " HOL - BEL\n", "</", "orders>"]
    assert "".join(pieces) == completion
    ids, table = _synthetic(pieces)
    owners = order_token_spans(ids, table.texts, orders)
    rewards = {"A MUN - BUR": 0.0, "A RUH S A MUN - BUR": 1.0, "A KIE S A HOL - BEL": -1.0}
    advantages = token_advantages(0.5, owners, rewards, order_coef=0.2)
    assert advantages == pytest.approx([0.5, 0.5, 0.7, 0.7, 0.7, 0.3, 0.3, 0.5, 0.5, 0.5])


def test_orders_without_a_reward_count_as_zero() -> None:
    assert token_advantages(-1.0, ["X", None, "Y"], {"Y": 2.0}, order_coef=0.5) == [-1.0, -1.0, 0.0]


# ------------------------------------------------------------------------------- credit assigner
def test_credit_assigner_trains_varied_groups_and_counts_flat_ones() -> None:
    assigner = CreditAssigner(CreditConfig(order_coef=0.2))
    assert assigner.stats()["credit/skipped_fraction"] == 0.0
    advantages, std = assigner.group_advantages([1.0, 2.0, 3.0])
    assert std == pytest.approx(math.sqrt(2 / 3))
    a = 1 / math.sqrt(2 / 3)  # 1.2247
    assert advantages is not None and advantages == pytest.approx([-a, 0.0, a])
    token_orders: list[list[str | None]] = [["a", None], ["b", "b"], [None]]
    rewards = [{"a": -1.0}, {"b": 1.0}, {}]
    per_token = [
        token_advantages(g, o, r, order_coef=0.2) for g, o, r in zip(advantages, token_orders, rewards, strict=True)
    ]
    assert per_token == [pytest.approx([-a - 0.2, -a]), pytest.approx([0.2, 0.2]), pytest.approx([a])]
    assert assigner.group_advantages([5.0, 5.0, 5.0])[0] is None
    assert assigner.stats() == {"credit/groups": 2.0, "credit/groups_skipped": 1.0, "credit/skipped_fraction": 0.5}


def test_credit_assigner_scores_a_completion_from_its_ids() -> None:
    pieces = ["A PAR - BUR\n", "A MAR S A PAR - BUR\n", "F BRE H\n", "</orders>"]
    ids, table = _synthetic(pieces)
    rewards = {"A MAR S A PAR - BUR": -1.0}
    assigner = CreditAssigner(CreditConfig(order_coef=0.2))
    advantages, std = assigner.group_advantages([0.0, 1.0])  # population std 0.5 -> [-1, +1]
    assert (advantages, std) == ([-1.0, 1.0], 0.5)
    assert assigner.token_advantages(1.0, ids, table.texts, ORDERS, rewards) == pytest.approx([1.0, 0.8, 1.0, 1.0, 1.0])
    assert assigner.token_advantages(-1.0, ids, table.texts, ORDERS, rewards) == pytest.approx(
        [-1.0, -1.2, -1.0, -1.0, -1.0]
    )
    assert assigner.group_advantages([2.0, 2.0])[0] is None
    assert assigner.stats()["credit/groups_skipped"] == 1.0


def test_credit_config_is_checked() -> None:
    with pytest.raises(ValueError, match="eps"):
        CreditConfig(eps=0.0)
    with pytest.raises(ValueError, match="order_coef"):
        CreditConfig(order_coef=math.nan)
