"""LoRA on vLLM's CPU engine: its own row-wise ops against ours (`diprl.inference.cpu_lora`), side by side.

    python -m diprl.bench cpu-lora [--rounds 3] [--requests 48] [--quiet] [--verbose]

The ops are chosen when vLLM starts (a general plugin, in every process it makes), so each side runs in a
child process of its own: `DIPRL_VLLM_CPU_LORA=vllm` keeps vLLM's ops, the default puts ours in place. Each
round runs both children, in alternating order (vLLM's first in even rounds), so a machine that gets busier
or quieter weighs on both sides alike.

Two workloads of constrained mid-game order requests through the bare engine of the tiny preset, greedy:
every request on one adapter (a run's rollouts: the current version), and a mixed batch, a third each for
two published adapters and for `base`, with `max_loras=2` so that the adapters hold every slot (as a
league's versions do). A child prints the generated tokens per second of each (best of two passes after a
warm-up), and `base_drift`: the largest difference between the log-probabilities of the base requests
served in the mixed batch and served alone. vLLM's ops give a base row the last slot's adapter, so its
drift is far from 0; ours leave base rows to the base.

Last line: `cpu_lora_speedup=<median over rounds of ours / vLLM's tokens/s, one adapter>
cpu_lora_mixed_speedup=<the same, mixed batch> base_drift_vllm=<x> base_drift_ours=<y>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.bench.preload import compare, run_module
from diprl.console import add_console_flags, bar_enabled, progress_bar
from diprl.inference.cpu_lora import SWITCH

RESULT = re.compile(
    r"^one_adapter_tokens_per_s=([0-9.]+) mixed_tokens_per_s=([0-9.]+) base_drift=([0-9.e+-]+)$", re.MULTILINE
)


def child_result(output: str) -> tuple[float, float, float]:
    """(one adapter tokens/s, mixed tokens/s, base drift) a child printed last; a clear error when it printed
    none (it failed)."""
    found = RESULT.findall(output)
    if not found:
        raise RuntimeError(f"the benchmark child printed no result line; its output ended:\n{output[-2000:]}")
    one, mixed, drift = found[-1]
    return float(one), float(mixed), float(drift)


def _child(requests: int) -> int:
    from diprl.bench.inference import order_requests
    from diprl.bench.vocab import tokens_of
    from diprl.inference.adapters import AdapterStore
    from diprl.inference.config import ServerConfig
    from diprl.inference.policy_engine import PolicyEngine
    from diprl.policy.models import build_model, save_random_lora

    build_model("tiny")
    root = Path(tempfile.mkdtemp(prefix="diprl-bench-cpu-lora-"))
    store = AdapterStore(root / "adapters")
    names = [str(store.publish(f"p{i}", save_random_lora(root / f"src{i}", seed=100 + i))) for i in range(2)]
    config = ServerConfig(model="tiny", adapter_root=str(root / "adapters"), max_loras=2, log_level="WARNING")
    mixed = [replace(r, temperature=0.0) for r in order_requests(requests, [*names, "base"])]
    one = [replace(r, policy=names[0]) for r in mixed]
    alone = [r for r in mixed if r.policy == "base"]

    async def run() -> tuple[float, float, float]:
        engine = PolicyEngine(config)

        async def rate(batch: list[Any]) -> tuple[float, list[Any]]:
            best, served = 0.0, []
            for _ in range(2):
                start = time.perf_counter()
                served = await engine.generate(batch)
                best = max(best, tokens_of(served) / (time.perf_counter() - start))
            return best, served

        try:
            await engine.generate(mixed[:6])  # warm-up: both adapters loaded
            one_rate, _ = await rate(one)
            mixed_rate, served = await rate(mixed)
            by_itself = await engine.generate(alone)
            in_batch = [g for r, g in zip(mixed, served, strict=True) if r.policy == "base"]
            drift = max(
                abs(a - b)
                for x, y in zip(in_batch, by_itself, strict=True)
                for a, b in zip(x.logprobs, y.logprobs, strict=False)
            )
            return one_rate, mixed_rate, drift
        finally:
            engine.shutdown()

    one_rate, mixed_rate, drift = asyncio.run(run())
    print(
        f"one_adapter_tokens_per_s={one_rate:.3f} mixed_tokens_per_s={mixed_rate:.3f} base_drift={drift:.6g}",
        flush=True,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench cpu-lora", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_console_flags(parser)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.requests)
    if args.rounds < 1 or args.requests < 3:
        parser.error("--rounds must be at least 1 and --requests at least 3")
    print(f"CPU LoRA benchmark: {args.requests} greedy constrained requests over 2 adapters and base, tiny preset")
    print(
        f"{'round':<7}{'one adapter tok/s: vLLM ops':>29}{'ours':>8}{'ratio':>7}"
        f"{'mixed tok/s: vLLM ops':>23}{'ours':>8}{'ratio':>7}"
    )
    rows: list[str] = []
    drifts = {False: 0.0, True: 0.0}
    mixed: dict[bool, float] = {}
    mixed_ratios: list[float] = []

    def measure(ours: bool) -> float:
        env = {SWITCH: None} if ours else {SWITCH: "vllm"}
        output = run_module("diprl.bench.cpu_lora", ["--child", "--requests", str(args.requests)], env)
        one, mixed[ours], drift = child_result(output)
        drifts[ours] = max(drifts[ours], drift)
        return one

    bar = progress_bar(args.rounds, "rounds", bar_enabled(args.quiet), "round")
    with bar:

        def on_round(i: int, stock: float, ours: float) -> None:
            mixed_ratios.append(mixed[True] / mixed[False])
            rows.append(
                f"{i:<7}{stock:>29.1f}{ours:>8.1f}{ours / stock:>7.2f}"
                f"{mixed[False]:>23.1f}{mixed[True]:>8.1f}{mixed_ratios[-1]:>7.2f}"
            )
            bar.update()

        speedup = compare(args.rounds, measure, on_round)
    print("\n".join(rows))
    print(
        "base drift (base requests in the mixed batch against alone, largest |logprob| difference): "
        f"vLLM ops {drifts[False]:.3g}, ours {drifts[True]:.3g}"
    )
    print(
        f"cpu_lora_speedup={speedup:.3f} cpu_lora_mixed_speedup={statistics.median(mixed_ratios):.3f} "
        f"base_drift_vllm={drifts[False]:.3g} base_drift_ours={drifts[True]:.3g}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
