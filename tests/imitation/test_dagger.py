"""DAgger: the teacher labels exactly the student's states, the labels become training decisions of their own
states (held out by game), and pretraining continues from the student's body instead of a random one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from diprl.bots import make_agent
from diprl.bots.base import seat_seed
from diprl.game import DiplomacyGame, validate_orders
from diprl.imitation.dagger import (
    GAME_BASE,
    StudentStates,
    load_dagger_config,
    play_student_games,
    run,
    student_examples,
)
from diprl.imitation.teacher import label_decision
from diprl.policy.models import CONF_DIR, load_preset, pretrained_tiny_dir
from diprl.policy.vocab import TokenTable
from diprl.structured_config import ConfigError


def _config(*overrides: str) -> Any:
    return load_dagger_config(["student=bot:random", "games=3", "max_year=1901", *overrides])


def test_bad_values_are_clear_errors() -> None:
    assert _config().games == 3
    with pytest.raises(ConfigError, match="the strength bench's"):
        _config("seed=12345")
    with pytest.raises(ConfigError, match=r"must differ from pretrain\.init"):
        _config("pretrain.model=tiny_pretrained")
    with pytest.raises(ConfigError, match="heldout_every must be 0 or >= 2"):
        _config("heldout_every=1")
    with pytest.raises(ConfigError, match="unknown bot"):
        _config("teacher=base")


def test_the_teacher_labels_every_state_of_the_students_seat_and_nothing_else() -> None:
    games = play_student_games(_config(), client=None)
    assert [played.index for played, _ in games] == [0, 1, 2]
    for played, decisions in games:
        # Hero of game i is power i % 7; it orders in each of 1901's three phases it has units or builds in.
        assert {d.power for d in decisions} == {played.hero_power}
        assert [d.phase for d in decisions][:2] == ["S1901M", "F1901M"]
        assert all(not d.played and d.game == played.index for d in decisions)
        for d in decisions:
            assert not validate_orders(d.legal, list(d.orders))[1]


def test_a_label_is_what_the_teacher_orders_in_that_state() -> None:
    game = DiplomacyGame(max_year=1901)
    labels = StudentStates("dumbbot", "FRANCE", 4, 99)
    labels(game)
    (decision,) = labels.decisions
    twin = make_agent("dumbbot", seat_seed(99, 7 + game.powers.index("FRANCE")))
    assert decision == label_decision(game, "FRANCE", twin, 4, 99, False)


def test_student_decisions_become_states_of_their_own_held_out_by_game(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    config = _config("games=4", "heldout_every=2", "repeats=3")
    games = play_student_games(config, client=None)
    train, heldout = student_examples(games, config, tokenizer, table, 4096)
    per_game = {played.index: len(d) for played, d in games}
    assert len(heldout) == per_game[0] + per_game[2]  # games 0 and 2 held out
    assert len(train) == 3 * (per_game[1] + per_game[3])
    assert {e.game for e in heldout} == {GAME_BASE, GAME_BASE + 2}
    assert {e.game for e in train} == {k * GAME_BASE + i for k in (1, 2, 3) for i in (1, 3)}
    assert {e.split for e in heldout} == {"heldout"} and {e.split for e in train} == {"train"}


def test_a_round_continues_the_students_body_on_teacher_and_student_decisions(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    preset = conf / "model" / "tiny_dagger.yaml"
    preset.write_text(preset.read_text().replace("path: zoo/bases/tiny_dagger", f"path: {tmp_path / 'body'}"))
    config = load_dagger_config(
        [
            "student=bot:random", "games=4", "max_year=1901", "heldout_every=2", "repeats=2",
            "pretrain.data.games=3", "pretrain.data.heldout_games=1", "pretrain.data.max_year=1901",
            "pretrain.data.heldout_examples=12", "pretrain.data.workers=1", "pretrain.epochs=1",
            "pretrain.batch_size=16", "pretrain.warmup_steps=0", f"pretrain.out={tmp_path / 'pt'}",
            f"out={tmp_path / 'run'}", "pretrain.quiet=true",
        ],
        conf,
    )  # fmt: skip
    report = run(config, cache=tmp_path / "cache", conf_dir=conf)
    inner = report["pretrain"]
    assert inner["extra_train_examples"] == report["dagger_train_examples"] > 0
    assert inner["extra_before"]["decisions"] == report["dagger_heldout_examples"] > 0
    start = load_file(str(pretrained_tiny_dir(load_preset("tiny_pretrained")) / "model.safetensors"))
    trained = load_file(str(tmp_path / "body" / "model.safetensors"))
    assert set(trained) == set(start) and any(not t.equal(start[n]) for n, t in trained.items())
    # Continued, not restarted: the first step's loss is the trained body's, far below a random body's (~1.5).
    assert inner["loss_first"] < 0.8
    assert (tmp_path / "run" / "dagger_report.json").is_file()
