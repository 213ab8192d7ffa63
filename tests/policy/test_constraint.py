"""OrderConstraint: every walk through the allowed ids spells exactly one legal order per unit."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diprl.bots import make_agent
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.game.orders import parse_order
from diprl.policy.constraint import CLOSE_TAG, ConstraintViolation, OrderConstraint, ReasoningOptions
from diprl.policy.vocab import ORDER_ALPHABET, TokenTable

from .states import KINDS, legal_order_sets

# A vocabulary built to break id-based tag detection: merges across an order's end, its newline and
# the next order's start, the close tag in pieces and glued to a newline, plus every single character.
MERGES = [" PAR", " BUR", " -", " H", "H\n", "\nA", "\nF", "</", "orders", ">", "R - B", "A PAR - BUR\n", " S", " A",
          " F", "\n</", "ST", "P/", "NC", "SC", "WA", "IVE", "IVE\n", " D", " R", " B", " VIA", "MAR", " MAR", "AR",
          "\n\n", "  ", "</orders>", ">\n", "<orders>\n", "D\nA", "B\nF"]  # fmt: skip
EOS = 0
SYNTHETIC = TokenTable.from_texts([None, *sorted(ORDER_ALPHABET), *MERGES, "x", "hello", " world"], EOS, 300)


def walk(legal: PowerOrders, table: TokenTable, rng: random.Random, reasoning: ReasoningOptions | None = None) -> str:
    """Sample uniformly among allowed ids until EOS; return the decoded text (EOS excluded)."""
    constraint = OrderConstraint(legal, table, reasoning)
    ids: list[int] = []
    while True:
        allowed = constraint.allowed_token_ids(ids)
        if constraint.done:
            assert len(allowed) == 0
            break
        assert len(allowed) > 0, f"dead end after {''.join(table.texts[i] or '' for i in ids)!r}"
        assert np.all(np.diff(allowed) > 0), "allowed ids must be sorted and unique"
        ids.append(int(rng.choice(list(allowed))))
        assert len(ids) < 2000
    assert ids[-1] == table.eos_id
    return "".join(table.texts[i] or "" for i in ids[:-1])


def check_complete(text: str, legal: PowerOrders) -> list[str]:
    """The completion is n_required legal lines, each unit/site once, then the close tag."""
    assert text.endswith(CLOSE_TAG)
    body = text[: -len(CLOSE_TAG)]
    lines = body.split("\n")
    assert lines[-1] == "", f"the close tag must start a line: {text!r}"
    lines = lines[:-1]
    assert len(lines) == legal.n_required
    sites = []
    for line in lines:
        if line == "WAIVE":
            assert legal.allows_waive
            continue
        assert line in legal.loc_of, f"{line!r} is not legal in {legal.phase}"
        sites.append(legal.loc_of[line])
    assert len(sites) == len(set(sites)), f"a unit or site ordered twice: {lines}"
    assert not contradicting_own_supports(lines, legal), lines
    return lines


def contradicting_own_supports(lines: list[str], legal: PowerOrders) -> list[str]:
    """The supports of the power's own units that the supported unit's order contradicts."""
    by_province = {parse_order(line).loc: parse_order(line) for line in lines if line != "WAIVE"}
    bad = []
    for line in lines:
        support = parse_order(line) if line != "WAIVE" else None
        if support is None or support.kind != "S" or support.supported_unit[2:5] not in by_province:
            continue
        order = by_province[support.supported_unit[2:5]]
        moves_to = order.target_province if order.kind == "-" else None
        wanted = support.supported_target[:3] if support.supports_move else None
        if moves_to != wanted:
            bad.append(line)
    return bad


STATES = legal_order_sets()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(STATES) - 1), seed=st.integers(0, 2**32 - 1))
def test_random_walks_always_yield_one_legal_order_per_unit(index: int, seed: int) -> None:
    legal = STATES[index]
    check_complete(walk(legal, SYNTHETIC, random.Random(seed)), legal)


def test_states_cover_every_phase_kind() -> None:
    kinds = {lo.kind for lo in STATES}
    assert kinds == set(KINDS)
    assert any(lo.kind is PhaseKind.BUILD and lo.n_required < len(lo.locs) for lo in STATES), "fewer builds than sites"


def test_every_legal_order_can_be_generated_first() -> None:
    """Never forbid a legal order up front: each one is reachable through allowed tokens from the start."""
    legal = DiplomacyGame().legal_orders("FRANCE")
    for order in sorted(legal.loc_of):
        constraint = OrderConstraint(legal, SYNTHETIC)
        for ch in order + "\n":  # single characters are all in the vocabulary
            token = SYNTHETIC.texts.index(ch)
            assert token in constraint.allowed_token_ids(constraint._consumed), (order, ch)
            constraint.advance(token)


def test_two_units_may_move_to_the_same_province() -> None:
    legal = DiplomacyGame().legal_orders("FRANCE")
    text = "A MAR - BUR\nA PAR - BUR\nF BRE H\n" + CLOSE_TAG
    constraint = OrderConstraint(legal, SYNTHETIC)
    for ch in text:
        constraint.advance(SYNTHETIC.texts.index(ch))
    constraint.advance(EOS)
    assert constraint.done


@pytest.mark.parametrize(
    ("prefix", "bad"),
    [
        ("", "\n"),  # a blank line
        ("A PAR", "\n"),  # newline before the order is complete
        ("A PAR - BUR\nA", " PAR"),  # a second order for the same unit
        ("A PAR - BUR\nA MAR H\nF BRE H\n", "\n"),  # only the close tag may follow
        ("A PAR - BUR\nA MAR H\n", "</"),  # close before every unit is ordered
        ("", "WA"),  # WAIVE outside builds
    ],
)
def test_forbidden_continuations(prefix: str, bad: str) -> None:
    legal = DiplomacyGame().legal_orders("FRANCE")
    constraint = OrderConstraint(legal, SYNTHETIC)
    for ch in prefix:
        constraint.advance(SYNTHETIC.texts.index(ch))
    assert SYNTHETIC.texts.index(bad) not in constraint.allowed_token_ids(constraint._consumed)
    with pytest.raises(ConstraintViolation, match="not allowed"):
        constraint.advance(SYNTHETIC.texts.index(bad))


def feed(constraint: OrderConstraint, text: str) -> None:
    for ch in text:
        constraint.advance(SYNTHETIC.texts.index(ch))


def allows_line(constraint: OrderConstraint, line: str) -> bool:
    """Whether `line` and its newline may be written next (the constraint is left where it was)."""
    before = list(constraint._consumed)
    try:
        feed(constraint, line + "\n")
    except ConstraintViolation:
        return False
    finally:
        constraint.reset()
        feed(constraint, "".join(SYNTHETIC.texts[i] or "" for i in before))
    return True


ITALY = DiplomacyGame().legal_orders("ITALY")  # A ROM, A VEN, F NAP


@pytest.mark.parametrize(
    ("written", "refused", "allowed"),
    [
        # A support of an own unit written after that unit's order must agree with it.
        ("A ROM - APU\n", ["A VEN S A ROM", "F NAP S A ROM"], ["A VEN S A ROM - APU", "F NAP S A ROM - APU"]),
        ("A VEN - TUS\n", ["A ROM S A VEN - APU", "A ROM S A VEN"], ["A ROM S A VEN - TUS", "F NAP H"]),
        ("A ROM H\n", ["A VEN S A ROM - APU", "F NAP S A ROM - APU"], ["A VEN S A ROM", "F NAP S A ROM"]),
        ("A ROM S A VEN - APU\n", ["A VEN S A ROM"], ["A VEN - APU", "F NAP S A ROM"]),  # a supporter stays
        # Written first, a support decides what its unit may do, and what other own supports of it may ask.
        ("A VEN S A ROM - APU\n", ["A ROM H", "A ROM - TUS", "F NAP S A ROM"], ["A ROM - APU", "F NAP S A ROM - APU"]),
        ("A VEN S A ROM\n", ["A ROM - APU", "F NAP S A ROM - APU"], ["A ROM H", "A ROM S A VEN", "F NAP S A ROM"]),
        # Another power's unit is not ours to check.
        ("A ROM - APU\n", [], ["A VEN S F TRI", "A VEN S A VIE - TRI"]),
    ],
)
def test_own_supports_agree_with_their_units_orders(written: str, refused: list[str], allowed: list[str]) -> None:
    for line in refused + allowed:
        assert line in ITALY.loc_of, f"{line!r} is not legal at the start: the case is wrong"
    constraint = OrderConstraint(ITALY, SYNTHETIC)
    feed(constraint, written)
    assert [line for line in refused if allows_line(constraint, line)] == []
    assert [line for line in allowed if not allows_line(constraint, line)] == []


def test_a_support_its_unit_could_never_agree_with_is_not_offered() -> None:
    legal = PowerOrders(
        power="ITALY",
        phase="S1901M",
        kind=PhaseKind.MOVEMENT,
        by_loc={"ROM": ("A ROM - APU", "A ROM H"), "VEN": ("A VEN H", "A VEN S A ROM - APU", "A VEN S A ROM - TUS")},
        n_required=2,
    )
    constraint = OrderConstraint(legal, SYNTHETIC)
    assert not allows_line(constraint, "A VEN S A ROM - TUS")  # ROM has no move to TUS
    assert allows_line(constraint, "A VEN S A ROM - APU") and allows_line(constraint, "A VEN H")


def test_dumbbot_order_sets_pass_the_constraint_in_any_order() -> None:
    """The teacher's orders are never refused, whichever unit comes first (its supports always agree)."""
    game = DiplomacyGame(max_year=1904)
    bots = {power: make_agent("dumbbot", i) for i, power in enumerate(game.powers)}
    rng = random.Random(0)
    checked = supports = 0
    while not game.is_done:
        orders = {power: bots[power].orders(game, power) for power in game.orderable_powers()}
        for power, lines in orders.items():
            legal = game.legal_orders(power)
            for arrangement in (sorted(lines), sorted(lines, reverse=True), rng.sample(lines, len(lines))):
                constraint = OrderConstraint(legal, SYNTHETIC)
                feed(constraint, "".join(line + "\n" for line in arrangement) + CLOSE_TAG)
                constraint.advance(EOS)
                assert constraint.done
                checked += 1
            supports += sum(" S " in line for line in lines)
        game.step(orders)
    assert checked > 100 and supports > 20, (checked, supports)


