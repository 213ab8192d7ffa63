"""`python -m diprl.bench learner --adapters N`: N policies trained by one learner host against N learners.

The same batches for N policies (mid-game movement states, the uniform constrained sampler's completions,
random +-1 advantages; each policy its own states) are trained three ways, each side Ray actors as in a
run, one torch thread a policy:

- **one host, parallel** (`diprl.learn.host.LearnerHost`, `learner.adapters_per_actor=N
  learner.host_parallel=true`): one process of N CPUs, the base loaded once, the N policies' steps of a
  round taken at once in threads of the actor;
- **N learners** (`learner.adapters_per_actor=1`): N processes of one CPU and one base each, the N steps of
  a round taken at once, as a run's driver keeps every learner stepping;
- and beside them **one host, serial** (the default host): one process of one CPU, the steps of a round
  one after another.

Every step is a full step (recompute, ZeRO-2 forward/backward, optimiser, publish with its canary). The
first round is an untimed warm-up. Tokens/s is each side's prompt + completion tokens over its rounds'
wall time; memory is each side's peak resident set (the host's process, the sum of the N learners'). After
two steps every policy of each side writes a checkpoint, and `adapter_parity` is the largest difference
between either host's LoRA weights and optimiser state (Adam moments, master weights), read back from them,
and the N learners'. `multi_adapter_*` compare the parallel host with the N learners (the same CPUs);
`serial_host_*` the serial one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.console import bar_enabled, progress_bar
from diprl.messages import PolicyRef

SIDES = ("parallel", "separate", "serial")  # the parallel host and the learners, both N CPUs; the serial host, 1


def policy_names(n: int) -> list[str]:
    return ["main", *(f"rival{i}" for i in range(1, n))]


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def run_adapters(args: argparse.Namespace) -> dict[str, float]:
    import os

    import ray
    import torch

    from diprl.bench.constraint import mid_game_states
    from diprl.bench.learner import actor_bench_config, make_groups
    from diprl.learn.actor import HostedLearner, learner_actor, learner_host_actor
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import load_preset, resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table
    from diprl.raysession import ray_session

    n = args.adapters
    policies = policy_names(n)
    preset = load_preset(args.model)
    tokenizer = load_tokenizer(resolve_model_path(preset))
    table = token_table(tokenizer, preset.tiny.vocab_size if preset.tiny is not None else None)
    rounds = max(args.steps, 2) + 1  # the first is an untimed warm-up; parity is read after two steps
    states = mid_game_states(args.groups * rounds * n, seed=args.seed)
    batches: dict[str, list[list[Any]]] = {}
    for i, policy in enumerate(policies):
        batches[policy] = []
        for k in range(rounds):
            start = (i * rounds + k) * args.groups
            chunk = states[start : start + args.groups]
            seed = args.seed + 1000 * i + k
            batches[policy].append(make_groups(chunk, args.forks, ["x@v1"] * args.groups, table, tokenizer, seed))
    tokens = [
        sum(len(r.prompt_ids) + len(r.completion_ids) for p in policies for g in batches[p][k] for r in g.records)
        for k in range(rounds)
    ]
    config = actor_bench_config(args, rounds, torch.cuda.is_available())  # a GPU each, where there are GPUs
    out: dict[str, float] = {"tokens_per_round": statistics.fmean(tokens[1:]), "adapters": n}
    states_after: dict[str, dict[str, dict[str, Any]]] = {}
    # A local Ray with a CPU for each of the N learners (on a smaller machine they share its cores).
    local: dict[str, Any] = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(n + 1, os.cpu_count() or 1)}
    title = f"learner rounds ({n} adapters: a parallel host, {n} learners, a serial host)"
    bar = progress_bar(len(SIDES) * rounds, title, bar_enabled(args.quiet))
    with bar, ray_session(**local), tempfile.TemporaryDirectory(prefix="diprl-bench-adapters-") as tmp:
        for side in SIDES:
            root = Path(tmp) / side
            configs = [replace(config, policy=p) for p in policies]
            if side != "separate":
                configs = [replace(c, host_parallel=side == "parallel") for c in configs]
                host = learner_host_actor(configs, LearnerSite(root / "run", root / "adapters"))
                handles: dict[str, Any] = {p: HostedLearner(host, p) for p in policies}
                actors = [host]
            else:
                handles = {
                    c.policy: learner_actor(
                        c, LearnerSite(root / "run", root / "adapters"), name=f"learner-bench-{c.policy}"
                    )
                    for c in configs
                }
                actors = list(handles.values())
            pids = sorted({int(ray.get(h.pid_of.remote())) for h in handles.values()})
            times: list[float] = []
            for k in range(rounds):
                versions = {p: str(ray.get(h.latest_version.remote())) for p, h in handles.items()}
                labelled = {p: _labelled(batches[p][k], versions[p]) for p in handles}
                t0 = time.perf_counter()
                reports = ray.get([h.train_step.remote(labelled[p]) for p, h in handles.items()])
                if k > 0:
                    times.append(time.perf_counter() - t0)
                if not all(r is not None and r.trained for r in reports):
                    raise RuntimeError(f"a {side} step trained nothing: {reports}")
                if k == 1:
                    paths = ray.get([h.save_checkpoint.remote() for h in handles.values()])
                    states_after[side] = {p: _trained_state(Path(path)) for p, path in zip(handles, paths, strict=True)}
                bar.update()
            out[f"{side}_round_s"] = statistics.fmean(times)
            out[f"{side}_tokens_per_s"] = sum(tokens[1:]) / sum(times)
            out[f"{side}_peak_rss_bytes"] = float(sum(peak_rss_bytes(pid) for pid in pids))
            out[f"{side}_processes"] = float(len(pids))
            for actor in actors:
                ray.kill(actor)
    out["adapter_parity"] = max(
        _max_difference(states_after[kind][p], states_after["separate"][p])
        for kind in ("parallel", "serial")
        for p in policies
    )
    for kind, prefix in (("parallel", "multi_adapter"), ("serial", "serial_host")):
        out[f"{prefix}_speedup"] = out[f"{kind}_tokens_per_s"] / out["separate_tokens_per_s"]
        out[f"{prefix}_memory_ratio"] = out[f"{kind}_peak_rss_bytes"] / out["separate_peak_rss_bytes"]
    return out


def _labelled(groups: list[Any], version: str) -> list[Any]:
    ref = PolicyRef.parse(version)
    return [replace(g, policy_version=ref, records=[replace(r, policy_version=ref) for r in g.records]) for g in groups]


def _trained_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's engine state (LoRA and master weights, Adam moments) as flat name -> tensor."""
    import torch

    from diprl.learn.lifecycle import ENGINE_STATE
    from diprl.learn.state_files import read_state

    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)

    walk("", read_state(checkpoint, ENGINE_STATE))
    if not flat:
        raise RuntimeError(f"no tensors in the engine state of {checkpoint}")
    return flat


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a.keys() != b.keys():
        raise RuntimeError(f"the two sides' states differ in names: {sorted(a.keys() ^ b.keys())[:4]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


def print_adapters(args: argparse.Namespace, r: dict[str, float]) -> int:
    n = args.adapters
    gib = 2**30
    print(
        f"{n} policies, {args.groups} groups x {args.forks} forks a step each, {r['tokens_per_round']:.0f} tokens a "
        f"round (one step of every policy), {max(args.steps, 2)} timed rounds; a torch thread a policy"
    )

    def side(label: str, key: str, cpus: int) -> None:
        print(
            f"{label} ({r[f'{key}_processes']:.0f} process(es), {cpus} CPU(s) of the local Ray): "
            f"{r[f'{key}_round_s']:.3f} s a round, {r[f'{key}_tokens_per_s']:.0f} tokens/s, "
            f"peak RSS {r[f'{key}_peak_rss_bytes'] / gib:.2f} GiB"
        )

    side("one host, parallel (base loaded once)", "parallel", n)
    side(f"{n} learners (a base each; RSS summed)", "separate", n)
    side("one host, serial (base loaded once)", "serial", 1)
    print(
        f"serial_host_tokens_per_s={r['serial_tokens_per_s']:.1f} serial_host_speedup={r['serial_host_speedup']:.3f} "
        f"serial_host_memory_ratio={r['serial_host_memory_ratio']:.3f}"
    )
    print(
        f"multi_adapter_tokens_per_s={r['parallel_tokens_per_s']:.1f} "
        f"separate_tokens_per_s={r['separate_tokens_per_s']:.1f} "
        f"multi_adapter_speedup={r['multi_adapter_speedup']:.3f} adapter_parity={r['adapter_parity']:.3g} "
        f"multi_adapter_memory_ratio={r['multi_adapter_memory_ratio']:.3f}"
    )
    return 0
