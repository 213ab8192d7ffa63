"""Imitation: teacher data the decoder could write, stratified and split by game, shards that round-trip,
an agreement metric checked by hand, and behaviour cloning that raises agreement on a fixed set."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.inference.adapters import AdapterStore
from diprl.learn.imitate import (
    ConfigError,
    ImitateConfig,
    agreement,
    completion_orders,
    evaluate_agreement,
    greedy_decode,
    load_policy_model,
    main,
    make_learner,
    parse_args,
    train_bc,
)
from diprl.learn.teacher import (
    PHASE_CLASSES,
    TeacherConfig,
    TeacherData,
    TeacherError,
    TeacherExample,
    allocate,
    generate,
    ordered_lines,
    read_shards,
    stratified_sample,
    teacher_completion,
    write_shards,
)
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table
from tests.policy.states import legal_order_sets


@pytest.fixture(scope="module")
def tok() -> tuple[Any, TokenTable]:
    preset = load_preset("tiny")  # the model the tests train: its tokenizer spells the examples
    tokenizer = load_tokenizer(resolve_model_path(preset))
    return tokenizer, token_table(tokenizer, logits_width(preset))


@pytest.fixture(scope="module")
def data(tok: tuple[Any, TokenTable]) -> TeacherData:
    tokenizer, table = tok
    config = TeacherConfig(teacher="bot:dumbbot", games=5, heldout_games=2, max_year=1904, heldout_examples=None)
    return generate(config, tokenizer, table)


def _random_orders(legal: PowerOrders, rng: random.Random) -> list[str]:
    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        return [rng.choice(orders) for orders in legal.by_loc.values()]
    locs = rng.sample(list(legal.locs), rng.randint(0, legal.n_required) if legal.allows_waive else legal.n_required)
    picked = [rng.choice(legal.by_loc[loc]) for loc in locs]
    return picked + ["WAIVE"] * (legal.n_required - len(picked))


# ------------------------------------------------------------------------------ completions


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


def test_order_lines_follow_the_provinces_with_waives_last() -> None:
    legal = PowerOrders(
        "FRANCE", "W1901A", PhaseKind.BUILD, {"BRE": ("A BRE B", "F BRE B"), "PAR": ("A PAR B",)}, n_required=2
    )
    assert ordered_lines(legal, ["WAIVE", "A PAR B"]) == ["A PAR B", "WAIVE"]
    game = DiplomacyGame()
    france = game.legal_orders("FRANCE")
    assert ordered_lines(france, ["A PAR - BUR", "F BRE - MAO", "A MAR H"]) == [
        "F BRE - MAO",
        "A MAR H",
        "A PAR - BUR",
    ]


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
        record = example.to_training_record()
        assert len(record.advantages) == len(record.behaviour_logprobs) == len(example.completion_ids)
    first = data.train[0]
    assert first.phase == "S1901M"
    # The prompt ids are the tokenizer's ids of build_prompt's text, as the PolicyServer tokenizes it.
    from diprl.policy.prompt import build_prompt

    assert first.prompt_ids == list(tokenizer.encode(build_prompt(DiplomacyGame(), first.power).text))


# ---------------------------------------------------------------------------- stratification


def test_allocate_water_fills_by_hand() -> None:
    assert allocate({"a": 10, "b": 1, "c": 10}, {"a": 1, "b": 1, "c": 1}, 9) == {"a": 4, "b": 1, "c": 4}
    assert allocate({"a": 10, "b": 10}, {"a": 3, "b": 1}, 8) == {"a": 6, "b": 2}
    assert allocate({"a": 2, "b": 3}, {"a": 1, "b": 1}, 100) == {"a": 2, "b": 3}
    assert allocate({"a": 5, "b": 5, "c": 0}, {"a": 1, "b": 0, "c": 1}, 4) == {"a": 4, "b": 0, "c": 0}
    # A remainder goes to the largest fractional share, ties by key order.
    assert allocate({"a": 9, "b": 9, "c": 9}, {"a": 1, "b": 1, "c": 1}, 4) == {"a": 2, "b": 1, "c": 1}


def _fake(power: str, kind: str, game: int) -> TeacherExample:
    return TeacherExample(game, game, "train", power, "S1901M", kind, [], [], {}, [], "dumbbot")


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


def test_generated_data_is_stratified_and_split_by_game(data: TeacherData) -> None:
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
    config = TeacherConfig(games=3, heldout_games=1, max_year=1902, train_examples=30, heldout_examples=10)
    capped = generate(config, tokenizer, table)
    everything = generate(
        TeacherConfig(games=3, heldout_games=1, max_year=1902, heldout_examples=None), tokenizer, table
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


# ------------------------------------------------------------------------------------ shards


def test_shards_round_trip_and_detect_damage(data: TeacherData, tmp_path: Path) -> None:
    directory = write_shards(data, tmp_path, shard_size=16)
    assert len(list(directory.glob("train-*.jsonl"))) == -(-len(data.train) // 16)
    back = read_shards(tmp_path)
    assert back.train == data.train and back.heldout == data.heldout
    assert back.summary["heldout_games"] == data.summary["heldout_games"]
    shard = directory / "train-00000.jsonl"
    shard.write_text("\n".join(shard.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(TeacherError, match="manifest says 16"):
        read_shards(tmp_path)
    with pytest.raises(TeacherError, match="no teacher data"):
        read_shards(tmp_path / "elsewhere")


# --------------------------------------------------------------------------------- agreement


def test_agreement_by_hand(tok: tuple[Any, TokenTable]) -> None:
    tokenizer, table = tok
    france = DiplomacyGame().legal_orders("FRANCE")
    build = PowerOrders(
        "FRANCE", "W1901A", PhaseKind.BUILD, {"BRE": ("A BRE B", "F BRE B"), "PAR": ("A PAR B",)}, n_required=2
    )
    teacher_move = ["F BRE - MAO", "A MAR H", "A PAR - BUR"]
    teacher_build = ["F BRE B", "WAIVE"]

    def example(legal: PowerOrders, orders: list[str]) -> TeacherExample:
        ids = teacher_completion(legal, orders, tokenizer, table)
        return TeacherExample(
            0,
            0,
            "heldout",
            "FRANCE",
            legal.phase,
            legal.kind.value,
            [],
            ids,
            legal.to_dict(),
            ordered_lines(legal, orders),
            "dumbbot",
        )

    examples = [example(france, teacher_move), example(build, teacher_build)]
    policy = [
        teacher_completion(france, ["F BRE - MAO", "A MAR - SPA", "A PAR - BUR"], tokenizer, table),  # 2 of 3
        teacher_completion(build, ["WAIVE", "A PAR B"], tokenizer, table),  # the WAIVE matches: 1 of 2
    ]
    result = agreement(examples, policy, table)
    assert result.per_unit == pytest.approx(3 / 5)
    assert result.exact == 0.0
    assert result.by_class == {"movement": pytest.approx(2 / 3), "adjustment": 0.5}
    same = agreement(examples, [e.completion_ids for e in examples], table)
    assert (same.per_unit, same.exact, same.incomplete) == (1.0, 1.0, 0)


# ------------------------------------------------------------------------------------ config


def test_bad_keys_values_and_teachers_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["teacher=bot:random", "games=3", "model=small"]).games == 3
    with pytest.raises(ConfigError, match=r"unknown key 'stpes'.*steps"):
        parse_args(["stpes=10"])
    with pytest.raises(ConfigError, match="games"):
        parse_args(["games=many"])
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_args(["dumbbot"])
    with pytest.raises(ConfigError, match=r"unknown teacher 'dumbot'.*dumbbot"):
        parse_args(["teacher=dumbot"])
    with pytest.raises(ConfigError, match="heldout_games"):
        ImitateConfig(games=4, heldout_games=4).teacher_config()
    assert main(["teacher=bot:nobody"]) == 2
    assert "unknown teacher 'bot:nobody'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- learning


def test_behaviour_cloning_raises_agreement_on_a_fixed_set(data: TeacherData, tmp_path: Path) -> None:
    """Eight learner steps (objective='bc') on six fixed decisions (three movement, three builds): the
    tiny model's greedy decode moves towards the teacher's, and the published version is the adapter
    that was trained."""
    import torch

    torch.set_num_threads(1)
    movement = [e for e in data.train if e.kind == "movement"]
    fixed = movement[:3] + [e for e in data.train if e.kind == "build"][:3]
    config = parse_args(["policy=bc", "lr=1e-2", "steps=8", f"adapter_root={tmp_path / 'adapters'}"])
    learner = make_learner(config, tmp_path / "run")
    table = learner.table
    before = evaluate_agreement(learner.peft, fixed, table)
    history = train_bc(learner, [e.to_training_record() for e in fixed], steps=8, batch_size=6, seed=0)
    after = evaluate_agreement(learner.peft, fixed, table)
    assert all(m["objective"] == "bc" and m["trained"] == 1 for m in history)
    assert history[-1]["loss"] < history[0]["loss"]
    assert after.per_unit > before.per_unit + 0.15, (before, after)
    assert after.incomplete == 0
    assert learner.publish() == "bc@v2"  # v1: the untrained LoRA the learner published on construction
    published = AdapterStore(tmp_path / "adapters").resolve("bc@v2")
    assert published.rank == 8
    # The published files are the trained adapter: loaded afresh, they decode exactly as the model did.
    reloaded, _, _, _ = load_policy_model("tiny", init=published.path)
    assert greedy_decode(reloaded, fixed, table) == greedy_decode(learner.peft, fixed, table)


@pytest.mark.slow
def test_imitation_end_to_end_through_the_learner(tmp_path: Path) -> None:
    """The CLI path: teacher shards written, DeepSpeed learner trained with objective='bc', the warm
    start published after the learner's untrained first version."""
    from diprl.learn.imitate import run

    config = parse_args(
        [
            "games=2",
            "max_year=1901",
            "train_examples=8",
            "heldout_examples=4",
            "steps=2",
            "batch_size=4",
            f"out={tmp_path / 'run'}",
            f"adapter_root={tmp_path / 'adapters'}",
            "quiet=true",
        ]
    )
    report = run(config)
    assert report["version"] == "main@v2"  # v1: the learner's untrained LoRA
    assert (tmp_path / "run" / "teacher" / "manifest.json").is_file()
    assert report["after"]["incomplete"] == 0 and report["after"]["decisions"] == 4
    assert len(read_shards(tmp_path / "run").train) == 8
