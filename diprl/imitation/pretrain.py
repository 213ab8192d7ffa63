"""Pretraining a CPU body on the game: every weight of a tiny Qwen3 trained on teacher decisions.

    python -m diprl.imitation.pretrain [model=tiny_pretrained data.games=640 epochs=2 ...]

A real LLM base (Qwen3-8B) arrives pretrained and LoRA only steers it; the tiny CPU stand-in starts
as a seeded random network, so everything it can learn must fit in a rank-8/32 LoRA on a frozen random
body. This stage makes the stand-in faithful: the whole body (embeddings, which are also the tied LM
head, attention, MLPs, norms) is trained by masked negative log-likelihood of the teacher's orders, under
the same constraint masks, prompts and shared-prefix scoring as behaviour cloning and GRPO
(`diprl.learn.model.CompletionScorer`), then written as the checkpoint the preset `model` names. From
then on it is the preset's frozen `base`, served by vLLM and adapted by LoRA like any other.

A plain PyTorch AdamW loop, not the learner: the learner trains LoRA adapters and publishes them as
versions, while this trains a base, once, on a model of a few hundred thousand parameters that needs no
DeepSpeed. The data, their batches of whole game states, the masks and the loss are the learner's.
The last line is `agreement_before=<x> agreement_after=<y> model=<preset> path=<dir>`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diprl.imitation.data import TeacherConfig
from diprl.imitation.teacher import TeacherExample
from diprl.structured_config import Command, ConfigError, compose_structured, too_small
from diprl.torch_threads import set_torch_threads

PROG = "python -m diprl.imitation.pretrain"
SCHEMA_NAME = "pretrain_schema"
REPORT = "pretrain_report.json"


@dataclass
class PretrainConfig:
    """Everything `python -m diprl.imitation.pretrain` accepts as `key=value` (`data.games=640`, `lr=3e-3`)."""

    data: TeacherConfig = field(default_factory=TeacherConfig)
    # The preset to train: its `tiny` spec is the shape and tokenizer, its `path` where the body is written.
    model: str = "tiny_pretrained"
    # Where training starts: "" the preset's seeded random body; else a tiny preset with a path (of the same
    # spec) whose trained body is continued, as DAgger does (`python -m diprl.imitation.dagger`).
    init: str = ""
    epochs: float = 1.0  # passes over the training decisions
    batch_size: int = 64  # decisions per optimiser step, whole game states (a state is never split)
    lr: float = 3e-3  # AdamW's peak lr: a linear warmup over `warmup_steps`, then linear decay to 0
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # The loss weight of every token of a teacher's support line (1: the plain NLL). DumbBot supports in
    # 15% of its orders and a greedy student in 5%: a weight above 1 tilts the student towards supports.
    support_weight: float = 1.0
    micro_batch_tokens: int = 16384  # tokens forwarded at once (packed prefix trees)
    prefix_min_tokens: int = 32  # the shortest prefix forwarded once for the records sharing it
    seed: int = 0
    max_minutes: float = 0.0  # > 0: stop after this many minutes of training (the lr schedule is unchanged)
    threads: int = 1  # torch threads (0: torch's default); 2 spin-waiting OpenMP threads on a shared machine crawl
    eval_batch_size: int = 32
    out: str = "runs/pretrain"  # the report and per-step metrics
    quiet: bool = False
    verbose: bool = False

    def __post_init__(self) -> None:
        problems = too_small(
            self, ("batch_size", "micro_batch_tokens", "eval_batch_size", "prefix_min_tokens"), 1, "positive"
        )
        if not self.epochs > 0:
            problems.append(f"epochs must be > 0, got {self.epochs}")
        if not (self.support_weight > 0 and math.isfinite(self.support_weight)):
            problems.append(f"support_weight must be positive and finite, got {self.support_weight}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"lr must be positive and finite, got {self.lr}")
        problems += too_small(self, ("warmup_steps", "threads", "weight_decay", "max_grad_norm", "max_minutes"), 0)
        if problems:
            raise ConfigError("pretrain config: " + "; ".join(problems))


def load_pretrain_config(overrides: Sequence[str], conf_dir: Path | None = None) -> PretrainConfig:
    """`conf/pretrain/default.yaml` with `overrides` applied, checked (every problem a `ConfigError`)."""
    return compose_structured(PretrainConfig, SCHEMA_NAME, "pretrain", overrides, conf_dir)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """The lr of optimiser step `step` (0-based) of `total`: linear warmup to `peak`, then linear decay to 0."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    remaining = max(total - warmup, 1)
    return peak * max(0.0, 1.0 - (step - warmup) / remaining)


