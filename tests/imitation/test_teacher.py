"""Teacher decisions: completions the decoder could write, typed training records, labelled games."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from diprl.bots import make_agent
from diprl.bots.base import seat_seed
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.imitation.teacher import (
    TeacherError,
    completion_orders,
    game_seed,
    ordered_lines,
    play_teacher_game,
    teacher_bot,
    teacher_completion,
)
from diprl.messages import PolicyRef, TrainingRecord
from diprl.policy.constraint import contradicted_supports
from diprl.policy.prompt import build_prompt
from diprl.policy.vocab import TokenTable
from tests.policy.states import legal_order_sets


def _random_orders(legal: PowerOrders, rng: random.Random) -> list[str]:
    """Random legal orders the constraint accepts: an own support its unit's order contradicts holds instead."""
    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        orders = {loc: rng.choice(orders) for loc, orders in legal.by_loc.items()}
        while contradicted := contradicted_supports(legal, list(orders.values())):
            for order in contradicted:
                orders[legal.loc_of[order]] = legal.default_order(legal.loc_of[order])
        return list(orders.values())
    locs = rng.sample(list(legal.locs), rng.randint(0, legal.n_required) if legal.allows_waive else legal.n_required)
    picked = [rng.choice(legal.by_loc[loc]) for loc in locs]
    return picked + ["WAIVE"] * (legal.n_required - len(picked))


