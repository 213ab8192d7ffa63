"""Teacher data: what the server and decoder see, stratified, split by game and by state, the same from
one worker process or several."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from diprl.game import DiplomacyGame, PowerOrders
from diprl.imitation.data import TeacherConfig, TeacherData, generate
from diprl.imitation.strata import allocate, stratified_sample
from diprl.imitation.teacher import PHASE_CLASSES, TeacherError, TeacherExample, completion_orders
from diprl.policy.constraint import OrderConstraint
from diprl.policy.prompt import PromptOptions, build_prompt
from diprl.policy.vocab import TokenTable


def test_generated_examples_are_what_the_server_and_decoder_see(data: TeacherData, tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    kinds = Counter(e.kind for e in data.train + data.heldout)
    assert {"movement", "build"} <= set(kinds) and ("retreat" in kinds or "disband" in kinds)
    for example in data.train[:40] + data.heldout[:10]:
        legal = PowerOrders.from_dict(example.legal)
        constraint = OrderConstraint(legal, table)
        constraint.masks_for(example.completion_ids)
        assert constraint.done
        assert tokenizer.decode(example.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<orders>\n")
        assert completion_orders(example.completion_ids, table) == example.orders
    first = data.train[0]
    assert first.phase == "S1901M"
    # The prompt ids are the tokenizer's ids of build_prompt's text, as the PolicyServer tokenizes it.
    assert first.prompt_ids == list(tokenizer.encode(build_prompt(DiplomacyGame(), first.power).text))
    assert all(e.played and e.opponent == "dumbbot" for e in data.train)


def test_allocate_water_fills_by_hand() -> None:
    assert allocate({"a": 10, "b": 1, "c": 10}, {"a": 1, "b": 1, "c": 1}, 9) == {"a": 4, "b": 1, "c": 4}
    assert allocate({"a": 10, "b": 10}, {"a": 3, "b": 1}, 8) == {"a": 6, "b": 2}
    assert allocate({"a": 2, "b": 3}, {"a": 1, "b": 1}, 100) == {"a": 2, "b": 3}
    assert allocate({"a": 5, "b": 5, "c": 0}, {"a": 1, "b": 0, "c": 1}, 4) == {"a": 4, "b": 0, "c": 0}
    # A remainder goes to the largest fractional share, ties by key order.
    assert allocate({"a": 9, "b": 9, "c": 9}, {"a": 1, "b": 1, "c": 1}, 4) == {"a": 2, "b": 1, "c": 1}


def _fake(power: str, kind: str, game: int) -> TeacherExample:
    return TeacherExample(game, game, "train", power, "S1901M", kind, [], [], {}, [], "dumbbot", "dumbbot", True)


def test_stratified_sample_balances_powers_and_phase_classes() -> None:
    powers = ["AUSTRIA", "ENGLAND", "FRANCE"]
    pool = [_fake(p, "movement", i) for p in powers for i in range(30)]
    pool += [_fake(p, "retreat", i) for p in powers for i in range(2)]
    pool += [_fake(p, k, i) for p in powers for k in ("build", "disband") for i in range(5)]
    weights = {"movement": 0.5, "retreat": 0.2, "adjustment": 0.3}
    kept = stratified_sample(pool, 60, weights, random.Random(0))
    counts = Counter(e.stratum for e in kept)
    assert len(kept) == 60
    for power in powers:
        # Retreats are scarce (2 each) and all kept; the rest is shared 0.5 : 0.3 over the others.
        assert counts[(power, "retreat")] == 2
        assert counts[(power, "adjustment")] == 7
        assert counts[(power, "movement")] == 11
    assert stratified_sample(pool, 60, weights, random.Random(0)) == kept  # seeded
    assert stratified_sample(pool, None, weights, random.Random(0)) == pool


def test_generated_data_is_split_by_game_and_by_state(data: TeacherData) -> None:
    train_games = {e.game for e in data.train}
    heldout_games = {e.game for e in data.heldout}
    assert heldout_games == set(data.summary["heldout_games"]) and len(heldout_games) == 2
    assert not train_games & heldout_games
    # ...and by state: every game opens on the same board, so the openings of held-out games are
    # training states too; they are dropped from the held-out split.
    train_states = {(e.power, tuple(e.prompt_ids)) for e in data.train}
    assert not [e for e in data.heldout if (e.power, tuple(e.prompt_ids)) in train_states]
    assert data.summary["heldout_seen_in_train"] >= 14  # two held-out games' S1901M, seven powers each
    assert all(e.phase != "S1901M" for e in data.heldout)
    assert {e.power for e in data.train} == set(DiplomacyGame().powers)
    assert {c for _, c in (e.stratum for e in data.train)} <= set(PHASE_CLASSES)


def test_a_cap_keeps_scarce_phase_classes(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    config = TeacherConfig(games=3, heldout_games=1, max_year=1902, train_examples=30, heldout_examples=10, workers=1)
    capped = generate(config, tokenizer, table)
    everything = generate(
        TeacherConfig(games=3, heldout_games=1, max_year=1902, heldout_examples=None, workers=1), tokenizer, table
    )
    assert len(capped.train) == 30 and len(capped.heldout) == 10
    available = Counter(e.stratum for e in everything.train)
    weights = {k: config.class_weights[k[1]] / 7 for k in available}
    assert Counter(e.stratum for e in capped.train) == +Counter(allocate(available, weights, 30))
    classes = Counter(c for _, c in (e.stratum for e in capped.train))
    share = Counter(c for _, c in (e.stratum for e in everything.train))
    # Movement dominates the games; the cap shifts the mix towards the rarer classes.
    assert classes["movement"] / 30 < share["movement"] / sum(share.values())
    assert all(e in everything.train for e in capped.train)


def test_worker_processes_make_the_same_data_as_one(tok: tuple[Any, TokenTable]) -> None:
    """Two spawned workers and this process alone give identical examples, in game order; opponents
    take turns game by game, and only the teacher's own seat is played in a game against Random."""
    tokenizer, table = tok
    config = TeacherConfig(games=4, heldout_games=1, max_year=1901, opponents=["bot:random", "dumbbot"], workers=2)
    parallel = generate(config, tokenizer, table)
    alone = generate(TeacherConfig(**{**config.__dict__, "workers": 1}), tokenizer, table)
    assert parallel.summary["workers"] == 2 and alone.summary["workers"] == 1
    assert parallel.train == alone.train and parallel.heldout == alone.heldout
    by_game = {e.game: e.opponent for e in parallel.train + parallel.heldout}
    assert by_game == {g: ("random" if g % 2 == 0 else "dumbbot") for g in by_game}
    for game, opponent in by_game.items():
        played = {e.power for e in parallel.train + parallel.heldout if e.game == game and e.played}
        assert played == ({DiplomacyGame().powers[game % 7]} if opponent == "random" else set(DiplomacyGame().powers))
    assert parallel.summary["opponents"] == ["random", "dumbbot"]


