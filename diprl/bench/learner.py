"""Learner benchmark: full GRPO steps with and without shared prefixes, next to a bare loop, on the same batches.

    python -m diprl.bench learner [--groups 4] [--forks 8] [--steps 4] [--lagged 0.0] [--model tiny]
        [--micro-batch-tokens 8192] [--prefix-min-tokens 16] [--gradient-checkpointing] [--bf16] [--ranks 1]
        [--adapters 1]

Groups come from mid-game movement states (8+ units) with the uniform constrained sampler's
completions and random +-1 advantages. Each timed round runs, on the same groups:

- one full `Learner.train_step` with shared prefixes (`learner.prefix_sharing`, the default: each
  micro-batch is a prefix tree forwarded as one sequence) and one without (one padded row per
  record), in alternating order, so each path takes the recompute pass under the previous version's
  weights in half of the rounds (the second step of a round trains groups one version old). A step
  is everything: mask rebuild, recompute passes, DeepSpeed ZeRO-2 forward/backward with
  accumulation, optimiser, EMA, publishing every step, one checkpoint in the run;
- one step of a bare loop on the shared path's micro-batches: PEFT forward, plain (unmasked)
  log-softmax of the completion tokens, advantage-weighted NLL, backward, grad-norm clip, torch AdamW.
  It trains a LoRA adapter of its own added to the learner's model for its step (and removed after,
  so the learner never publishes or checkpoints it): the frozen base is shared, never copied.

`--lagged` is the fraction of groups sampled by the previous version: those need the recompute
pass under that version's weights (the price of a correct ratio under policy lag).

`--ranks N` (N > 1) instead compares learner groups (`learner.ranks`): one rank and N ranks, each a Ray
actor as in a run (a local Ray, or `$RAY_ADDRESS`), take the same full steps on the same batches,
publishing every step; their tokens/s are printed side by side, and `rank_parity=` is the largest
absolute difference between their LoRA weights after two steps (the same update, up to float
summation order). Every rank, and the one-rank learner, is a Ray actor of one CPU (one torch thread).

`--adapters N` (N > 1) instead trains N policies on one learner host against N learners of their own
(`diprl.bench.learner_adapters`).

Tokens are prompt + completion tokens of the records (unpadded), the same count for every path; the
tokens each path forwards are printed beside. Last line: `learner_tokens_per_s=<shared>
learner_unshared_tokens_per_s=<x> learner_efficiency=<shared learner / bare> prefix_share_speedup=<shared
/ unshared>`.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries
from diprl.messages import PolicyRef

BARE_ADAPTER = "bare"
SPLITS = ("time_recompute_s", "time_fwd_bwd_s", "time_optimizer_s", "time_publish_s", "time_checkpoint_s")


def add_batch_options(
    parser: argparse.ArgumentParser, steps: int | None, steps_help: str, groups: int, forks: int
) -> None:
    """The options of the batches `make_groups` builds, one set for every learner bench (learner, canary,
    faults): how many steps, groups per step and records per group, and the seed of the states and samples."""
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--groups", type=int, default=groups, help="groups per learner step")
    parser.add_argument("--forks", type=int, default=forks, help="records (completions) per group")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mid-game states and the sampled completions")


def make_groups(
    states: list[tuple[Any, str]], forks: int, versions: list[str], table: Any, tokenizer: Any, seed: int
) -> list[Any]:
    from diprl.messages import GenerationRequest, TrainingRecord, TrajectoryGroup
    from diprl.policy.prompt import build_prompt
    from diprl.rollout.clients import UniformConstrainedClient

    rng = random.Random(seed)
    client = UniformConstrainedClient(table, seed=seed, tokenizer=tokenizer)
    groups = []
    for i, ((game, power), version) in enumerate(zip(states, versions, strict=True)):
        legal = game.legal_orders(power).to_dict()
        request = GenerationRequest(policy=version, prompt=build_prompt(game, power).text, legal=legal)
        results = client.generate([request] * forks)
        advantages = [rng.choice([-1.0, 1.0]) for _ in results]
        ref = PolicyRef.parse(version)
        records = [
            TrainingRecord(
                r.prompt_ids,
                r.token_ids,
                r.logprobs,
                legal,
                [a] * len(r.token_ids),
                ref,
                1.0,
                power,
                game.phase,
                a,
            )
            for r, a in zip(results, advantages, strict=True)
        ]
        groups.append(TrajectoryGroup(f"g{i}", "bench", power, game.phase, ref, records, advantages, 1.0))
    return groups


class BareLoop:
    """PEFT + torch AdamW, nothing else, on the learner's own model: the yardstick for the learner's overheads.

    Each step adds a fresh LoRA adapter of the learner's shape to the learner's PEFT model, trains it
    (the learner's adapter inactive, so its weights, gradients and DeepSpeed hooks are untouched) and
    removes it. Its weights start fresh every step: the cost of a step does not depend on their values.
    """

    def __init__(self, learner: Any) -> None:
        self.learner = learner

    def step(self, batches: list[Any]) -> tuple[float, float]:
        """(wall, CPU) seconds of one forward/backward/clip/AdamW step on `batches` (adapter set-up not counted)."""
        import torch

        from diprl.learn.model import CompletionHidden

        peft = self.learner.peft
        peft.add_adapter(BARE_ADAPTER, peft.peft_config["default"])
        try:
            peft.set_adapter(BARE_ADAPTER)
            params = [p for n, p in peft.named_parameters() if p.requires_grad and f".{BARE_ADAPTER}." in n]
            optimizer = torch.optim.AdamW(params, lr=self.learner.config.lr, weight_decay=0.0)
            hidden_of = CompletionHidden(peft)  # the learner's own backbone, without its LM head
            total = sum(mb.num_tokens for mb in batches)
            t0, cpu0 = time.perf_counter(), time.process_time()
            for mb in batches:
                hidden = hidden_of(mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.prefix)
                logits = torch.nn.functional.linear(hidden, hidden_of.lm_head_weight).float()
                logp = torch.log_softmax(logits, dim=-1).gather(1, mb.targets.unsqueeze(-1)).squeeze(-1)
                (-(mb.advantages * logp).sum() / total).backward()
            torch.nn.utils.clip_grad_norm_(params, self.learner.config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            peft.set_adapter("default")
            peft.delete_adapter(BARE_ADAPTER)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@dataclass
class _Path:
    """What one path of the benchmark measured over the timed rounds."""

    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # CPU seconds, all threads: steadier on a shared machine
    forwarded: list[int] = field(default_factory=list)
    splits: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SPLITS})
    peak_cuda_gib: float = 0.0


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from diprl.bench.constraint import mid_game_states
    from diprl.learn.batching import micro_batches
    from diprl.learn.config import LearnerConfig
    from diprl.learn.learner import Learner
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer

    cuda = torch.cuda.is_available()
    # One tick per round (the first is the untimed warm-up), after the model loads.
    bar = progress_bar(args.steps + 1, "learner rounds", bar_enabled(args.quiet), "round")
    states = mid_game_states(args.groups * (args.steps + 1), seed=args.seed)
    paths = {"shared": _Path(), "unshared": _Path(), "bare": _Path()}
    with bar, tempfile.TemporaryDirectory(prefix="diprl-bench-learner-") as tmp:
        config = LearnerConfig(
            model=args.model,
            micro_batch_tokens=args.micro_batch_tokens,
            groups_per_step=args.groups,
            checkpoint_every=2 * (args.steps + 1),  # one checkpoint, in the last timed round
            publish_every=1,
            max_policy_lag=4,  # a round's second step sees its groups one version older
            kl_coef=args.kl_coef,
            use_gpu=cuda,
            bf16=args.bf16,
            gradient_checkpointing=args.gradient_checkpointing,
            prefix_sharing=True,
            prefix_min_tokens=args.prefix_min_tokens,
        )
        learner = Learner(config, LearnerSite(Path(tmp) / "run", Path(tmp) / "adapters"))
        tokenizer = load_tokenizer(resolve_model_path(learner.preset))
        bare = BareLoop(learner)
        published = [learner.latest_version()]
        tokens_per_step: list[int] = []
        completion_per_step: list[int] = []
        prepare_time = 0.0
        for round_ in range(args.steps + 1):
            current, previous = published[-1], published[-2] if len(published) > 1 else published[-1]
            n_lagged = round(args.lagged * args.groups)
            versions = [previous] * n_lagged + [current] * (args.groups - n_lagged)
            chunk = states[round_ * args.groups : (round_ + 1) * args.groups]
            groups = make_groups(chunk, args.forks, versions, learner.table, tokenizer, seed=args.seed + round_)
            records = [r for g in groups for r in g.records]
            t0 = time.perf_counter()
            prepared = learner._prepare(records, rl=True)
            prepare_time = time.perf_counter() - t0
            batches = [
                mb.to(learner.device)
                for _, mb in micro_batches(
                    prepared, config.micro_batch_tokens, 1, learner.pad_id, config.prefix_min_tokens
                )
            ]
            timed = round_ > 0  # the first round warms up
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            bare_s, bare_cpu = bare.step(batches)
            if timed:
                paths["bare"].times.append(bare_s)
                paths["bare"].cpu_times.append(bare_cpu)
                paths["bare"].forwarded.append(sum(mb.padded_tokens for mb in batches))
                if cuda:
                    paths["bare"].peak_cuda_gib = max(
                        paths["bare"].peak_cuda_gib, torch.cuda.max_memory_allocated() / 2**30
                    )
            order = ("shared", "unshared") if round_ % 2 == 0 else ("unshared", "shared")
            for name in order:
                learner.config.prefix_sharing = name == "shared"
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0, cpu0 = time.perf_counter(), time.process_time()
                metrics = learner.train_step(groups)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                if not metrics.trained:
                    raise RuntimeError(f"the {name} learner step trained nothing: {metrics}")
                published.append(learner.latest_version())
                if timed:
                    path = paths[name]
                    path.times.append(elapsed)
                    path.cpu_times.append(cpu)
                    path.forwarded.append(int(metrics.metrics["padded_tokens"]))
                    for key in SPLITS:
                        path.splits[key].append(float(metrics.metrics[key]))
                    if cuda:
                        path.peak_cuda_gib = max(path.peak_cuda_gib, torch.cuda.max_memory_allocated() / 2**30)
            learner.config.prefix_sharing = True
            if timed:
                tokens_per_step.append(sum(r.length for r in prepared))
                completion_per_step.append(sum(len(r.completion_ids) for r in prepared))
            bar.update()
        learner.engine.destroy()
    total_tokens = sum(tokens_per_step)
    out: dict[str, float] = {
        "tokens_per_step": statistics.fmean(tokens_per_step),
        "completion_tokens_per_step": statistics.fmean(completion_per_step),
        "mask_rebuild_s": prepare_time,
        "peak_rss_gib": _peak_rss_gib(),
    }
    for name, path in paths.items():
        out[f"{name}_step_s"] = statistics.fmean(path.times)
        out[f"{name}_tokens_per_s"] = total_tokens / sum(path.times)
        out[f"{name}_cpu_s"] = statistics.fmean(path.cpu_times)
        out[f"{name}_forwarded_per_step"] = statistics.fmean(path.forwarded)
        for key, values in path.splits.items():
            if values:
                out[f"{name}_{key}"] = statistics.fmean(values)
        if cuda:
            out[f"{name}_peak_cuda_gib"] = path.peak_cuda_gib
    out["efficiency"] = out["shared_tokens_per_s"] / out["bare_tokens_per_s"]
    out["prefix_share_speedup"] = out["shared_tokens_per_s"] / out["unshared_tokens_per_s"]
    return out


def run_ranks(args: argparse.Namespace) -> dict[str, float]:
    """One rank against `args.ranks` ranks on the same batches: tokens/s of full steps, and parity after two."""
    import os
    from dataclasses import replace

    import ray
    import torch

    from diprl.bench.constraint import mid_game_states
    from diprl.inference.adapters import AdapterStore
    from diprl.learn.actor import learner_actor
    from diprl.learn.model import build_peft_model, read_adapter_dir
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import load_preset, resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table
    from diprl.raysession import ray_session

    cuda = torch.cuda.is_available()
    preset = load_preset(args.model)
    tokenizer = load_tokenizer(resolve_model_path(preset))
    table = token_table(tokenizer, preset.tiny.vocab_size if preset.tiny is not None else None)
    rounds = max(args.steps, 2) + 1  # the first is an untimed warm-up; parity is read after two steps
    states = mid_game_states(args.groups * rounds, seed=args.seed)
    batches = [
        make_groups(
            states[k * args.groups : (k + 1) * args.groups],
            args.forks,
            ["main@v1"] * args.groups,
            table,
            tokenizer,
            seed=args.seed + k,
        )
        for k in range(rounds)
    ]
    tokens = [sum(len(r.prompt_ids) + len(r.completion_ids) for g in b for r in g.records) for b in batches]
    config = actor_bench_config(args, rounds, cuda)
    like = build_peft_model(preset, config)
    out: dict[str, float] = {"tokens_per_step": statistics.fmean(tokens[1:])}
    weights: dict[int, dict[str, Any]] = {}
    # A local Ray declares a CPU per rank even on a smaller machine (the ranks then share cores); a
    # cluster ($RAY_ADDRESS) has its own.
    local: dict[str, Any] = (
        {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(args.ranks + 1, os.cpu_count() or 1)}
    )
    bar = progress_bar(2 * rounds, "learner steps (1 rank, then groups)", bar_enabled(args.quiet), "step")
    with (
        bar,
        ray_session(**local),
        tempfile.TemporaryDirectory(prefix="diprl-bench-ranks-") as tmp,
    ):
        for n in (1, args.ranks):
            root = Path(tmp) / f"ranks-{n}"
            actor = learner_actor(
                replace(config, ranks=n), LearnerSite(root / "run", root / "adapters"), name=f"learner-bench-{n}"
            )
            ray.get(actor.pid_of.remote())
            times: list[float] = []
            splits: dict[str, list[float]] = {key: [] for key in SPLITS}
            for k, batch in enumerate(batches):
                version = PolicyRef.parse(ray.get(actor.latest_version.remote()))
                labelled = [
                    replace(g, policy_version=version, records=[replace(r, policy_version=version) for r in g.records])
                    for g in batch
                ]
                t0 = time.perf_counter()
                report = ray.get(actor.train_step.remote(labelled))
                if report is None or not report.trained:
                    raise RuntimeError(f"the {n}-rank learner step trained nothing: {report}")
                if k > 0:
                    times.append(time.perf_counter() - t0)
                    for key in SPLITS:
                        splits[key].append(float(report.metrics[key]))
                if k == 1:
                    path = AdapterStore(root / "adapters").resolve(str(report.version)).path
                    weights[n] = read_adapter_dir(path, like)
                bar.update()
            out[f"ranks_{n}_step_s"] = statistics.fmean(times)
            out.update({f"ranks_{n}_{key}": statistics.fmean(values) for key, values in splits.items()})
            out[f"ranks_{n}_tokens_per_s"] = sum(tokens[1:]) / sum(times)
            ray.kill(actor)
    one, many = weights[1], weights[args.ranks]
    out["rank_parity"] = max(float((one[k] - many[k]).abs().max()) for k in one)
    out["speedup"] = out[f"ranks_{args.ranks}_tokens_per_s"] / out["ranks_1_tokens_per_s"]
    return out


def actor_bench_config(args: argparse.Namespace, rounds: int, cuda: bool) -> Any:
    """The learner config of the benchmarks that compare learner actors on the same batches (`--ranks`,
    `--adapters`): no checkpoint cadence, every round's groups trainable, the command line's model options."""
    from diprl.learn.config import LearnerConfig

    return LearnerConfig(
        model=args.model,
        micro_batch_tokens=args.micro_batch_tokens,
        groups_per_step=args.groups,
        checkpoint_every=0,
        max_policy_lag=rounds,
        kl_coef=args.kl_coef,
        use_gpu=cuda,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        prefix_min_tokens=args.prefix_min_tokens,
    )


def _split_line(r: dict[str, float], name: str) -> str:
    return ", ".join(f"{key[5:-2]} {r[f'{name}_{key}']:.3f}" for key in SPLITS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench learner", description=__doc__.split("\n\n")[0])
    add_batch_options(parser, 4, "timed rounds (after one warm-up round)", groups=4, forks=8)
    parser.add_argument("--lagged", type=float, default=0.0, help="fraction of groups from the previous version")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the EMA reference pass")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens forwarded per micro-batch")
    parser.add_argument("--prefix-min-tokens", type=int, default=16, help="shortest prefix the shared path shares")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--ranks", type=int, default=1, help="> 1: compare 1 and this many learner ranks instead")
    parser.add_argument(
        "--adapters", type=int, default=1, help="> 1: this many policies on one learner host against as many learners"
    )
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    if not 0 <= args.lagged <= 1 or args.steps < 1 or args.groups < 1 or args.forks < 1:
        parser.error("need --steps, --groups, --forks >= 1 and 0 <= --lagged <= 1")
    if args.prefix_min_tokens < 1:
        parser.error("need --prefix-min-tokens >= 1")
    if args.ranks < 1 or args.adapters < 1 or (args.ranks > 1 and args.adapters > 1):
        parser.error("need --ranks >= 1 and --adapters >= 1, not both above 1")
    if args.adapters > 1:
        from diprl.bench.learner_adapters import print_adapters, run_adapters

        return print_adapters(args, run_adapters(args))
    if args.ranks > 1:
        return _print_ranks(args, run_ranks(args))
    r = run(args)
    print(
        f"{args.groups} groups x {args.forks} forks per step, {r['tokens_per_step']:.0f} tokens per step "
        f"({r['completion_tokens_per_step']:.0f} of them completion), {args.steps} timed rounds"
    )
    print(
        f"forwarded per step: {r['shared_forwarded_per_step']:.0f} tokens with shared prefixes, "
        f"{r['unshared_forwarded_per_step']:.0f} without (padded rows)"
    )
    print(f"learner step, shared prefixes: {r['shared_step_s']:.3f} s ({r['shared_tokens_per_s']:.0f} tokens/s)")
    print(f"learner step, unshared: {r['unshared_step_s']:.3f} s ({r['unshared_tokens_per_s']:.0f} tokens/s)")
    print(
        f"bare PEFT + AdamW step (shared micro-batches): {r['bare_step_s']:.3f} s "
        f"({r['bare_tokens_per_s']:.0f} tokens/s)"
    )
    if "shared_peak_cuda_gib" not in r:
        print(
            f"CPU seconds per step (all threads): shared {r['shared_cpu_s']:.3f}, unshared {r['unshared_cpu_s']:.3f}, "
            f"bare {r['bare_cpu_s']:.3f} (unshared / shared {r['unshared_cpu_s'] / r['shared_cpu_s']:.2f})"
        )
    print(f"learner step split, shared (mean s): {_split_line(r, 'shared')}")
    print(f"learner step split, unshared (mean s): {_split_line(r, 'unshared')}")
    cuda = ", ".join(
        f"{name} {r[f'{name}_peak_cuda_gib']:.2f}"
        for name in ("shared", "unshared", "bare")
        if f"{name}_peak_cuda_gib" in r
    )
    print(f"peak RSS {r['peak_rss_gib']:.2f} GiB" + (f"; peak CUDA GiB: {cuda}" if cuda else ""))
    print(
        f"learner_tokens_per_s={r['shared_tokens_per_s']:.1f} "
        f"learner_unshared_tokens_per_s={r['unshared_tokens_per_s']:.1f} "
        f"learner_efficiency={r['efficiency']:.3f} prefix_share_speedup={r['prefix_share_speedup']:.3f}"
    )
    return 0


def _print_ranks(args: argparse.Namespace, r: dict[str, float]) -> int:
    n = args.ranks
    print(
        f"{args.groups} groups x {args.forks} forks per step, {r['tokens_per_step']:.0f} tokens per step, "
        f"{max(args.steps, 2)} timed steps each (full steps: recompute, ZeRO-2 forward/backward, optimiser, publish)"
    )
    print(f"1 rank:  {r['ranks_1_step_s']:.3f} s per step ({r['ranks_1_tokens_per_s']:.0f} tokens/s)")
    print(f"{n} ranks: {r[f'ranks_{n}_step_s']:.3f} s per step ({r[f'ranks_{n}_tokens_per_s']:.0f} tokens/s)")
    for name in ("ranks_1", f"ranks_{n}"):
        print(f"step split, {name.replace('_', ' ')} (mean s, rank 0): {_split_line(r, name)}")
    print(
        f"learner_tokens_per_s_1={r['ranks_1_tokens_per_s']:.1f} learner_tokens_per_s_{n}="
        f"{r[f'ranks_{n}_tokens_per_s']:.1f} rank_speedup={r['speedup']:.3f} rank_parity={r['rank_parity']:.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