def test_merged_tokens_across_order_boundaries_are_allowed() -> None:
    """'H\\nA' ends one order and starts the next; '\\n</' ends the last line and opens the tag."""
    legal = DiplomacyGame().legal_orders("FRANCE")
    constraint = OrderConstraint(legal, SYNTHETIC)
    ids = [SYNTHETIC.texts.index(t) for t in ["F BRE"[0], " ", "B", "R", "E", " H", "\nA", " PAR", " -", " BUR"]]
    for i in ids:
        constraint.advance(i)
    allowed = constraint.allowed_token_ids(constraint._consumed)
    assert SYNTHETIC.texts.index("\nA") in allowed  # A MAR is still unordered
    assert SYNTHETIC.texts.index("\nF") not in allowed  # F BRE is done
    for t in ["\nA", " MAR", " H"]:
        constraint.advance(SYNTHETIC.texts.index(t))
    assert SYNTHETIC.texts.index("\n</") in constraint.allowed_token_ids(constraint._consumed)


def test_deterministic_and_replayable() -> None:
    legal = STATES[7]
    text_a = walk(legal, SYNTHETIC, random.Random(5))
    text_b = walk(legal, SYNTHETIC, random.Random(5))
    assert text_a == text_b
    # masks_for replays a completion and gives the allowed set before each of its tokens.
    constraint = OrderConstraint(legal, SYNTHETIC)
    ids = [SYNTHETIC.texts.index(ch) for ch in text_a] + [EOS]
    masks = constraint.masks_for(ids)
    assert len(masks) == len(ids) and all(i in m for i, m in zip(ids, masks, strict=True))