def test_bad_teacher_settings_are_clear_errors() -> None:
    with pytest.raises(TeacherError, match="heldout_games"):
        TeacherConfig(games=4, heldout_games=4)
    with pytest.raises(TeacherError, match="unknown bot 'nobody'"):
        TeacherConfig(opponents=["nobody"])
    with pytest.raises(TeacherError, match="workers"):
        TeacherConfig(workers=-1)
    with pytest.raises(TeacherError, match="class_weights"):
        TeacherConfig(class_weights={"movement": 1.0, "builds": 1.0})
    with pytest.raises(TeacherError, match="completion_order must be one of"):
        TeacherConfig(completion_order="alphabetical")


def test_reach_hints_write_the_prompts_with_the_centres_in_reach_and_key_the_data_apart(
    tok: tuple[Any, TokenTable],
) -> None:
    """`reach_hints=True`: every example's prompt is build_prompt's with the hints, and the data are cached apart."""
    tokenizer, table = tok
    plain = TeacherConfig(games=2, heldout_games=1, max_year=1901, workers=1)
    hinted = TeacherConfig(**{**plain.__dict__, "reach_hints": True})
    assert "reach_hints" not in plain.content() and hinted.content()["reach_hints"] is True  # plain data keep their key
    data = generate(hinted, tokenizer, table)
    first = data.train[0]
    assert first.phase == "S1901M"
    prompt = build_prompt(DiplomacyGame(), first.power, PromptOptions(reach_hints=True)).text
    assert "Centres in reach" in prompt and first.prompt_ids == list(tokenizer.encode(prompt))