def test_completions_pass_the_constraint_for_every_phase_kind(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    rng = random.Random(0)
    seen: Counter[PhaseKind] = Counter()
    for legal in legal_order_sets():
        orders = _random_orders(legal, rng)
        ids = teacher_completion(legal, orders, tokenizer, table)
        assert ids[-1] == table.eos_id
        # The decoded completion is the orders in the fixed order, then the close tag.
        lines = ordered_lines(legal, orders)
        assert tokenizer.decode(ids[:-1]) == "".join(f"{o}\n" for o in lines) + "</orders>"
        assert Counter(completion_orders(ids, table)) == Counter(orders)
        seen[legal.kind] += 1
    assert set(seen) == {PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND}


def test_a_teacher_that_supports_its_own_units_against_their_orders_is_refused_clearly() -> None:
    france = DiplomacyGame().legal_orders("FRANCE")
    with pytest.raises(TeacherError, match=r"support their own units against.*A PAR S A MAR - BUR"):
        ordered_lines(france, ["A PAR S A MAR - BUR", "F BRE H", "A MAR H"])
    assert contradicted_supports(france, ["A PAR S A MAR - BUR", "F BRE H", "A MAR - BUR"]) == []


def test_order_lines_follow_the_provinces_or_put_moves_first_and_supports_last_with_waives_last() -> None:
    legal = PowerOrders(
        "FRANCE", "W1901A", PhaseKind.BUILD, {"BRE": ("A BRE B", "F BRE B"), "PAR": ("A PAR B",)}, n_required=2
    )
    assert ordered_lines(legal, ["WAIVE", "A PAR B"]) == ["A PAR B", "WAIVE"]
    france = DiplomacyGame().legal_orders("FRANCE")
    orders = ["A PAR S A MAR - BUR", "F BRE H", "A MAR - BUR"]
    # Moves first: the support is written after the move it backs, then holds before supports.
    assert ordered_lines(france, orders, "moves_first") == ["A MAR - BUR", "F BRE H", "A PAR S A MAR - BUR"]
    assert ordered_lines(france, orders) == ["F BRE H", "A MAR - BUR", "A PAR S A MAR - BUR"]
    assert ordered_lines(france, ["A PAR - BUR", "F BRE - MAO", "A MAR H"]) == [
        "F BRE - MAO",
        "A MAR H",
        "A PAR - BUR",
    ]
    with pytest.raises(TeacherError, match="unknown completion_order 'random'"):
        ordered_lines(france, orders, "random")


def test_bad_teacher_orders_and_foreign_tokens_raise(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    france = DiplomacyGame().legal_orders("FRANCE")
    with pytest.raises(TeacherError, match="illegal"):
        teacher_completion(france, ["A PAR - MUN", "F BRE H", "A MAR H"], tokenizer, table)
    with pytest.raises(TeacherError, match="missing"):
        teacher_completion(france, ["F BRE H", "A MAR H"], tokenizer, table)

    class Chatty:
        """Encodes like the real tokenizer but adds a word before the orders."""

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(tokenizer.encode("Sure: " + text, add_special_tokens=False))

    with pytest.raises(TeacherError, match="breaks the constraint"):
        teacher_completion(france, ["F BRE H", "A MAR H", "A PAR H"], Chatty(), table)


def test_teachers_are_rule_bots_named_plainly_or_as_a_policy_ref() -> None:
    assert teacher_bot("dumbbot") == teacher_bot("bot:dumbbot") == "dumbbot"
    for bad in ("dumbot", "bot:nobody", "base", "main@v3", "bot:", ""):
        with pytest.raises(TeacherError, match="unknown bot"):
            teacher_bot(bad)


def test_examples_become_typed_training_records(data: Any) -> None:
    example = data.train[0]
    record = example.to_training_record()
    assert isinstance(record, TrainingRecord)
    assert record.policy_version == PolicyRef.bot_ref("dumbbot")
    assert record.prompt_ids == example.prompt_ids and record.completion_ids == example.completion_ids
    assert len(record.advantages) == len(record.behaviour_logprobs) == len(example.completion_ids)
    assert (record.power, record.phase, record.legal) == (example.power, example.phase, example.legal)


def test_support_weights_cover_exactly_the_tokens_of_the_teachers_support_lines(
    data: Any, tok: tuple[Any, TokenTable]
) -> None:
    tokenizer, table = tok
    example = next(e for e in data.train if any(" S " in o for o in e.orders) and any(" S " not in o for o in e.orders))
    weights = example.token_weights(table, 4.0)
    assert len(weights) == len(example.completion_ids)
    # Re-spell the weighted tokens: they are the support lines, newlines included, and nothing else.
    weighted = "".join(tokenizer.decode([t]) for t, w in zip(example.completion_ids, weights, strict=True) if w == 4.0)
    assert weighted == "".join(f"{o}\n" for o in example.orders if " S " in o)
    assert set(weights) == {1.0, 4.0} and weights[-1] == 1.0  # the close tag and EOS keep weight 1
    assert example.to_training_record(weights).advantages == weights
    assert set(example.token_weights(table, 1.0)) == {1.0}


def test_against_other_bots_the_teacher_labels_every_seat_without_changing_the_game() -> None:
    """Game 3 against Random: the teacher plays TURKEY (3 mod 7), Random the rest. Every seat's decision
    carries a legal, complete DumbBot label, and the game itself is one DumbBot among six Randoms with
    the same seat seeds: asking the labelling copies never moves the board."""
    decisions = play_teacher_game("dumbbot", "random", 3, seed=0, max_year=1902)
    game = DiplomacyGame(max_year=1902)
    hero = game.powers[3]
    assert {d.power for d in decisions if d.played} == {hero}
    assert {d.power for d in decisions if not d.played} == set(game.powers) - {hero}
    for d in decisions:
        ordered_lines(d.legal, d.orders)  # raises unless the label is a legal, complete order set
    gseed = game_seed(0, 3)
    agents = {
        power: make_agent("dumbbot" if power == hero else "random", seat_seed(gseed, seat))
        for seat, power in enumerate(game.powers)
    }
    expected = []
    played: dict[tuple[str, str], list[str]] = {}
    while not game.is_done:
        powers = game.orderable_powers()
        expected += [(power, build_prompt(game, power).text) for power in powers]
        orders = {power: agents[power].orders(game, power) for power in powers}
        played.update({(game.phase, power): sorted(o) for power, o in orders.items()})
        game.step(orders)
    assert [(d.power, d.prompt) for d in decisions] == expected
    # The hero's label is what it played; Random's seats are labelled with other (the teacher's) orders.
    assert all(sorted(d.orders) == played[(d.phase, d.power)] for d in decisions if d.played)
    others = [sorted(d.orders) != played[(d.phase, d.power)] for d in decisions if not d.played]
    assert sum(others) > len(others) / 2


def test_the_teacher_plays_all_seats_against_itself() -> None:
    decisions = play_teacher_game("dumbbot", "dumbbot", 0, seed=0, max_year=1901)
    assert decisions and all(d.played for d in decisions)
    assert {d.kind for d in decisions} >= {"movement", "build"}


def test_a_game_state_groups_every_power_of_one_phase(data: Any) -> None:
    states = Counter(e.state for e in data.train)
    assert states[(data.train[0].game, "S1901M")] == 7
    assert all(e.state == (e.game, e.phase) for e in data.train)
