"""Inference service benchmark: what the Serve deployment costs, what mixing adapters costs, and how
fast a published version is served.

    python -m diprl.bench inference [--requests 48] [--rounds 2] [--vocab-only] [--bodies] [--quiet] [--verbose]

0. The vocabulary (`diprl.bench.vocab`): the tiny body with Qwen's 151,936 ids and with the compact
   BPE, tokens and completions per second at batch 4, 16 and 64, side by side, with ratios.
   `--bodies` measures the candidate bodies for the `small` preset the same way; `--vocab-only`
   stops after this part.
1. The same constrained order requests (mid-game states, temperature 1) through the bare async engine
   (`PolicyEngine` in this process) and through the PolicyServer deployment (Ray Serve handle, one
   replica): tokens per second of each, best of `--rounds`.
2. Through the deployment: one batch where every request uses one adapter, and one where the requests
   are spread over 4 adapters: tokens per second of each (vLLM batches the adapters together).
3. Publish-to-served latency: publish a new version, then time until its first request returns, next to
   the latency of the same request on a version already loaded.

Last line: `serve_overhead=<bare engine tokens/s / deployment tokens/s>` (1.0 means no overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.bench.constraint import mid_game_states
from diprl.bench.vocab import tokens_of
from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries, ray_init_options
from diprl.messages import GenerationRequest


def order_requests(n: int, policies: Sequence[str]) -> list[GenerationRequest]:
    from diprl.policy.prompt import build_prompt

    states = mid_game_states(n)
    return [
        GenerationRequest(
            policy=policies[i % len(policies)],
            prompt=build_prompt(game, power).text,
            legal=game.legal_orders(power).to_dict(),
            temperature=1.0,
        )
        for i, (game, power) in enumerate(states)
    ]


def bare_engine(config: Any, requests: list[GenerationRequest], rounds: int) -> tuple[float, float]:
    """(tokens/s of the bare async engine, seconds per request spent validating it before the engine)."""
    from diprl.inference.policy_engine import PolicyEngine
    from diprl.inference.requests import validate_request

    async def run() -> tuple[float, float]:
        engine = PolicyEngine(config)
        try:
            await engine.generate(requests[:4])  # warm-up
            best = 0.0
            for _ in range(rounds):
                start = time.perf_counter()
                tokens = tokens_of(await engine.generate(requests))
                best = max(best, tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            for request in requests:  # what every request costs before it reaches the engine
                engine.prepare(validate_request(request.to_dict(), engine.limits))
            return best, (time.perf_counter() - start) / len(requests)
        finally:
            engine.shutdown()

    return asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench inference", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vocab-only", action="store_true", help="only the vocabulary comparison")
    parser.add_argument("--bodies", action="store_true", help="also measure the candidate bodies for `small`")
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)

    from diprl.bench import vocab

    candidates = vocab.tiny_pair() + (vocab.body_candidates() if args.bodies else [])
    print(f"vocabulary: {len(candidates)} models, 64 constrained mid-game order requests, bare vLLM CPU engine")
    rates = vocab.compare(
        candidates, order_requests(64, ["base"]), on_row=lambda c, r: print(vocab.row_text(c, r), flush=True)
    )
    print(vocab.report(candidates, rates) + "\n")
    if args.vocab_only:
        return 0

    from diprl.inference.adapters import AdapterStore
    from diprl.inference.config import ServerConfig
    from diprl.inference.deploy import serving
    from diprl.policy.models import build_model, save_random_lora
    from diprl.raysession import ray_session

    build_model("tiny")  # once, up front: the random adapters' base and the server look it up
    root = Path(tempfile.mkdtemp(prefix="diprl-bench-inference-"))
    store = AdapterStore(root / "adapters")
    sources = [save_random_lora(root / f"src{i}", seed=100 + i) for i in range(5)]
    names = [str(store.publish(f"p{i}", sources[i])) for i in range(4)]
    # The replica gets as many CPUs as the bare engine's process has threads: Ray sets OMP_NUM_THREADS
    # from the actor's CPU count, and the vLLM engine inherits it.
    threads = len(os.sched_getaffinity(0))
    config = ServerConfig(
        model="tiny",
        adapter_root=str(root / "adapters"),
        replica_cpus=float(threads),
        log_level="INFO" if args.verbose else "WARNING",
    )
    base_requests = order_requests(args.requests, ["base"])
    print(f"inference benchmark: {args.requests} constrained mid-game order requests, tiny Qwen3, vLLM CPU")

    # A bar over the stages; every result is printed after it closes.
    bar = progress_bar(4, "bare async engine", bar_enabled(args.quiet), "stage")
    with bar:
        bare, validation_s = bare_engine(config, base_requests, args.rounds)
        bar.update()
        bar.set_description("starting the PolicyServer")
        with (
            ray_session(address="local", num_cpus=threads + 2, **ray_init_options(args.verbose)),
            serving(config) as handle,
        ):
            quiet_libraries(args.verbose)  # again: importing Ray Serve installs its own INFO-level logger
            bar.update()

            def through_serve(requests: list[GenerationRequest]) -> float:
                best = 0.0
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    tokens = tokens_of(handle.generate.remote(requests).result(timeout_s=600))
                    best = max(best, tokens / (time.perf_counter() - start))
                return best

            bar.set_description("one adapter vs base, through Serve")
            handle.generate.remote(base_requests[:4]).result(timeout_s=600)
            served = through_serve(base_requests)
            single = [replace(r, policy=names[0]) for r in base_requests]
            mixed = [replace(r, policy=names[i % 4]) for i, r in enumerate(base_requests)]
            handle.generate.remote(mixed[:8]).result(timeout_s=600)  # load all four adapters first
            one_adapter = through_serve(single)
            four_adapters = through_serve(mixed)
            bar.update()
            bar.set_description("publish to served")

            probe = [replace(base_requests[0], policy=names[1])]
            start = time.perf_counter()
            handle.generate.remote(probe).result(timeout_s=600)
            warm_latency = time.perf_counter() - start
            start = time.perf_counter()
            new_name = str(store.publish("fresh", sources[4]))
            publish_seconds = time.perf_counter() - start
            result = handle.generate.remote([replace(probe[0], policy=new_name)]).result(timeout_s=600)
            publish_to_served = time.perf_counter() - start
            tokens_of(result)
            bar.update()

    print(f"\n{'path':<34}{'tokens/s':>10}")
    print(f"{'bare async engine (in process)':<34}{bare:>10.1f}")
    print(f"{'PolicyServer (Serve handle)':<34}{served:>10.1f}")
    print(f"{'  batch on 1 adapter':<34}{one_adapter:>10.1f}")
    print(f"{'  batch mixing 4 adapters':<34}{four_adapters:>10.1f}")
    print(f"\nmixed / single adapter throughput: {four_adapters / one_adapter:.2f}")
    print(f"publish (atomic write): {1e3 * publish_seconds:.0f} ms", end="; ")
    print(f"publish to first served response: {publish_to_served:.2f} s")
    print(f"(the same request on an already loaded version: {warm_latency:.2f} s)")
    print(f"request validation (types, ranges, legal orders, tokenize, grammar): {1e3 * validation_s:.2f} ms/request")
    print(f"serve_overhead={bare / served:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