def run(
    config: PretrainConfig,
    cache: Path | None = None,
    conf_dir: Path | None = None,
    extra_train: Sequence[TeacherExample] = (),
    extra_heldout: Sequence[TeacherExample] = (),
) -> dict[str, Any]:
    """The whole stage; returns the report, also written to `<out>/pretrain_report.json`.

    `cache` is the teacher data's cache root, `conf_dir` the `conf/` tree the preset is read from.
    `extra_train` joins the teacher data's training decisions (DAgger's labelled student states, whose
    game numbers must not meet the teacher games'), and agreement on `extra_heldout` is reported before and
    after as `extra_before` / `extra_after`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from diprl.atomic_io import replace_dir_atomic
    from diprl.imitation.agreement import evaluate_agreement
    from diprl.imitation.run import data_report, teacher_data
    from diprl.imitation.train import planned_batches
    from diprl.learn.batching import micro_batches, prepare_record
    from diprl.learn.loss import nll_loss
    from diprl.learn.model import CompletionScorer
    from diprl.learn.prefix_attention import use_prefix_attention
    from diprl.policy.models import (
        build_tiny_model,
        load_preset,
        pretrained_tiny_dir,
        repo_path,
        save_tiny_model,
    )

    preset = load_preset(config.model, conf_dir)
    if preset.tiny is None or not preset.path:
        raise ConfigError(
            f"model {config.model!r} is not a tiny preset with a path: pretraining writes a tiny body to the "
            "directory its preset's `path` names (see conf/model/tiny_pretrained.yaml)"
        )
    if config.threads:
        set_torch_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    # The teacher data are tokenised by the preset's tokenizer, which the random body ships too.
    random_body = build_tiny_model(preset.tiny)
    data, data_dir, generated = teacher_data(_imitation_view(config), cache, preset)
    train = [*data.train, *extra_train]
    clash = {e.game for e in data.train} & {e.game for e in extra_train}
    if clash:
        raise ValueError(f"extra training decisions reuse teacher game numbers {sorted(clash)[:5]}: states would merge")
    timings["data_s"] = time.perf_counter() - start

    start_body = random_body if not config.init else _init_body(config.init, preset, conf_dir)
    model = AutoModelForCausalLM.from_pretrained(str(start_body), dtype=torch.float32)
    model.config.use_cache = False
    use_prefix_attention(model)
    scorer = CompletionScorer(model)
    from diprl.policy.tokenizer import load_tokenizer, pad_token_id
    from diprl.policy.vocab import token_table

    tokenizer = load_tokenizer(random_body)
    table = token_table(tokenizer, preset.tiny.vocab_size)
    pad_id = pad_token_id(tokenizer)

    start = time.perf_counter()
    before = evaluate_agreement(model, data.heldout, table, pad_id, config.eval_batch_size)

    def extra_agreement(scored: Any) -> Any:
        return (
            evaluate_agreement(scored, extra_heldout, table, pad_id, config.eval_batch_size) if extra_heldout else None
        )

    extra_before = extra_agreement(model)
    timings["eval_before_s"] = time.perf_counter() - start

    weighted = config.support_weight != 1.0

    def weights(example: TeacherExample) -> list[float] | None:
        return example.token_weights(table, config.support_weight) if weighted else None

    batches = list(planned_batches(train, config.batch_size, config.seed, epochs=config.epochs))  # planned once
    total = len(batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    metrics_path = out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    deadline = time.perf_counter() + config.max_minutes * 60 if config.max_minutes else None
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    model.train()
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        prepared = [
            prepare_record(train[i].to_training_record(weights(train[i])), table, i,
                           need_rl_fields=weighted, max_len=preset.max_model_len)
            for i in batch
        ]  # fmt: skip
        tokens = sum(len(r.completion_ids) for r in prepared)
        loss_sum = prob_sum = 0.0
        for _, mb in micro_batches(prepared, config.micro_batch_tokens, 1, pad_id, config.prefix_min_tokens):
            logp, _ = scorer(mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, mb.temperatures,
                             mb.allowed, mb.prefix)  # fmt: skip
            loss, _ = nll_loss(logp, total_tokens=tokens, weights=mb.advantages if weighted else None)
            loss.backward()
            loss_sum += float(loss.detach())
            prob_sum += float(logp.detach().exp().sum())
        lr = lr_at(step, total, config.lr, config.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf")))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        row = {
            "step": step + 1,
            "loss": loss_sum,
            "token_p": prob_sum / max(tokens, 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "records": len(batch),
            "tokens": tokens,
            "time_step_s": time.perf_counter() - t0,
        }
        history.append(row)
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if not config.quiet and (step + 1) % 25 == 0:
            print(f"step {step + 1}/{total} loss {loss_sum:.3f} lr {lr:.2e}", file=sys.stderr, flush=True)
        if deadline is not None and time.perf_counter() > deadline:
            break
    timings["train_s"] = time.perf_counter() - start
    if not history:
        raise RuntimeError("no pretraining step was taken")

    target = repo_path(preset.path)
    spec = preset.tiny
    replace_dir_atomic(target, lambda tmp: save_tiny_model(model.eval(), spec, tmp))
    served = AutoModelForCausalLM.from_pretrained(str(pretrained_tiny_dir(preset)), dtype=torch.float32)
    start = time.perf_counter()
    after = evaluate_agreement(served, data.heldout, table, pad_id, config.eval_batch_size)
    extra_after = extra_agreement(served)
    timings["eval_after_s"] = time.perf_counter() - start
    tail = history[-min(20, len(history)) :]
    report = {
        "model": config.model,
        "path": str(target),
        "parameters": sum(p.numel() for p in model.parameters()),
        **data_report(data, data_dir, generated),
        "steps": len(history),
        "planned_steps": total,
        "records_trained": sum(int(r["records"]) for r in history),
        "loss_first": history[0]["loss"],
        "loss_last": sum(r["loss"] for r in tail) / len(tail),
        "extra_train_examples": len(extra_train),
        "before": asdict(before),
        "after": asdict(after),
        **({"extra_before": asdict(extra_before), "extra_after": asdict(extra_after)} if extra_heldout else {}),
        "timings": timings,
        "config": asdict(config),
    }
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


def _imitation_view(config: PretrainConfig) -> Any:
    """The imitation config `teacher_data` reads: the same data, tokenised for the preset pretrained."""
    from dataclasses import replace

    from diprl.imitation.config import ImitateConfig
    from diprl.learn.config import LearnerConfig

    return ImitateConfig(data=config.data, learner=replace(LearnerConfig(), model=config.model), quiet=config.quiet)


def _init_body(name: str, preset: Any, conf_dir: Path | None) -> Path:
    """The trained body of preset `name` to continue from: it must have `preset`'s spec (shape, tokenizer)."""
    from diprl.policy.models import load_preset, pretrained_tiny_dir

    start = load_preset(name, conf_dir)
    if start.tiny != preset.tiny or not start.path:
        raise ConfigError(
            f"init={name!r} must be a tiny preset with a path and the spec of model={preset.name!r}, "
            "to continue its body"
        )
    return pretrained_tiny_dir(start)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What the command prints; the last line is `agreement_before=<x> agreement_after=<y> model=<m> path=<p>`."""
    before, after, t = report["before"], report["after"], report["timings"]
    kinds = " ".join(f"{k}={v:.3f}" for k, v in sorted(after["by_kind"].items()))
    return [
        f"model={report['model']} parameters={report['parameters']} train={report['train_examples']} "
        f"heldout={report['heldout_examples']} steps={report['steps']}/{report['planned_steps']}",
        f"data_s={t['data_s']:.0f} train_s={t['train_s']:.0f} loss {report['loss_first']:.3f}->"
        f"{report['loss_last']:.3f} exact {before['exact']:.3f}->{after['exact']:.3f}",
        f"agreement_after_by_kind: {kinds}",
        f"agreement_before={before['per_unit']:.4f} agreement_after={after['per_unit']:.4f} "
        f"model={report['model']} path={report['path']}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 after the run or `--help`, 2 after a bad option (said on stderr)."""
    return Command(PROG, __doc__, load_pretrain_config).run(argv, lambda c: summary_lines(run(c)))


if __name__ == "__main__":
    sys.exit(main())
