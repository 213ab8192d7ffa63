"""Imitation warm start: clone a rule bot's orders into a LoRA adapter and publish it as a version.

    python -m diprl.learn.imitate teacher=dumbbot games=40 [model=tiny policy=main steps=200 out=runs/imitate]

DipNet and AlphaStar both learn by imitation before RL. Here it gives a random-init CPU model (or a
14B one) a known starting strength: teacher games are played and tokenized (`diprl.learn.teacher`),
the adapter is trained by behaviour cloning (masked negative log-likelihood of the teacher's
completion tokens under the same constraint masks the sampler applies), published to the
`AdapterStore` as `<policy>@v<N>`, and scored by order agreement with the teacher on states of
held-out games, before and after. Agreement is measured on the policy's own greedy constrained
decode (torch, under the same masks), i.e. on what the PolicyServer would play at temperature 0,
not on teacher-forced likelihoods.

Training is the learner's own: `Learner.train_records(records, objective="bc")` in this process
(DeepSpeed ZeRO-2 and the GRPO learner's masked recompute, so imitation and RL share one code path
for masks, micro-batching, optimiser and publishing). The learner publishes the untrained LoRA as
the policy's first version on construction, so the warm start is the next one. The "after" agreement
is measured on the published version loaded back from the store.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from diprl.console import bar_enabled, progress_bar, quiet_libraries
from diprl.game import PowerOrders
from diprl.learn.teacher import (
    PHASE_CLASSES,
    TeacherConfig,
    TeacherData,
    TeacherError,
    TeacherExample,
    generate,
    phase_class,
    read_shards,
    teacher_bot,
    write_shards,
)
from diprl.messages import StepReport, TrainingRecord
from diprl.policy.constraint import CLOSE_TAG, OrderConstraint
from diprl.policy.vocab import TokenTable


class ConfigError(ValueError):
    """A bad command line or config value (unknown key, wrong type, out of range)."""


@dataclass
class ImitateConfig:
    """Everything `python -m diprl.learn.imitate` accepts as `key=value`."""

    teacher: str = "dumbbot"  # a rule bot: `dumbbot` or `bot:dumbbot`
    games: int = 40  # teacher games played (all seven seats by the teacher)
    heldout_games: int | None = None  # whole games held out for agreement (default: a fifth)
    max_year: int = 1905  # teacher games stop after this year
    train_examples: int | None = None  # cap on training decisions (stratified); None keeps all
    heldout_examples: int = 200  # held-out decisions scored for agreement (stratified)
    model: str = "tiny"  # model preset (conf/model/<name>.yaml)
    policy: str = "main"  # publishes <policy>@v<N>
    steps: int = 200  # optimiser steps
    batch_size: int = 8  # decisions per optimiser step
    lr: float = 1e-2  # LoRA on a random-init base; 5e-2 diverged on a fixed set (docs/imitation.md)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    out: str = "runs/imitate"  # run directory: teacher shards, metrics, report
    adapter_root: str = "runs/adapters"  # the AdapterStore the PolicyServer serves from
    reuse_data: bool = False  # read <out>/teacher instead of playing the games again
    eval_batch_size: int = 16
    # torch threads. 1 by default: on a shared 2-core machine two OpenMP threads spin-wait on each
    # other and a step ran 10x slower than with one (measured); 0 leaves torch's default.
    threads: int = 1
    quiet: bool = False  # no progress bars (they show only when stderr is a terminal anyway)
    verbose: bool = False  # library logs (DeepSpeed, transformers, torch) at INFO instead of WARNING

    def __post_init__(self) -> None:
        try:
            teacher_bot(self.teacher)
        except TeacherError as exc:
            raise ConfigError(str(exc)) from None
        problems = []
        for name in ("steps", "batch_size", "heldout_examples", "eval_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            problems.append(f"lr must be positive, got {self.lr}")
        if self.threads < 0:
            problems.append(f"threads must be >= 0, got {self.threads}")
        if problems:
            raise ConfigError("imitate config: " + "; ".join(problems))

    def teacher_config(self) -> TeacherConfig:
        try:
            return TeacherConfig(
                teacher=self.teacher,
                games=self.games,
                heldout_games=self.heldout_games,
                max_year=self.max_year,
                seed=self.seed,
                train_examples=self.train_examples,
                heldout_examples=self.heldout_examples,
            )
        except TeacherError as exc:
            raise ConfigError(str(exc)) from None


def parse_args(argv: Sequence[str]) -> ImitateConfig:
    """`key=value` arguments (Hydra's override syntax, without a config tree) into an `ImitateConfig`.

    An unknown key names the known ones, a value of the wrong type names the key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    known = [f.name for f in fields(ImitateConfig)]
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {arg!r} (keys: {', '.join(known)})")
        if key.lstrip("+~") not in known:
            raise ConfigError(f"unknown key {key!r}; known keys: {', '.join(known)}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ImitateConfig), OmegaConf.from_dotlist(list(argv)))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"bad value for {key}: {str(exc).splitlines()[0]}") from None
    assert isinstance(config, ImitateConfig)
    return config


# ------------------------------------------------------------------------------------ model


def load_policy_model(preset_name: str, init: str | Path | None = None) -> tuple[Any, Any, TokenTable, str]:
    """(PEFT model with a trainable LoRA from the preset, tokenizer, token table, base model path).

    The base is loaded from the same directory vLLM serves, so the published adapter's
    `base_model` matches what the PolicyServer checks. `init` is a PEFT adapter directory to
    start from instead of a fresh LoRA (B = 0, exactly the base model).
    """
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from diprl.policy.models import load_preset, resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table

    preset = load_preset(preset_name)
    path = resolve_model_path(preset)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, preset.dtype))
    if init is not None:
        model = PeftModel.from_pretrained(base, str(init), is_trainable=True)
    else:
        lora = LoraConfig(
            r=preset.lora.rank,
            lora_alpha=preset.lora.alpha,
            lora_dropout=preset.lora.dropout,
            target_modules=list(preset.lora.target_modules),
        )
        model = get_peft_model(base, lora)
    tokenizer = load_tokenizer(path)
    table = token_table(tokenizer, int(base.config.vocab_size))
    return model, tokenizer, table, str(path)


