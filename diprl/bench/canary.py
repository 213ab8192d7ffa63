"""Canary benchmark: do canaries catch a replica serving other weights than those trained, and what do they cost?

    python -m diprl.bench canary [--steps N] [--groups 16] [--forks 4] [--seed 0] [--canary-every N]
                                 [--traffic 16] [--trials 5]

A tiny-model learner takes `--steps` GRPO steps (default: `--canary-every`, so that two versions carry a
canary) after a warm-up step, publishing a version after each, every `--canary-every`-th with its canary
(default `learner.canary_every`; the first version always): those versions are the clean run, and each
must be served with no canary alarm. Then faults are
injected, each a way for a replica to serve weights other than the version's while every byte check
passes:

- `stale`: the previous version's weights published under a new name, with the new weights' canary
  (a learner that saved the wrong buffer);
- `base`: the version's LoRA with `lora_B` zeroed, so it computes the base model (base weights served
  for an adapter);
- `reload_skipped`: the replica hands vLLM the previous version's copy for a new version (a reload that
  never happened);
- `prefix_reuse`: an adapter re-registered under the same name and path with new weights while prefix
  caching is on (vLLM #42125: blocks computed with the old weights can be reused). The canary prompts
  are several cache blocks long, so a reused block shows. If this vLLM does not reuse them, the served
  output is the new weights' and there is no fault to catch: `prefix_reuse_seen=0` says so, and it is
  not counted as injected.
- `killed_mid_load`: an honest version whose first load is cut off while its canary is being served
  (the request cancelled, as when the replica or the caller dies mid-publish). The replica must not keep
  it loaded unproven: the next request loads it again and serves its canary in full. Caught when it
  does; a replica that served the version without a finished probe missed it. (A replica process that
  dies loses everything it loaded; its successor proves each version on first use, which
  `train.chaos=[policy-server]` exercises in a run.)

Costs, against the mean learner step (by default the step of `+experiment=pfsp`: 16 groups of 4): the
learner's canary (what each publish with a canary spent making it: one forward that checks the previous
canary's completions against the new weights, or a decode where a completion changed; see
`diprl.learn.canary`), and the replica's probe. A probe is served beside the rollouts' requests, so what
it costs them is the time it adds to their batch: `--traffic` sampled requests on mid-game positions are
timed alone and beside a probe (`--trials` times each, alternately, on an empty prefix cache), and the
median difference within a pair (alone, then beside) is the probe's cost; its latency on an idle engine
is printed too. Both are paid once every `canary_every` versions:
`canary_cost = (learner canary s + probe's added s) / (canary_every x step s)`, the share of a run's time
the canaries take. Last line:
`canary_caught=<n>/<n injected> canary_false_alarms=<n> canary_cost=<share>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from diprl.adapter_files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from diprl.bench.learner import add_batch_options
from diprl.torch_threads import torch_threads


def _zero_b_dir(version_dir: Path, out: Path) -> Path:
    """A copy of a version's PEFT files whose `lora_B` weights are zero: the adapter computes the base."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copyfile(version_dir / CONFIG_FILE, out / CONFIG_FILE)
    tensors = load_file(str(version_dir / WEIGHTS_FILE))
    save_file({k: (v * 0 if "lora_B" in k else v) for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    return out


def _peft_files(version_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(version_dir / name, out / name)
    return out


def train(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Learner steps publishing canaried versions; their step and canary seconds."""

    from diprl.bench.constraint import mid_game_states
    from diprl.bench.learner import make_groups
    from diprl.learn.config import LearnerConfig
    from diprl.learn.learner import Learner
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer

    config = LearnerConfig(
        lr=3e-2,
        max_grad_norm=0.0,
        checkpoint_every=0,
        publish_every=1,
        canary_every=args.canary_every,
        groups_per_step=args.groups,
    )
    learner = Learner(config, LearnerSite(tmp / "run", tmp / "adapters"))
    tokenizer = load_tokenizer(resolve_model_path(learner.preset))
    states = mid_game_states(args.groups * (args.steps + 1), seed=args.seed)
    steps, canaries, unchanged = [], [], 0
    for step in range(args.steps + 1):
        chunk = states[step * args.groups : (step + 1) * args.groups]
        groups = make_groups(
            chunk, args.forks, [learner.latest_version()] * args.groups, learner.table, tokenizer, step
        )
        before = learner.life.last_canary
        t0 = time.perf_counter()
        learner.train_step(groups)  # its publish makes the canary when one is due, as in a run
        elapsed = time.perf_counter() - t0
        if step > 0:  # the first step warms up (and its canary is decoded: there is no previous one)
            steps.append(elapsed)
            if learner.life.canary_s:
                canaries.append(learner.life.canary_s)
                after = learner.life.last_canary
                unchanged += before is not None and after is not None and after.same_completions(before)
    from diprl.inference.adapters import AdapterStore

    versions = [str(r) for r in AdapterStore(tmp / "adapters").versions(config.policy)]
    model_path = str(resolve_model_path(learner.preset))
    learner.engine.destroy()
    return {"versions": versions, "step_s": steps, "canary_s": canaries, "unchanged": unchanged, "model": model_path}


def inject(store: Any, versions: list[str], model: str, tmp: Path) -> dict[str, str]:
    """Publish the store-level faults; returns fault -> the version name that carries it."""
    from diprl.inference.canary import CANARY_FILE

    last, previous = store.resolve(versions[-1]), store.resolve(versions[-2])
    canary = (last.path / CANARY_FILE).read_bytes()
    stale = store.publish("main", _peft_files(previous.path, tmp / "stale"), base_model=model, canary=canary)
    base = store.publish("main", _zero_b_dir(last.path, tmp / "base"), base_model=model, canary=canary)
    # a new version whose replica will be handed the previous version's copy
    skipped = store.publish("main", _peft_files(last.path, tmp / "skipped"), base_model=model, canary=canary)
    return {"stale": str(stale), "base": str(base), "reload_skipped": str(skipped)}


async def serve(
    config: Any,
    clean: list[str],
    bytes_only: list[str],
    faults: dict[str, str],
    store: Any,
    tmp: Path,
    traffic: list[dict[str, Any]],
    trials: int,
) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    from diprl.inference.canary import CANARY_FILE
    from diprl.inference.engine_adapters import EngineAdapters
    from diprl.inference.policy_engine import PolicyEngine

    skipped_as = store.resolve(clean[-2])

    last = store.resolve(clean[-1])
    canary = (last.path / CANARY_FILE).read_bytes()
    killed = store.publish("main", _peft_files(last.path, tmp / "killed"), base_model=config.model, canary=canary)
    probing = asyncio.Event()

    class SkipsAReloadAdapters(EngineAdapters):
        def _verified_copy(self, name: str) -> Any:
            version, path = super()._verified_copy(name)
            if name == faults["reload_skipped"]:  # the old copy for the new name
                self.private.release(version.fingerprint)
                return version, self.private.acquire(skipped_as)
            return version, path

    class SkipsAReload(PolicyEngine):
        adapters_class = SkipsAReloadAdapters

        async def _check_canary(self, version: Any, lora: Any) -> None:
            if version.name == str(killed):
                probing.set()  # the probe of the version whose load is cut off has started
            await super()._check_canary(version, lora)

    engine = SkipsAReload(config)
    out: dict[str, Any] = {"alarms": {}, "probe_s": []}
    try:
        for name in [*clean, *faults.values(), *bytes_only]:
            before = engine.canaries.seconds
            result = (await engine.generate([{"policy": name, "prompt": "A PAR", "max_tokens": 1}]))[0]
            out["alarms"][name] = result.error is not None and result.error.startswith("CanaryMismatch")
            out["probe_s"].append(engine.canaries.seconds - before)
        out["under_traffic"] = await _probe_under_traffic(engine, store.resolve(clean[-1]), traffic, trials)
        out["killed"] = await _cut_off(engine, str(killed), probing)
        out["stats"] = engine.canaries.stats()
        # prefix_reuse: one name and path, first with the previous weights (their canary prompts cached), then
        # re-registered with the last weights; the canary is the last weights'.
        last, previous = store.resolve(clean[-1]), store.resolve(clean[-2])
        shared = tmp / "reused"
        _peft_files(previous.path, shared)
        first = LoRARequest("reused@v1", 10_001, str(shared))
        await engine.engine.add_lora(first)
        with contextlib.suppress(Exception):  # the previous weights' own canary: only what it caches matters
            await engine._check_canary(previous, first)
        await engine.engine.remove_lora(first.lora_int_id)
        for name in ADAPTER_FILES:
            shutil.copyfile(last.path / name, shared / name)
        again = LoRARequest("reused@v1", 10_002, str(shared))
        await engine.engine.add_lora(again)
        failures = engine.canaries.failures
        with contextlib.suppress(Exception):
            await engine._check_canary(last, again)
        out["prefix_reuse_seen"] = engine.canaries.failures > failures
    finally:
        engine.shutdown()
    return out


async def _probe_under_traffic(engine: Any, version: Any, traffic: list[dict[str, Any]], trials: int) -> dict[str, Any]:
    """What a probe takes from live traffic: the same batch of sampled requests timed alone and beside a probe
    of `version` (already loaded and proven), `trials` times each, alternately, every time on an empty prefix
    cache (a new version's probe finds none of its blocks cached); the added time is the median over the
    pairs (alone, then beside) of their difference. In a run the probe is served beside the
    rollouts' requests, so its cost to them is the wall time it adds to their batch, not its own latency."""
    alone: list[float] = []
    beside: list[float] = []
    lora = await engine.adapters.acquire(version.name)
    try:
        for trial in range(2 * trials):
            with_probe = trial % 2 == 1
            await engine.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            work = [engine.generate(traffic)]
            if with_probe:
                work.append(engine._check_canary(version, lora))
            results = await asyncio.gather(*work)
            (beside if with_probe else alone).append(time.perf_counter() - t0)
            failed = [g.error for g in results[0] if g.error is not None]
            if failed:
                raise RuntimeError(f"the traffic's requests failed: {failed[0]}")
    finally:
        await engine.adapters.release(lora)
    pairs = [b - a for a, b in zip(alone, beside, strict=True)]  # paired: a load that drifts cancels
    return {"alone_s": alone, "beside_s": beside, "pairs_s": pairs, "added_s": max(0.0, statistics.median(pairs))}


def traffic_requests(version: str, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` sampled constrained requests for `version` on mid-game positions: what rollouts send."""
    from diprl.bench.constraint import mid_game_states
    from diprl.policy.prompt import build_prompt

    return [
        {
            "policy": version,
            "prompt": build_prompt(game, power).text,
            "legal": game.legal_orders(power).to_dict(),
            "temperature": 1.0,
            "sample_seed": seed + i,
        }
        for i, (game, power) in enumerate(mid_game_states(n, seed=seed + 1))
    ]


async def _cut_off(engine: Any, name: str, probing: asyncio.Event) -> dict[str, Any]:
    """Load `name` and cancel the load while its canary is served; then ask for it again."""
    request = [{"policy": name, "prompt": "A PAR", "max_tokens": 1}]
    first = asyncio.ensure_future(engine.generate(request))
    await asyncio.wait_for(probing.wait(), engine.config.request_timeout_s)
    await asyncio.sleep(0.05)  # the canary requests are in the engine
    cut_off = not first.done()  # else the probe finished first: nothing was cut off, nothing to judge
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    left_loaded = name in engine.adapters.loaded()  # loaded without a finished probe
    checks = engine.canaries.checks
    again = (await engine.generate(request))[0]
    return {
        "version": name,
        "cut_off": cut_off,
        "left_loaded": left_loaded,
        "reproved": engine.canaries.checks == checks + 1 and again.error is None,
        "error": again.error,
    }


def _span(seconds: list[float]) -> str:
    return f"{min(seconds):.3f}-{max(seconds):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench canary", description=__doc__.split("\n")[0])
    add_batch_options(
        parser, None, "timed learner steps after one warm-up step (default: --canary-every)", groups=16, forks=4
    )
    parser.add_argument(
        "--canary-every", type=int, default=None, help="versions between canaries (default: learner.canary_every)"
    )
    parser.add_argument(
        "--traffic", type=int, default=16, help="sampled requests a probe is timed beside (its cost to rollouts)"
    )
    parser.add_argument("--trials", type=int, default=5, help="timings of that traffic alone and beside a probe, each")
    args = parser.parse_args(argv)
    if args.traffic < 1 or args.trials < 1:
        parser.error("--traffic and --trials must be >= 1")
    if args.canary_every is None:
        from diprl.learn.config import LearnerConfig

        args.canary_every = LearnerConfig().canary_every
    if args.steps is None:
        args.steps = args.canary_every
    if args.canary_every < 1 or args.steps < 1 or (args.steps + 1) // args.canary_every < 1:
        parser.error("two versions need a canary: --canary-every must be in [1, --steps + 1]")

    from diprl.inference.adapters import AdapterStore
    from diprl.inference.config import ServerConfig

    with tempfile.TemporaryDirectory(prefix="diprl-bench-canary-") as name:
        tmp = Path(name)
        trained = train(args, tmp)
        store = AdapterStore(tmp / "adapters")
        clean = [v for v in trained["versions"] if store.resolve(v).canary_file is not None]
        bytes_only = [v for v in trained["versions"] if v not in clean]
        faults = inject(store, clean, trained["model"], tmp)
        config = ServerConfig(
            model=trained["model"],
            dtype="float32",
            adapter_root=str(tmp / "adapters"),
            max_num_seqs=8,
            loaded_adapters=2,
        )
        with torch_threads():  # the engine in this process sets its own count
            traffic = traffic_requests(clean[-1], args.traffic, args.seed)
            served = asyncio.run(serve(config, clean, bytes_only, faults, store, tmp, traffic, args.trials))
    alarms = served["alarms"]
    false_alarms = sum(alarms[v] for v in [*clean, *bytes_only])
    caught = {fault: alarms[name] for fault, name in faults.items()}
    killed = served["killed"]
    if killed["cut_off"]:
        caught["killed_mid_load"] = not killed["left_loaded"] and killed["reproved"]
    injected = len(caught) + int(served["prefix_reuse_seen"])
    n_caught = sum(caught.values()) + int(served["prefix_reuse_seen"])
    step_s, canary_s = statistics.mean(trained["step_s"]), statistics.mean(trained["canary_s"])
    probe_s = served["probe_s"][1 : len(clean)] or served["probe_s"]  # the first load also warms the engine up
    print(f"clean versions: {', '.join(clean)}; canary errors: {served['stats']['canary_errors']}")
    print(f"versions without a canary (canary_every={args.canary_every}), served: {', '.join(bytes_only) or '-'}")
    for fault, name in faults.items():
        print(f"fault {fault:15s} as {name}: {'caught' if caught[fault] else 'MISSED'}")
    seen = int(served["prefix_reuse_seen"])
    print(f"fault prefix_reuse: the re-registered adapter served other than its new weights: {seen}")
    verdict = ("caught" if caught["killed_mid_load"] else "MISSED") if killed["cut_off"] else "not injected"
    print(
        f"fault killed_mid_load as {killed['version']}: {verdict} (cut off mid-probe: {killed['cut_off']}; left "
        f"loaded unproven: {killed['left_loaded']}; proven again on the next request: {killed['reproved']}"
        f"{'; ' + str(killed['error']) if killed['error'] else ''})"
    )
    under = served["under_traffic"]
    alone, beside = statistics.median(under["alone_s"]), statistics.median(under["beside_s"])
    print(
        f"learner step {step_s:.3f} s (a publish's canary included), learner canary {canary_s:.3f} s "
        f"({canary_s / step_s:.3f} of a step, one version in {args.canary_every}; completions unchanged from the "
        f"previous canary, checked in one forward: {trained['unchanged']}/{len(trained['canary_s'])})"
    )
    print(
        f"replica probe {statistics.mean(probe_s):.3f} s a version on an idle engine; beside {args.traffic} sampled "
        f"requests (median of {args.trials}) {alone:.3f} s alone ({_span(under['alone_s'])}), {beside:.3f} s with a "
        f"probe ({_span(under['beside_s'])}): it adds (median of the pairs, {_span(under['pairs_s'])}) "
        f"{under['added_s']:.3f} s ({under['added_s'] / step_s:.3f} of a step)"
    )
    # The canaries' share of a run's time: what a canaried version costs the learner (its canary) and the
    # rollouts (the time its probe adds to their batch), once every `canary_every` steps.
    cost = (canary_s + under["added_s"]) / (args.canary_every * step_s)
    print(f"canary_caught={n_caught}/{injected} canary_false_alarms={false_alarms} canary_cost={cost:.3f}")
    return 0 if n_caught == injected and false_alarms == 0 else 1
