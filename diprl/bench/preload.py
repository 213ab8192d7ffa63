"""Does preloading an allocator (or an OpenMP runtime) speed the CPU engine up? Measured, not assumed.

    python -m diprl.bench preload [--rounds 3] [--requests 48] [--with-iomp] [--quiet] [--verbose]

vLLM's CPU worker warns when libtcmalloc and Intel's OpenMP runtime (libiomp5) are not in `LD_PRELOAD`,
the first advice of its CPU guide. A library preloaded must be there before the process starts, so the
comparison cannot share one process: each round runs the same workload in two child processes, one plain
and one with the libraries preloaded, in alternating order (plain first in even rounds), so a machine that
gets busier or quieter during the run weighs on both sides alike. By default the preloaded side gets what a
PolicyServer replica starts its engine core with (tcmalloc, `inference.preload_tcmalloc`); `--with-iomp`
adds the environment's libiomp5.

The workload is the inference benchmark's first part: constrained mid-game order requests (temperature 1)
through the bare vLLM engine of the tiny preset, tokens per second after a warm-up. Each child prints its
rate on its last line (`tokens_per_s=<x>`); the ratio of each round is taken side by side.

Last line: `preload_speedup=<median over rounds of preloaded / plain tokens/s> preload=<libraries, ':'-joined>`.
Exits 1 when no library to preload is found (nothing to compare).
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from diprl.console import add_console_flags, bar_enabled, progress_bar
from diprl.inference.engine import find_tcmalloc

RATE = re.compile(r"^tokens_per_s=(?P<rate>[0-9.]+)$", re.MULTILINE)


def preload_libraries(
    prefix: str = sys.prefix, find: Callable[[str], str | None] = ctypes.util.find_library, with_iomp: bool = False
) -> list[str]:
    """The libraries to preload that this machine has: tcmalloc wherever the loader finds it (what the engine
    core is started with, `diprl.inference.engine.find_tcmalloc`), and with `with_iomp` Intel's OpenMP
    runtime from the environment's `lib` (the `intel-openmp` wheel puts it there) before it."""
    found = []
    iomp = Path(prefix) / "lib" / "libiomp5.so"
    if with_iomp and iomp.is_file():
        found.append(str(iomp))
    tcmalloc = find_tcmalloc(find)
    if tcmalloc:
        found.append(tcmalloc)
    return found


def child_rate(output: str) -> float:
    """The tokens/s a child printed last; a clear error when it printed none (it failed)."""
    rates = RATE.findall(output)
    if not rates:
        raise RuntimeError(f"the benchmark child printed no tokens_per_s line; its output ended:\n{output[-2000:]}")
    return float(rates[-1])


def run_module(module: str, argv: Sequence[str], env: Mapping[str, str | None]) -> str:
    """`python -m module argv` in a child process with `env`'s variables set (None: removed); its stdout,
    or a clear error with the end of its output when it exits non-zero."""
    child_env = dict(os.environ)
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    done = subprocess.run(
        [sys.executable, "-m", module, *argv], env=child_env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark child exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout


def run_child(requests: int, preload: Sequence[str]) -> float:
    env = {"LD_PRELOAD": ":".join(preload) if preload else None}
    return child_rate(run_module("diprl.bench.preload", ["--child", "--requests", str(requests)], env))


def compare(rounds: int, measure: Callable[[bool], float], on_round: Callable[[int, float, float], None]) -> float:
    """Median over `rounds` of preloaded / plain rate, the two sides alternating which runs first."""
    ratios = []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        rates = {preloaded: measure(preloaded) for preloaded in order}
        on_round(i, rates[False], rates[True])
        ratios.append(rates[True] / rates[False])
    return statistics.median(ratios)


def _child(requests: int) -> int:
    from diprl.bench.inference import bare_engine, order_requests
    from diprl.inference.config import ServerConfig
    from diprl.policy.models import build_model

    build_model("tiny")
    with tempfile.TemporaryDirectory(prefix="diprl-bench-preload-") as adapters:  # base only: stays empty
        config = ServerConfig(model="tiny", adapter_root=adapters, log_level="WARNING")
        rate, _ = bare_engine(config, order_requests(requests, ["base"]), rounds=2)
    print(f"tokens_per_s={rate:.3f}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench preload", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--with-iomp", action="store_true", help="also preload the environment's libiomp5")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_console_flags(parser)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.requests)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    preload = preload_libraries(with_iomp=args.with_iomp)
    if not preload:
        print("nothing to preload: no libtcmalloc on this machine (Debian's libtcmalloc-minimal4; make install)")
        return 1
    print(f"preload benchmark: {args.requests} constrained requests, bare vLLM CPU engine, tiny preset")
    print(f"preloaded: {':'.join(preload)}")
    print(f"{'round':<8}{'plain tokens/s':>16}{'preloaded tokens/s':>20}{'ratio':>8}")
    rows: list[str] = []
    bar = progress_bar(args.rounds, "rounds", bar_enabled(args.quiet), "round")
    with bar:

        def on_round(i: int, plain: float, preloaded: float) -> None:
            rows.append(f"{i:<8}{plain:>16.1f}{preloaded:>20.1f}{preloaded / plain:>8.2f}")
            bar.update()

        speedup = compare(
            args.rounds, lambda preloaded: run_child(args.requests, preload if preloaded else []), on_round
        )
    print("\n".join(rows))
    print(f"preload_speedup={speedup:.3f} preload={':'.join(preload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