# --------------------------------------------------------------------------------- training


class RecordTrainer(Protocol):
    """What behaviour cloning needs from a trainer (`diprl.learn.Learner` is the one used)."""

    def train_records(self, records: list[TrainingRecord], objective: str = "bc") -> StepReport: ...

    def publish(self) -> str: ...


# ------------------------------------------------------------------------------ agreement


def greedy_decode(
    model: Any, examples: Sequence[TeacherExample], table: TokenTable, batch_size: int = 16, max_new_tokens: int = 512
) -> list[list[int]]:
    """The policy's greedy completion for each example under the constraint (what the
    PolicyServer would write at temperature 0), batched with left padding and a KV cache."""
    import torch

    outputs: list[list[int]] = []
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            constraints = [OrderConstraint(PowerOrders.from_dict(e.legal), table) for e in batch]
            width = max(len(e.prompt_ids) for e in batch)
            pad = table.eos_id
            ids = torch.tensor([[pad] * (width - len(e.prompt_ids)) + list(e.prompt_ids) for e in batch], device=device)
            attention = torch.tensor(
                [[0] * (width - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in batch], device=device
            )
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            out = model(
                input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
            )
            generated: list[list[int]] = [[] for _ in batch]
            done = [False] * len(batch)
            for _ in range(max_new_tokens):
                logits = out.logits[:, -1].float()
                chosen = []
                for row, constraint in enumerate(constraints):
                    if done[row]:
                        chosen.append(pad)
                        continue
                    allowed = constraint.allowed_token_ids(generated[row])
                    token = int(allowed[int(torch.argmax(logits[row, torch.from_numpy(allowed)]))])
                    generated[row].append(token)
                    chosen.append(token)
                    if token == table.eos_id:
                        done[row] = True
                if all(done):
                    break
                attention = torch.cat([attention, torch.ones(len(batch), 1, dtype=attention.dtype)], dim=-1)
                positions = positions[:, -1:] + 1
                out = model(
                    input_ids=torch.tensor(chosen, device=device).unsqueeze(-1),
                    attention_mask=attention,
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                    logits_to_keep=1,
                )
            outputs.extend(generated)
    return outputs


def completion_orders(completion_ids: Sequence[int], table: TokenTable) -> list[str]:
    """The order lines of a constrained completion (text before `</orders>`, EOS dropped)."""
    text = "".join(table.text(i) or "" for i in completion_ids if i != table.eos_id)
    body = text.split(CLOSE_TAG, 1)[0]
    return [line for line in body.split("\n") if line]


@dataclass
class Agreement:
    """Order agreement with the teacher.

    `per_unit`: over all units (movement, retreat) and adjustment slots, the fraction where the
    policy gave the teacher's order (adjustments compare the multisets of build/disband/WAIVE
    orders, since sites are chosen, not given). `exact`: the fraction of decisions whose whole
    order set equals the teacher's. `by_class`: per-unit agreement per phase class.
    """

    per_unit: float
    exact: float
    units: int
    decisions: int
    by_class: dict[str, float] = field(default_factory=dict)
    incomplete: int = 0


def agreement(examples: Sequence[TeacherExample], completions: Sequence[Sequence[int]], table: TokenTable) -> Agreement:
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    if not examples:
        raise ValueError("agreement needs at least one held-out example")
    matched: Counter[str] = Counter()
    slots: Counter[str] = Counter()
    exact = incomplete = 0
    for example, completion in zip(examples, completions, strict=True):
        legal = PowerOrders.from_dict(example.legal)
        teacher = Counter(example.orders)
        policy = Counter(completion_orders(completion, table))
        if not completion or completion[-1] != table.eos_id:
            incomplete += 1
        cls = phase_class(legal.kind)
        matched[cls] += sum((teacher & policy).values())
        slots[cls] += legal.n_required
        exact += int(teacher == policy)
    units = sum(slots.values())
    return Agreement(
        per_unit=sum(matched.values()) / units,
        exact=exact / len(examples),
        units=units,
        decisions=len(examples),
        by_class={c: matched[c] / slots[c] for c in PHASE_CLASSES if slots[c]},
        incomplete=incomplete,
    )


def evaluate_agreement(
    model: Any, examples: Sequence[TeacherExample], table: TokenTable, batch_size: int = 16
) -> Agreement:
    return agreement(examples, greedy_decode(model, examples, table, batch_size), table)


# ------------------------------------------------------------------------------------- run


def _progress(total: int, desc: str, quiet: bool) -> Any:
    return progress_bar(total, desc, bar_enabled(quiet))


def train_bc(
    trainer: RecordTrainer,
    records: Sequence[TrainingRecord],
    steps: int,
    batch_size: int,
    seed: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """`steps` optimiser steps over seeded shuffled passes of `records` (every record once per epoch)."""
    if not records:
        raise ValueError("no training records")
    rng = random.Random(f"bc:{seed}")
    order: list[int] = []
    history = []
    for _ in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(records)))
            rng.shuffle(epoch)
            order.extend(epoch)
        batch, order = order[:batch_size], order[batch_size:]
        metrics = trainer.train_records([records[i] for i in batch], objective="bc").record()
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
    return history


