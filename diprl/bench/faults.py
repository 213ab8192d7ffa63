"""Fault-injection run of the learner: bad records, an overflowing loss, full disks; does anything get lost?

    python -m diprl.bench faults [--steps 12] [--groups 4] [--forks 4] [--keep-versions 3]

A real `Learner` (tiny model, DeepSpeed ZeRO-2 on CPU) trains on groups from mid-game states. Every
step one record of each group is spoiled, cycling through every kind of bad input the learner must
survive; on a schedule the disk is "full" (OSError ENOSPC, after a partial write) while publishing or
checkpointing. After each publish the old adapter versions are pruned as the driver does. At the end
it checks the ledger: every good record trained, every spoiled one quarantined (with the right
reason, findable by group id and index), no version half-written, version numbers without a gap
(a step whose publish failed is published by the next one).
Last line: `faults_survived=<n> bad_records=<n> quarantined=<n> lost=<n> exceptions=<n>`.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

from diprl.bench.learner import add_batch_options
from diprl.messages import TrainingRecord

Spoil = Callable[[TrainingRecord, Any], TrainingRecord]


def _spoilers() -> dict[str, tuple[str, Spoil]]:
    """name -> (the quarantine reason it must get, how it spoils a record)."""

    def n(r: TrainingRecord) -> int:
        return len(r.completion_ids)

    def hello(t: Any) -> int:
        return int(t.encode("Hello", add_special_tokens=False)[0])

    return {
        "nan_logprob": ("nonfinite", lambda r, t: replace(r, behaviour_logprobs=[float("nan")] * n(r))),
        "inf_advantage": ("nonfinite", lambda r, t: replace(r, advantages=[float("inf")] * n(r))),
        "off_constraint": ("constraint", lambda r, t: replace(r, completion_ids=[hello(t), *r.completion_ids[1:]])),
        "too_long": ("too_long", lambda r, t: replace(r, prompt_ids=r.prompt_ids * 8)),
        "no_legal_orders": ("malformed", lambda r, t: replace(r, legal={})),
        "unknown_token": ("malformed", lambda r, t: replace(r, prompt_ids=[*r.prompt_ids[:-1], 10**9])),
        "greedy_temperature": ("bad_temperature", lambda r, t: replace(r, temperature=1e-40)),
        "missing_logprobs": ("length_mismatch", lambda r, t: replace(r, behaviour_logprobs=r.behaviour_logprobs[:1])),
        "overflowing_loss": ("nonfinite_loss", lambda r, t: replace(r, advantages=[3e38] * n(r))),
    }


@contextmanager
def _full_disk(learner: Any, publish: bool, checkpoint: bool) -> Iterator[None]:
    """ENOSPC from the store's file copy (after writing part of the file) and from the checkpoint writer."""
    from diprl.inference.adapters import _fs

    def partial_copy(src: Path, dst: Path) -> tuple[int, str]:
        dst.write_bytes(src.read_bytes()[:64])
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    def no_space(*args: Any, **kwargs: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    with (
        mock.patch.object(_fs, "copy_hashing", partial_copy) if publish else _nothing(),
        mock.patch.object(learner.checkpoints, "save", no_space) if checkpoint else _nothing(),
    ):
        yield


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diprl.bench.constraint import mid_game_states
    from diprl.bench.learner import make_groups
    from diprl.learn.config import LearnerConfig
    from diprl.learn.learner import Learner
    from diprl.learn.site import LearnerSite
    from diprl.policy.models import load_preset, resolve_model_path
    from diprl.policy.tokenizer import load_tokenizer

    spoilers = _spoilers()
    kinds = list(spoilers)
    tokenizer = load_tokenizer(resolve_model_path(load_preset(LearnerConfig().model)))  # the learner's own
    states = mid_game_states(args.groups * args.steps, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="diprl-bench-faults-") as tmp:
        config = LearnerConfig(
            micro_batch_tokens=4096,
            groups_per_step=args.groups,
            checkpoint_every=2,
            max_policy_lag=1,
            keep_versions=args.keep_versions,
        )
        learner = Learner(config, LearnerSite(Path(tmp) / "run", Path(tmp) / "adapters"))
        expected: dict[tuple[str, int], str] = {}  # (group id, index) -> reason
        good = exceptions = faults = skipped = 0
        published: list[str] = [learner.latest_version()]
        most_versions = 1
        for step in range(args.steps):
            chunk = states[step * args.groups : (step + 1) * args.groups]
            version = learner.latest_version()
            groups = make_groups(chunk, args.forks, [version] * args.groups, learner.table, tokenizer, seed=step)
            for g_index, group in enumerate(groups):
                group.group_id = f"s{step}-g{g_index}"
                scores = learner.score(group.records)
                group.records = [replace(r, behaviour_logprobs=s) for r, s in zip(group.records, scores, strict=True)]
                kind = kinds[(step * args.groups + g_index) % len(kinds)]
                reason, spoil = spoilers[kind]
                index = (step + g_index) % args.forks
                group.records[index] = spoil(group.records[index], tokenizer)
                expected[(group.group_id, index)] = reason
                good += args.forks - 1
            full_publish = step % 4 == 1
            full_checkpoint = step % 6 == 3
            try:
                with _full_disk(learner, full_publish, full_checkpoint):
                    metrics = learner.train_step(groups)
            except Exception:
                exceptions += 1
                continue
            faults += len(metrics.faults)
            skipped += int(metrics.metrics.get("nonfinite_gradients", 0))
            if metrics.published:
                published.append(str(metrics.published))
                learner.prune_versions([])
            most_versions = max(most_versions, len(learner.store.versions(config.policy)))
        quarantine = [
            json.loads(line)
            for line in (Path(tmp) / "run" / "learner" / "main" / "quarantine.jsonl").read_text().splitlines()
        ]
        found = {(q["group_id"], q["index"]): q["reason"] for q in quarantine}
        policy_dir = Path(tmp) / "adapters" / config.policy
        leftovers = [p.name for p in policy_dir.iterdir() if not p.name.startswith("v")]
        numbers = [int(name.split("@v")[1]) for name in published]
        counters = dict(learner.counters)
        learner.engine.destroy()
    wrong_reason = sum(1 for key, reason in expected.items() if found.get(key) != reason)
    lost = (good - counters["records_trained"]) + wrong_reason + (len(found) - len(expected))
    return {
        "steps": args.steps,
        "records": good + len(expected),
        "bad_records": len(expected),
        "bad_kinds": len(kinds),
        "quarantined": len(quarantine),
        "quarantined_by_reason": dict(Counter(q["reason"] for q in quarantine)),
        "good_records_trained": counters["records_trained"],
        "good_records": good,
        "disk_full_faults": faults,
        "publish_failures": counters["publish_failures"],
        "checkpoint_failures": counters["checkpoint_failures"],
        "skipped_steps": skipped,
        "versions_published": len(published),
        "versions_contiguous": numbers == list(range(numbers[0], numbers[0] + len(numbers))),
        "versions_pruned": counters["versions_pruned"],
        "most_versions_on_disk": most_versions,
        "temp_leftovers": len(leftovers),
        "lost": lost,
        "exceptions": exceptions,
        "faults_survived": len(expected) + faults,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench faults", description=__doc__.split("\n\n")[0])
    add_batch_options(parser, 12, "learner steps (one record of each group spoiled in each)", groups=4, forks=4)
    parser.add_argument("--keep-versions", type=int, default=3, help="learner.keep_versions for pruning")
    args = parser.parse_args(argv)
    out = run(args)
    for key, value in out.items():
        print(f"{key}: {value}")
    print(
        " ".join(f"{k}={out[k]}" for k in ("faults_survived", "bad_records", "quarantined", "lost", "exceptions")),
        flush=True,
    )
    return 0 if out["lost"] == 0 and out["exceptions"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
