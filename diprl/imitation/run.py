"""One imitation run: teacher data (cached), agreement before, behaviour cloning, publish, agreement after.

DipNet and AlphaStar both learn by imitation before RL. Here it gives a random-init CPU model (or a
14B one) a known starting strength. The learner is the GRPO learner in this process; it publishes
the untrained LoRA as the policy's first version on construction, so the warm start is the next one.
The "after" agreement is measured on the published version loaded back from the store: what is
scored is what the PolicyServer will serve.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diprl.console import bar_enabled, progress_bar
from diprl.imitation.agreement import Agreement, evaluate_agreement
from diprl.imitation.config import ImitateConfig
from diprl.imitation.data import TeacherData
from diprl.imitation.shards import cached_teacher_data
from diprl.imitation.teacher import TeacherError, TeacherExample
from diprl.imitation.train import planned_batches, train_bc
from diprl.torch_threads import set_torch_threads

if TYPE_CHECKING:
    from diprl.policy.models import ModelPreset

REPORT = "imitate_report.json"


def make_learner(config: ImitateConfig, run_dir: Path) -> Any:
    """The policy's learner in this process; it publishes `config.learner.policy`'s untrained first version."""
    from diprl.learn.learner import Learner
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import build_model

    build_model(config.learner.model)  # the imitation command's set-up: the learner only looks it up
    return Learner(config.learner, LearnerSite(run_dir, config.adapter_root))


def teacher_data(
    config: ImitateConfig, cache: Path | None = None, preset: ModelPreset | None = None
) -> tuple[TeacherData, Path, bool]:
    """The teacher data for the learner's model, or `preset` (played now, or read back from the cache)."""
    from diprl.policy.models import load_preset, logits_width, preset_tokenizer_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table

    preset = preset if preset is not None else load_preset(config.learner.model)
    tokenizer = load_tokenizer(preset_tokenizer_path(preset))
    table = token_table(tokenizer, logits_width(preset))
    with progress_bar(config.data.games, "teacher games", bar_enabled(config.quiet)) as bar:
        data, directory, generated = cached_teacher_data(config.data, tokenizer, table, cache, bar.update)
    if not data.train or not data.heldout:
        raise TeacherError(f"teacher data has {len(data.train)} train and {len(data.heldout)} held-out examples")
    return data, directory, generated


def data_report(data: TeacherData, directory: Path, generated: bool) -> dict[str, Any]:
    """What a report says of its teacher data: where they are, whether played now, their summary and sizes."""
    return {
        "data_dir": str(directory),
        "data_generated": generated,
        "data": {k: v for k, v in data.summary.items() if k not in ("strata", "config")},
        "train_examples": len(data.train),
        "heldout_examples": len(data.heldout),
    }


def published_agreement(config: ImitateConfig, version: str, heldout: list[TeacherExample], learner: Any) -> Agreement:
    """Agreement of the version as published: its adapter read back from the store onto a fresh base."""
    from diprl.inference.adapters import AdapterStore
    from diprl.learn.model import build_peft_model

    path = AdapterStore(config.adapter_root).resolve(version).path
    model = build_peft_model(learner.preset, config.learner, path)
    return evaluate_agreement(model, heldout, learner.table, learner.pad_id, config.eval_batch_size)


def run(config: ImitateConfig, cache: Path | None = None) -> dict[str, Any]:
    """The whole run; returns the report, also written to `<out>/imitate_report.json`.

    `cache` is the cache root of the teacher data (default `diprl.cache.cache_root()`).
    """
    import torch

    if config.threads:
        set_torch_threads(config.threads)
    torch.manual_seed(config.learner.seed)
    run_dir = Path(config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    data, data_dir, generated = teacher_data(config, cache)
    timings["data_s"] = time.perf_counter() - start

    steps = 0 if config.epochs > 0 else config.steps
    # Planned once: the lr decays over exactly the batches trained.
    batches = list(planned_batches(data.train, config.batch_size, config.learner.seed, steps, config.epochs))
    if config.lr_decay and not config.learner.lr_decay_steps:
        config = replace(config, learner=replace(config.learner, lr_decay_steps=len(batches)))
    learner = make_learner(config, run_dir)
    start = time.perf_counter()
    before = evaluate_agreement(learner.peft, data.heldout, learner.table, learner.pad_id, config.eval_batch_size)
    timings["eval_before_s"] = time.perf_counter() - start

    deadline = time.perf_counter() + config.max_minutes * 60 if config.max_minutes else None
    start = time.perf_counter()
    with progress_bar(len(batches), "bc steps", bar_enabled(config.quiet)) as bar:

        def on_step(metrics: dict[str, Any]) -> bool:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}")
            return deadline is not None and time.perf_counter() > deadline

        history = train_bc(learner, data.train, batches, on_step)
    timings["train_s"] = time.perf_counter() - start
    version = learner.publish()

    start = time.perf_counter()
    after = published_agreement(config, version, data.heldout, learner)
    timings["eval_after_s"] = time.perf_counter() - start
    trained = [m for m in history if m.get("trained")]
    if not trained:
        raise RuntimeError("no behaviour-cloning step was taken (see the learner's quarantine file)")
    tail = trained[-min(20, len(trained)) :]
    records = sum(int(m["records"]) for m in trained)
    step_s = sum(float(m["time_step_s"]) for m in trained)
    report = {
        "version": version,
        "teacher": data.summary.get("teacher"),
        "opponents": data.summary.get("opponents", []),
        "model": config.learner.model,
        **data_report(data, data_dir, generated),
        "steps": len(history),
        "records_trained": records,
        "epochs": records / len(data.train),
        "loss_first": trained[0]["loss"],
        "loss_last": sum(m["loss"] for m in tail) / len(tail),
        "learner_records_per_s": records / max(step_s, 1e-9),
        "learner_tokens_per_s": sum(int(m["tokens"]) for m in trained) / max(step_s, 1e-9),
        "before": asdict(before),
        "after": asdict(after),
        "timings": timings,
        "learner_metrics": str(learner.metrics_path),
        "config": asdict(config),
    }
    (run_dir / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What the command prints; the last line is `agreement_before=<x> agreement_after=<y> version=<v>`."""
    before, after, data, t = report["before"], report["after"], report["data"], report["timings"]
    rate = f"{data['decisions_per_s']:.0f} decisions/s" if report["data_generated"] else "cached"
    kinds = " ".join(f"{k}={v:.3f} ({after['units_by_kind'][k]} units)" for k, v in sorted(after["by_kind"].items()))
    return [
        f"teacher={report['teacher']} opponents={','.join(report['opponents']) or report['teacher']} "
        f"model={report['model']} train={report['train_examples']} heldout={report['heldout_examples']}",
        f"data_s={t['data_s']:.0f} ({rate}) train_s={t['train_s']:.0f} steps={report['steps']} "
        f"epochs={report['epochs']:.2f} learner_records_per_s={report['learner_records_per_s']:.1f} "
        f"loss {report['loss_first']:.3f}->{report['loss_last']:.3f} exact {before['exact']:.3f}->{after['exact']:.3f}",
        f"agreement_after_by_kind: {kinds}",
        f"agreement_before={before['per_unit']:.4f} agreement_after={after['per_unit']:.4f} "
        f"version={report['version']}",
    ]
