"""The imitation command: configuration errors, batches of whole states, behaviour cloning through the
learner that raises agreement, and the run end to end."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from diprl.imitation.__main__ import main
from diprl.imitation.agreement import evaluate_agreement
from diprl.imitation.config import ConfigError, load_imitate_config
from diprl.imitation.data import TeacherData
from diprl.imitation.decode import greedy_completions
from diprl.imitation.run import make_learner
from diprl.imitation.shards import read_shards
from diprl.imitation.train import planned_batches, state_batches, state_groups, train_bc
from diprl.inference.adapters import AdapterStore
from diprl.messages import PolicyRef, StepReport, TrainingRecord
from diprl.torch_threads import set_torch_threads


def test_bad_keys_values_and_teachers_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    config = load_imitate_config(["data.teacher=bot:random", "data.games=3", "learner.model=small", "verbose=true"])
    assert (config.data.games, config.learner.model, config.verbose) == (3, "small", True)
    assert load_imitate_config([]).verbose is False
    with pytest.raises(ConfigError, match="Key 'stpes' not in 'ImitateConfig'"):
        load_imitate_config(["stpes=10"])
    with pytest.raises(ConfigError, match=r"data\.games=many"):
        load_imitate_config(["data.games=many"])
    with pytest.raises(ConfigError, match="key=value"):
        load_imitate_config(["dumbbot"])
    with pytest.raises(ConfigError, match=r"unknown bot 'dumbot'.*dumbbot"):
        load_imitate_config(["data.teacher=dumbot"])
    with pytest.raises(ConfigError, match="heldout_games"):
        load_imitate_config(["data.games=4", "data.heldout_games=4"])
    with pytest.raises(ConfigError, match="lr must be positive"):
        load_imitate_config(["learner.lr=0"])
    with pytest.raises(ConfigError, match="batch_size must be positive"):
        load_imitate_config(["batch_size=0"])
    assert main(["data.teacher=bot:nobody"]) == 2
    assert "unknown bot 'bot:nobody'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "data.opponents=[]" in capsys.readouterr().out


def test_epochs_count_records_not_steps(data: TeacherData) -> None:
    """Batches of whole states hold fewer than batch_size records, so an epoch is counted in records."""

    class Counting:
        def train_records(self, records: Any, objective: str = "bc") -> StepReport:
            assert objective == "bc" and all(isinstance(r, TrainingRecord) for r in records)
            return StepReport("main", 1, True, PolicyRef.parse("main@v1"), metrics={"records": len(records)})

    history = train_bc(Counting(), data.train, planned_batches(data.train, 20, 0, epochs=1.0))
    trained = sum(m["records"] for m in history)
    assert len(data.train) <= trained < len(data.train) + 20
    assert len(train_bc(Counting(), data.train, planned_batches(data.train, 20, 0, steps=3))) == 3
    stop = train_bc(Counting(), data.train, planned_batches(data.train, 20, 0, epochs=2.0), on_step=lambda m: True)
    assert len(stop) == 1
    with pytest.raises(ValueError, match="exactly one of steps and epochs"):
        next(planned_batches(data.train, 20, 0, steps=3, epochs=1.0))
    # the plan a decaying lr is laid over is the steps actually taken, not records / batch_size
    assert len(list(planned_batches(data.train, 20, 0, epochs=1.0))) == len(history) > len(data.train) / 20
    assert len(list(planned_batches(data.train, 20, 0, steps=3))) == 3


def test_batches_hold_whole_states_and_every_decision_once_per_epoch(data: TeacherData) -> None:
    groups = state_groups(data.train)
    assert sorted(i for g in groups for i in g) == list(range(len(data.train)))
    assert all(len({data.train[i].state for i in g}) == 1 for g in groups)
    group_of = {i: n for n, g in enumerate(groups) for i in g}
    batches = list(islice(state_batches(groups, 20, seed=0), 40))
    seen: Counter[int] = Counter()
    for batch in batches:
        assert len(batch) <= 20
        states = Counter(group_of[i] for i in batch)
        assert all(states[g] == len(groups[g]) for g in states)  # no state is split
        seen.update(batch)
    # Forty batches cover at least two epochs; no decision comes a third time before all came twice.
    assert sum(seen.values()) >= 2 * len(data.train)
    assert min(seen.values()) >= max(seen.values()) - 1
    assert list(islice(state_batches(groups, 20, seed=0), 5)) == batches[:5]  # seeded
    assert list(islice(state_batches(groups, 20, seed=1), 5)) != batches[:5]
    assert next(state_batches([[0, 1, 2]], 2, seed=0)) == [0, 1, 2]  # a state larger than a batch stays whole


def test_a_teacher_decision_is_a_training_record_of_the_bot(data: TeacherData) -> None:
    records = [e.to_training_record() for e in data.train[:3]]
    assert [r.completion_ids for r in records] == [e.completion_ids for e in data.train[:3]]
    assert all(r.policy_version == PolicyRef.bot_ref("dumbbot") and r.temperature == 1.0 for r in records)
    assert all(r.advantages == [1.0] * len(r.completion_ids) for r in records)


def test_behaviour_cloning_raises_agreement_on_a_fixed_set(data: TeacherData, tmp_path: Path) -> None:
    """Eight learner steps (objective='bc') on six fixed decisions (three movement, three builds): the
    tiny model's greedy decode moves towards the teacher's, and the published version is the adapter
    that was trained."""

    from diprl.learn.model import build_peft_model

    set_torch_threads(1)
    movement = [e for e in data.train if e.kind == "movement"]
    fixed = movement[:3] + [e for e in data.train if e.kind == "build"][:3]
    config = load_imitate_config(["learner.policy=bc", "learner.lr=1e-2", f"adapter_root={tmp_path / 'adapters'}"])
    learner = make_learner(config, tmp_path / "run")
    table = learner.table
    before = evaluate_agreement(learner.peft, fixed, table, learner.pad_id)
    history = train_bc(learner, fixed, planned_batches(fixed, 6, 0, steps=8))
    after = evaluate_agreement(learner.peft, fixed, table, learner.pad_id)
    assert all(m["objective"] == "bc" and m["trained"] == 1 and m["records"] == 6 for m in history)
    assert history[-1]["loss"] < history[0]["loss"]
    assert after.per_unit > before.per_unit + 0.15, (before, after)
    assert after.incomplete == 0
    assert learner.publish() == "bc@v2"  # v1: the untrained LoRA the learner published on construction
    published = AdapterStore(tmp_path / "adapters").resolve("bc@v2")
    assert published.rank == 8
    # The published files are the trained adapter: loaded afresh, they decode exactly as the model did.
    reloaded = build_peft_model(learner.preset, config.learner, published.path)
    assert greedy_completions(reloaded, fixed, table, learner.pad_id) == greedy_completions(
        learner.peft, fixed, table, learner.pad_id
    )
    learner.engine.destroy()


@pytest.mark.slow
def test_imitation_end_to_end_through_the_learner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command: teacher shards in the cache, the DeepSpeed learner trained with objective='bc',
    the warm start published after the learner's untrained first version; a second run reads the cache."""
    from diprl.imitation.run import run

    args = [
        "data.games=2",
        "data.max_year=1901",
        "data.heldout_examples=4",
        "data.workers=1",
        "steps=2",
        "batch_size=8",
        f"out={tmp_path / 'run'}",
        f"adapter_root={tmp_path / 'adapters'}",
        "quiet=true",
    ]
    report = run(load_imitate_config(args), cache=tmp_path / "cache")
    assert report["version"] == "main@v2"  # v1: the learner's untrained LoRA
    # two steps of at most 8 decisions, made of whole states (7 seats of a movement phase, fewer in adjustments)
    assert report["data_generated"] and 2 <= report["records_trained"] <= 2 * 8
    assert report["after"]["incomplete"] == 0 and report["after"]["decisions"] == 4
    assert len(read_shards(report["data_dir"]).train) == report["train_examples"]
    assert (tmp_path / "run" / "imitate_report.json").is_file()
    again = run(load_imitate_config([*args, "epochs=1"]), cache=tmp_path / "cache")
    assert not again["data_generated"] and again["data_dir"] == report["data_dir"]
    assert again["version"] == "main@v4"
    # the lr decays over the epoch's steps to 0 and reaches it only after the last one
    lrs = [json.loads(line)["lr"] for line in Path(again["learner_metrics"]).read_text().splitlines()]
    lrs = lrs[-again["steps"] :]
    assert again["steps"] > 2 and lrs == sorted(lrs, reverse=True) and lrs[-1] > 0
