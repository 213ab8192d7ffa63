"""Learner benchmark: throughput of full GRPO steps next to a bare PEFT training loop on the same batches.

    python -m diprl.bench learner [--groups 4] [--forks 8] [--steps 4] [--lagged 0.0] [--model tiny]

Groups come from mid-game movement states (8+ units) with the uniform constrained sampler's
completions and random +-1 advantages. Each timed round runs one full `Learner.train_step` (mask
rebuild, recompute passes, DeepSpeed ZeRO-2 forward/backward with accumulation, optimiser, EMA,
publishing every step, one checkpoint in the run) and one step of a bare loop on a second copy of
the model: PEFT forward over the same padded micro-batches, plain (unmasked) log-softmax of the
completion tokens, advantage-weighted NLL, backward, grad-norm clip, torch AdamW. Rounds alternate,
so both see the same machine load.

`--lagged` is the fraction of groups sampled by the previous version: those need the recompute
pass under that version's weights (the price of a correct ratio under policy lag).

Tokens are prompt + completion tokens processed (unpadded), the same count for both loops. Last line:
`learner_tokens_per_s=<x> learner_efficiency=<learner tokens/s / bare tokens/s>`.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries


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
        records = [
            TrainingRecord(
                r.prompt_ids,
                r.token_ids,
                r.logprobs,
                legal,
                [a] * len(r.token_ids),
                version,
                1.0,
                power,
                game.phase,
                a,
            )
            for r, a in zip(results, advantages, strict=True)
        ]
        groups.append(TrajectoryGroup(f"g{i}", "bench", power, game.phase, version, records, advantages, 1.0))
    return groups


class BareLoop:
    """PEFT + torch AdamW, nothing else: the yardstick for the learner's overheads."""

    def __init__(self, preset: Any, config: Any) -> None:
        import torch

        from diprl.learn.model import CompletionHidden, build_peft_model

        self.module = CompletionHidden(build_peft_model(preset, config))
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.config = config

    def step(self, batches: list[Any]) -> None:
        import torch

        total = sum(mb.num_tokens for mb in batches)
        for mb in batches:
            hidden = self.module(mb.input_ids, mb.attention_mask, mb.rows, mb.cols)
            logits = torch.nn.functional.linear(hidden, self.module.lm_head_weight).float()
            logp = torch.log_softmax(logits, dim=-1).gather(1, mb.targets.unsqueeze(-1)).squeeze(-1)
            (-(mb.advantages * logp).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from diprl.bench.constraint import mid_game_states
    from diprl.learn.batching import micro_batches
    from diprl.learn.config import LearnerConfig
    from diprl.learn.learner import Learner
    from diprl.policy.models import resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer

    # One tick per learner step (the first is the untimed warm-up), after the model loads.
    bar = progress_bar(args.steps + 1, "learner steps", bar_enabled(args.quiet), "step")
    states = mid_game_states(args.groups * (args.steps + 1), seed=args.seed)
    with bar, tempfile.TemporaryDirectory(prefix="diprl-bench-learner-") as tmp:
        config = LearnerConfig(
            model=args.model,
            micro_batch_tokens=args.micro_batch_tokens,
            groups_per_step=args.groups,
            checkpoint_every=args.steps + 1,  # one checkpoint, in the last timed round
            publish_every=1,
            max_policy_lag=2,
            kl_coef=args.kl_coef,
            use_gpu=torch.cuda.is_available(),
            bf16=args.bf16,
        )
        learner = Learner(config, Path(tmp) / "run", Path(tmp) / "adapters")
        tokenizer = load_tokenizer(resolve_model_path(learner.preset))
        bare = BareLoop(learner.preset, config)
        if config.use_gpu:
            bare.module.cuda()
        prepare_time = 0.0
        learner_times: list[float] = []
        bare_times: list[float] = []
        splits: dict[str, list[float]] = {}
        tokens_per_step: list[int] = []
        previous = learner.latest_version()
        for round_ in range(args.steps + 1):
            current = learner.latest_version()
            n_lagged = round(args.lagged * args.groups)
            versions = [previous] * n_lagged + [current] * (args.groups - n_lagged)
            chunk = states[round_ * args.groups : (round_ + 1) * args.groups]
            groups = make_groups(chunk, args.forks, versions, learner.table, tokenizer, seed=args.seed + round_)
            records = [r for g in groups for r in g["records"]]
            t0 = time.perf_counter()
            prepared = learner._prepare(records, rl=True)
            prepare_time = time.perf_counter() - t0
            batches = [
                mb.to(learner.device) for _, mb in micro_batches(prepared, config.micro_batch_tokens, 1, learner.pad_id)
            ]
            tokens = sum(r.length for r in prepared)
            t0 = time.perf_counter()
            bare.step(batches)
            bare_s = time.perf_counter() - t0
            previous = current
            t0 = time.perf_counter()
            metrics = learner.train_step(groups)
            learner_s = time.perf_counter() - t0
            bar.update()
            if round_ == 0:
                continue  # warm-up
            learner_times.append(learner_s)
            bare_times.append(bare_s)
            tokens_per_step.append(tokens)
            for key in (
                "time_recompute_s",
                "time_fwd_bwd_s",
                "time_optimizer_s",
                "time_publish_s",
                "time_checkpoint_s",
            ):
                splits.setdefault(key, []).append(float(metrics.metrics[key]))
        learner.engine.destroy()
    total_tokens = sum(tokens_per_step)
    learner_tps = total_tokens / sum(learner_times)
    bare_tps = total_tokens / sum(bare_times)
    out = {
        "tokens_per_step": statistics.fmean(tokens_per_step),
        "learner_step_s": statistics.fmean(learner_times),
        "bare_step_s": statistics.fmean(bare_times),
        "learner_tokens_per_s": learner_tps,
        "bare_tokens_per_s": bare_tps,
        "efficiency": learner_tps / bare_tps,
        "mask_rebuild_s": prepare_time,
        "peak_rss_gib": _peak_rss_gib(),
        **{k: statistics.fmean(v) for k, v in splits.items()},
    }
    if torch.cuda.is_available():
        out["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench learner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4, help="groups per step")
    parser.add_argument("--forks", type=int, default=8, help="completions per group")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--lagged", type=float, default=0.0, help="fraction of groups from the previous version")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the EMA reference pass")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    if not 0 <= args.lagged <= 1 or args.steps < 1 or args.groups < 1 or args.forks < 1:
        parser.error("need --steps, --groups, --forks >= 1 and 0 <= --lagged <= 1")
    r = run(args)
    print(
        f"{args.groups} groups x {args.forks} forks per step, {r['tokens_per_step']:.0f} tokens per step, "
        f"{args.steps} timed steps"
    )
    print(f"learner step: {r['learner_step_s']:.3f} s ({r['learner_tokens_per_s']:.0f} tokens/s)")
    print(f"bare PEFT + AdamW step: {r['bare_step_s']:.3f} s ({r['bare_tokens_per_s']:.0f} tokens/s)")
    print("learner step split (mean s): " + ", ".join(f"{k[5:-2]} {r[k]:.3f}" for k in r if k.startswith("time_")))
    print(
        f"peak RSS {r['peak_rss_gib']:.2f} GiB"
        + (f", peak CUDA {r['peak_cuda_gib']:.2f} GiB" if "peak_cuda_gib" in r else "")
    )
    print(f"learner_tokens_per_s={r['learner_tokens_per_s']:.1f} learner_efficiency={r['efficiency']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