def test_non_extending_prefix_replays_from_the_start() -> None:
    legal = DiplomacyGame().legal_orders("FRANCE")
    ids = {text: [SYNTHETIC.texts.index(ch) for ch in text] for text in ("A PAR - BUR\nA", "A MAR H\nA")}
    constraint = OrderConstraint(legal, SYNTHETIC)
    after_par = constraint.allowed_token_ids(ids["A PAR - BUR\nA"])
    after_mar = constraint.allowed_token_ids(ids["A MAR H\nA"])  # not an extension: replay
    assert np.array_equal(after_mar, OrderConstraint(legal, SYNTHETIC).allowed_token_ids(ids["A MAR H\nA"]))
    assert SYNTHETIC.texts.index(" MAR") in after_par and SYNTHETIC.texts.index(" PAR") not in after_par
    assert SYNTHETIC.texts.index(" PAR") in after_mar and SYNTHETIC.texts.index(" MAR") not in after_mar


def test_nothing_to_order_is_a_clear_error() -> None:
    legal = PowerOrders(power="FRANCE", phase="W1901A", kind=PhaseKind.NONE)
    with pytest.raises(ValueError, match="nothing to order"):
        OrderConstraint(legal, SYNTHETIC)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(STATES) - 1), seed=st.integers(0, 2**32 - 1), budget=st.integers(0, 12))