def teacher_data(config: ImitateConfig, tokenizer: Any, table: TokenTable, run_dir: Path) -> TeacherData:
    """Play and write the teacher data, or read it back with `reuse_data=true`."""
    if config.reuse_data:
        return read_shards(run_dir)
    teacher_config = config.teacher_config()
    with _progress(teacher_config.games, "teacher games", config.quiet) as bar:
        data = generate(teacher_config, tokenizer, table, progress=bar.update)
    write_shards(data, run_dir)
    return data


def make_learner(config: ImitateConfig, run_dir: Path) -> Any:
    """The policy's learner in this process; it publishes `config.policy`'s untrained first version."""
    from diprl.learn.config import LearnerConfig
    from diprl.learn.learner import Learner

    learner_config = LearnerConfig(
        policy=config.policy,
        model=config.model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        publish_every=config.steps + 1,  # one version at the end: `run` publishes it
        checkpoint_every=0,
        seed=config.seed,
    )
    return Learner(learner_config, run_dir, config.adapter_root)


def run(config: ImitateConfig) -> dict[str, Any]:
    """Generate (or read) teacher data, score, train, publish, score again; returns the report,
    also written to `<out>/imitate_report.json` (metrics per step in `<out>/imitate_metrics.jsonl`)."""
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    run_dir = Path(config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    from diprl.policy.models import load_preset, resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(load_preset(config.model)))
    learner = make_learner(config, run_dir)
    table = learner.table
    data = teacher_data(config, tokenizer, table, run_dir)
    if not data.train or not data.heldout:
        raise TeacherError(f"teacher data has {len(data.train)} train and {len(data.heldout)} held-out examples")
    records = [e.to_training_record() for e in data.train]

    timings: dict[str, float] = {}
    start = time.perf_counter()
    before = evaluate_agreement(learner.peft, data.heldout, table, config.eval_batch_size)
    timings["eval_before_s"] = time.perf_counter() - start

    metrics_path = run_dir / "imitate_metrics.jsonl"
    start = time.perf_counter()
    with open(metrics_path, "w", encoding="utf-8") as log, _progress(config.steps, "bc steps", config.quiet) as bar:

        def on_step(metrics: dict[str, Any]) -> None:
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")

        history = train_bc(learner, records, config.steps, config.batch_size, config.seed, on_step)
    timings["train_s"] = time.perf_counter() - start
    version = learner.publish()

    start = time.perf_counter()
    from diprl.inference.adapters import AdapterStore

    published, _, _, _ = load_policy_model(config.model, init=AdapterStore(config.adapter_root).resolve(version).path)
    after = evaluate_agreement(published, data.heldout, table, config.eval_batch_size)
    timings["eval_after_s"] = time.perf_counter() - start
    tail = history[-min(10, len(history)) :]
    report = {
        "version": version,
        "teacher": teacher_bot(config.teacher),
        "model": config.model,
        "train_examples": len(data.train),
        "heldout_examples": len(data.heldout),
        "heldout_games": data.summary.get("heldout_games"),
        "steps": config.steps,
        "loss_first": history[0]["loss"],
        "loss_last10": sum(m["loss"] for m in tail) / len(tail),
        "tokens_per_s": sum(m["tokens"] for m in history) / max(timings["train_s"], 1e-9),
        "before": asdict(before),
        "after": asdict(after),
        "timings": timings,
        "config": asdict(config),
    }
    (run_dir / "imitate_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("keys: " + ", ".join(f"{f.name}={f.default!r}" for f in fields(ImitateConfig) if f.default is not None))
        return 0
    try:
        config = parse_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    quiet_libraries(config.verbose)
    report = run(config)
    before, after = report["before"], report["after"]
    print(
        f"teacher={report['teacher']} model={report['model']} train={report['train_examples']} "
        f"heldout={report['heldout_examples']} steps={report['steps']} "
        f"loss {report['loss_first']:.3f}->{report['loss_last10']:.3f} "
        f"exact {before['exact']:.3f}->{after['exact']:.3f} train_s={report['timings']['train_s']:.0f}"
    )
    print(
        f"agreement_before={before['per_unit']:.4f} agreement_after={after['per_unit']:.4f} version={report['version']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
