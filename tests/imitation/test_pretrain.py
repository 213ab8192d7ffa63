"""Pretraining a tiny body: its schedule, its checks, scoring a plain model as the learner scores a PEFT one,
and a run that trains every weight and writes a body the preset then serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from diprl.imitation.data import TeacherData
from diprl.imitation.pretrain import load_pretrain_config, lr_at, run
from diprl.learn.batching import micro_batches, prepare_record
from diprl.learn.model import CompletionScorer
from diprl.policy.models import (
    CONF_DIR,
    load_preset,
    pretrained_tiny_dir,
    repo_path,
    resolve_model_path,
)
from diprl.policy.vocab import TokenTable
from diprl.structured_config import ConfigError


def test_bad_values_are_clear_errors() -> None:
    assert load_pretrain_config(["epochs=2", "data.games=30"]).epochs == 2
    with pytest.raises(ConfigError, match="epochs must be > 0"):
        load_pretrain_config(["epochs=0"])
    with pytest.raises(ConfigError, match="lr must be positive"):
        load_pretrain_config(["lr=-1e-3"])
    with pytest.raises(ConfigError, match="support_weight must be positive"):
        load_pretrain_config(["support_weight=0"])
    with pytest.raises(ConfigError, match="Key 'lrr' not in 'PretrainConfig'"):
        load_pretrain_config(["lrr=1"])


def test_lr_warms_up_then_decays_to_zero() -> None:
    # peak 1, two warmup steps, six steps: 1/2, 1, then down by 1/4 a step over the remaining four.
    assert [lr_at(s, 6, 1.0, 2) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert lr_at(0, 3, 2.0, 0) == 2.0 and lr_at(3, 3, 2.0, 0) == 0.0


def test_a_plain_model_is_scored_as_the_learner_scores_its_peft_model(
    data: TeacherData, tok: tuple[Any, TokenTable]
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, table = tok
    path = str(resolve_model_path(load_preset("tiny")))
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(r=4, target_modules=["q_proj"])
    )  # B = 0: the same function as the plain model
    prepared = [
        prepare_record(e.to_training_record(), table, i, need_rl_fields=False) for i, e in enumerate(data.train[:6])
    ]
    (_, mb), *_ = micro_batches(prepared, 1 << 20, 1, 0)
    args = (mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, mb.temperatures, mb.allowed)
    with torch.no_grad():
        ours, _ = CompletionScorer(plain)(*args)
        theirs, _ = CompletionScorer(peft)(*args)
    assert ours.shape == (sum(len(r.completion_ids) for r in prepared),)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert CompletionScorer(plain).lm_head_weight is plain.get_input_embeddings().weight


def _conf_with_body(tmp_path: Path, body: Path) -> Path:
    """A copy of conf/ whose `tiny_pretrained` writes its body to `body`."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    preset = conf / "model" / "tiny_pretrained.yaml"
    preset.write_text(preset.read_text().replace("path: zoo/bases/tiny_pretrained", f"path: {body}"))
    return conf


def test_pretraining_trains_every_weight_and_the_preset_serves_what_it_wrote(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    body = tmp_path / "body"
    conf = _conf_with_body(tmp_path, body)
    preset = load_preset("tiny_pretrained", conf)
    with pytest.raises(FileNotFoundError, match=r"python -m diprl\.imitation\.pretrain model=tiny_pretrained"):
        resolve_model_path(preset)
    config = load_pretrain_config(
        [
            "data.games=3", "data.heldout_games=1", "data.max_year=1901", "data.heldout_examples=12",
            "data.workers=1", "epochs=2", "batch_size=16", "lr=1e-2", "warmup_steps=0", "threads=1",
            f"out={tmp_path / 'run'}", "quiet=true",
        ]
    )  # fmt: skip
    report = run(config, cache=tmp_path / "cache", conf_dir=conf)

    assert resolve_model_path(preset) == body == Path(report["path"])
    random_body = load_file(str(resolve_model_path(load_preset("tiny")) / "model.safetensors"))
    trained = load_file(str(body / "model.safetensors"))
    assert set(trained) == set(random_body)
    unchanged = [n for n in trained if torch.equal(trained[n], random_body[n])]
    assert not unchanged, f"pretraining left these weights as they were: {unchanged}"
    assert report["loss_last"] < report["loss_first"]
    assert report["steps"] == report["planned_steps"] > 1
    saved = json.loads((tmp_path / "run" / "pretrain_report.json").read_text())
    assert saved["after"] == report["after"] and saved["parameters"] == report["parameters"] > 100_000
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == report["steps"]


def test_support_weight_reaches_the_loss_of_the_first_step(tmp_path: Path) -> None:
    """The same data, start and batches with and without weighting: before any update the weighted loss
    counts every support token three times, so it is larger (equal only if the weights never reached it)."""
    conf = _conf_with_body(tmp_path, tmp_path / "body")
    first_loss = {}
    for weight in (1.0, 3.0):
        out = tmp_path / f"run-{weight}"
        config = load_pretrain_config(
            [
                "data.games=3", "data.heldout_games=1", "data.max_year=1902", "data.heldout_examples=4",
                "data.workers=1", "epochs=0.1", "batch_size=32", "warmup_steps=0", "threads=1",
                f"support_weight={weight}", f"out={out}", "quiet=true",
            ]
        )  # fmt: skip
        run(config, cache=tmp_path / "cache", conf_dir=conf)
        first_loss[weight] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss[3.0] > first_loss[1.0] * 1.01


def test_a_body_that_does_not_fit_its_spec_is_refused(tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.mkdir()
    (body / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 2}))
    preset = load_preset("tiny_pretrained", _conf_with_body(tmp_path, body))
    with pytest.raises(ValueError, match=r"does not fit its spec: .*hidden_size 128 \(spec 64\)"):
        pretrained_tiny_dir(preset)


def test_a_relative_path_is_read_from_the_repository_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert repo_path("zoo/bases/x") == CONF_DIR.parent / "zoo" / "bases" / "x"
    assert repo_path(str(tmp_path)) == tmp_path


def test_a_start_of_another_spec_or_teacher_game_numbers_in_the_extra_decisions_are_refused(
    tmp_path: Path, data: TeacherData
) -> None:
    body = tmp_path / "body"
    conf = _conf_with_body(tmp_path, body)
    base = ["data.games=3", "data.heldout_games=1", "data.max_year=1901", "data.workers=1", "quiet=true",
            f"out={tmp_path / 'run'}"]  # fmt: skip
    with pytest.raises(ConfigError, match="init='tiny' must be a tiny preset with a path"):
        run(load_pretrain_config([*base, "init=tiny"]), cache=tmp_path / "cache", conf_dir=conf)
    with pytest.raises(ValueError, match="reuse teacher game numbers"):
        run(load_pretrain_config(base), cache=tmp_path / "cache", conf_dir=conf, extra_train=data.train[:3])
    assert not body.exists()