def test_reasoning_then_orders(index: int, seed: int, budget: int) -> None:
    """Free text first (bounded), then '<orders>\\n' and a legal order set; the tag is found in text."""
    legal = STATES[index]
    text = walk(legal, SYNTHETIC, random.Random(seed), ReasoningOptions(max_tokens=budget))
    head, sep, tail = text.partition("<orders>\n")
    assert sep, f"no open tag in {text!r}"
    assert "<orders>" not in head
    check_complete(tail, legal)


@pytest.fixture(scope="module", params=["qwen3", "compact"])
def real_bpe(request: pytest.FixtureRequest) -> tuple[object, TokenTable]:
    """Both real vocabularies: Qwen3's (the GPU models') and the compact one (the CPU presets')."""
    from diprl.policy.compact_tokenizer import compact_tokenizer_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table

    if request.param == "qwen3":
        tokenizer = load_tokenizer()
        return tokenizer, token_table(tokenizer, 151936)
    tokenizer = load_tokenizer(compact_tokenizer_path(4096))
    return tokenizer, token_table(tokenizer, 4096)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(index=st.integers(0, len(STATES) - 1), seed=st.integers(0, 2**32 - 1))
def test_random_walks_under_real_vocabularies_round_trip(
    real_bpe: tuple[object, TokenTable], index: int, seed: int
) -> None:
    """Real BPE: every walk is a legal order set, and the tokenizer decodes the ids to that exact text,
    which the unconstrained parser reads back as complete and legal."""
    from diprl.policy.parser import legal_complete, parse_orders

    tokenizer, table = real_bpe
    legal = STATES[index]
    constraint = OrderConstraint(legal, table)
    rng = random.Random(seed)
    ids: list[int] = []
    while True:
        allowed = constraint.allowed_token_ids(ids)
        if constraint.done:
            break
        ids.append(int(rng.choice(list(allowed))))
    text = tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert text == "".join(table.texts[i] or "" for i in ids[:-1])
    lines = check_complete(text, legal)
    parsed = parse_orders(text, legal)
    assert legal_complete(parsed, legal) and parsed.orders == [line for line in lines]
