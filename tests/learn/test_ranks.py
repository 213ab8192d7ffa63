"""A learner group of 2 ranks (real DeepSpeed over gloo, CPU, the tiny Qwen3) against one ZeRO-2 rank.

One group per ZeRO stage serves the module (start-up is the cost): ZeRO-2, and ZeRO-3 with every base
weight partitioned over the two ranks (persistence threshold 0). Two steps give the same LoRA update as
one rank on the same batches; then a rank is killed between steps and another during a step, and the
group restarts from its newest checkpoint with every step taken exactly once, ending where the
one-rank learner ends.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.model import lora_state, read_adapter_dir
from diprl.learn.ranks import split_by_tokens
from diprl.learn.site import LearnerSite
from diprl.messages import GroupRestart, PolicyRef, TrajectoryGroup
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.tracking import read_metrics

from .groups import make_group

QUEUE = "queue-ranks-test"
# Adam's eps well above the gradients' float noise makes the update proportional to the gradient:
# a gradient off by the number of ranks (no averaging, or averaging twice) moves the weights visibly.
# The KL term makes every step score the batch under the EMA weights too (a swap of the LoRA weights: at
# ZeRO-3 a collective that every rank must make at the same point).
CONFIG = LearnerConfig(
    lr=1e-2,
    adam_eps=1e-3,
    micro_batch_tokens=1200,
    checkpoint_every=1,
    groups_per_step=2,
    max_policy_lag=8,
    kl_coef=0.05,
    ema_decay=0.5,
)
pytestmark = pytest.mark.timeout(600)  # a group whose ranks disagree on a collective waits forever


def test_a_batch_is_split_by_tokens_deterministically_with_prompts_kept_whole() -> None:
    costs = [10, 10, 10, 7, 7, 30, 1]
    keys = ["a", "a", "a", "b", "b", "c", "d"]  # a: 30 tokens, b: 14, c: 30, d: 1
    shares = split_by_tokens(costs, keys, 2)
    assert shares == [[0, 1, 2, 3, 4], [5, 6]]  # a, c (ties by first index), then b to the tie's lowest rank, d
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    assert split_by_tokens(costs, keys, 2) == shares
    assert split_by_tokens([5, 3], ["x", "x"], 2) == [[0], [1]]  # one prompt, two ranks: its records split
    assert split_by_tokens([5], ["x"], 3) == [[0], [], []]  # a rank may be left with nothing (it steps empty)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        split_by_tokens(costs, keys, 0)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"ranks must be >= 1 .*got 0"):
        LearnerConfig(ranks=0)
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3, got 4"):
        LearnerConfig(ranks=2, zero_stage=4)
    with pytest.raises(ValueError, match=r"zero3_persistence_threshold must be >= 0, got -1"):
        LearnerConfig(zero_stage=3, zero3_persistence_threshold=-1)


def _on(group: TrajectoryGroup, version: str) -> TrajectoryGroup:
    ref = PolicyRef.parse(version)
    return replace(group, policy_version=ref, records=[replace(r, policy_version=ref) for r in group.records])


@pytest.fixture(scope="module")
def batches() -> list[list[TrajectoryGroup]]:
    from diprl.policy.vocab import token_table

    preset = load_preset("tiny")
    tokenizer = load_tokenizer(resolve_model_path(preset))
    table = token_table(tokenizer, preset.tiny.vocab_size if preset.tiny else None)
    powers = ["FRANCE", "ENGLAND", "ITALY", "RUSSIA"]
    return [
        [
            make_group(table, tokenizer, "main@v1", [1.0, -0.5, 0.25], power=powers[k], seed=10 * k),
            make_group(table, tokenizer, "main@v1", [-1.0, 0.5], power=powers[(k + 1) % 4], seed=10 * k + 1),
        ]
        for k in range(4)
    ]


@pytest.fixture(scope="module")
def reference(batches: list[list[TrajectoryGroup]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One rank on the same batches: weights and figures after each step."""
    root = tmp_path_factory.mktemp("one-rank")
    learner = Learner(CONFIG, LearnerSite(root / "run", root / "adapters"))
    out = []
    for batch in batches:
        report = learner.train_step([_on(g, learner.latest_version()) for g in batch])
        out.append({"weights": lora_state(learner.peft), "report": report})
    learner.engine.destroy()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    import ray
    from ray.util.queue import Queue

    from diprl.learn.actor import learner_actor
    from diprl.raysession import ray_session

    root = tmp_path_factory.mktemp(f"two-ranks-zero{request.param}")
    config = replace(CONFIG, ranks=2, zero_stage=request.param, zero3_persistence_threshold=0)
    with ray_session(address="local", num_cpus=3):
        queue = Queue(maxsize=16, actor_options={"name": QUEUE, "num_cpus": 0})
        actor = learner_actor(config, LearnerSite(root / "run", root / "adapters"), queue=QUEUE)
        ray.get(actor.pid_of.remote())
        yield actor, queue, root


def _rank_pids(actor: Any) -> list[int]:
    """The process ids of a learner group's ranks (asked of each rank through the group, which holds them)."""
    import ray

    def pids(group: Any) -> list[int]:
        return [int(p) for p in ray.get([r.__ray_call__.remote(lambda _: os.getpid()) for r in group.ranks])]

    return list(ray.get(actor.__ray_call__.remote(pids)))


def _step(actor: Any, queue: Any, batch: list[TrajectoryGroup], kill: int | None = None, root: Path = Path()) -> Any:
    """Queue the batch (on the group's current version) and train it; `kill`: that rank is killed mid-step."""
    import ray

    version = ray.get(actor.latest_version.remote())
    for g in batch:
        queue.put(_on(g, version))
    pids = _rank_pids(actor) if kill is not None else []
    ref = actor.train_next.remote(30.0)
    if kill is not None:
        pending = root / "run" / "learner" / "main" / "pending.json"
        deadline = time.monotonic() + 60
        while not pending.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pids[kill], signal.SIGKILL)
    return ray.get(ref)


def _published(actor: Any, root: Path, like: Any) -> dict[str, Any]:
    import ray

    from diprl.inference.adapters import AdapterStore

    version = ray.get(actor.latest_version.remote())
    return read_adapter_dir(AdapterStore(root / "adapters").resolve(version).path, like)


def _largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_take_the_same_steps_as_one(
    group: tuple[Any, Any, Path], batches: list[list[TrajectoryGroup]], reference: list[dict[str, Any]]
) -> None:
    actor, queue, root = group
    from diprl.learn.model import build_peft_model

    like = build_peft_model(load_preset("tiny"), CONFIG)
    for k in range(2):
        report = _step(actor, queue, batches[k])
        one = reference[k]["report"]
        assert report.step == k + 1 and report.trained and report.metrics["ranks"] == 2
        assert report.metrics["records"] == one.metrics["records"] and report.metrics["tokens"] == one.metrics["tokens"]
        assert report.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-6)
        assert report.metrics["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-4)
    moved = _largest_difference(_published(actor, root, like), lora_state(like))
    assert moved > 1e-3  # the steps did move the weights
    assert _largest_difference(_published(actor, root, like), reference[1]["weights"]) < 1e-5


def test_a_lost_rank_restarts_the_group_from_its_checkpoint_and_no_step_is_lost_or_repeated(
    group: tuple[Any, Any, Path], batches: list[list[TrajectoryGroup]], reference: list[dict[str, Any]]
) -> None:
    import ray

    actor, queue, root = group
    from diprl.learn.model import build_peft_model

    like = build_peft_model(load_preset("tiny"), CONFIG)
    before = _rank_pids(actor)
    os.kill(before[1], signal.SIGKILL)  # between steps
    report = _step(actor, queue, batches[2])
    assert report.step == 3 and report.trained
    restarts = [f for f in report.faults if isinstance(f, GroupRestart)]
    assert [(f.rank, f.cause, f.restored_step, f.replayed_step) for f in restarts] == [(1, "rank_lost", 2, 3)]
    after = _rank_pids(actor)
    assert not set(after) & set(before)  # every rank is a fresh process

    report = _step(actor, queue, batches[3], kill=0, root=root)  # rank 0, the writer, during a step
    assert report.step == 4 and report.trained
    assert any(isinstance(f, GroupRestart) and f.rank == 0 for f in report.faults)
    state = ray.get(actor.state.remote())
    assert state["step"] == 4 and state["group_restarts"] == 2
    steps = [int(r["step"]) for r in read_metrics(root / "run" / "learner" / "main" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # each step once: none lost, none repeated
    assert not (root / "run" / "learner" / "main" / "pending.json").exists()
    assert _largest_difference(_published(actor, root, like), reference[3]["weights"]) < 1e-5


def test_a_reset_rebuilds_every_rank_and_the_group_trains_on(
    group: tuple[Any, Any, Path], batches: list[list[TrajectoryGroup]]
) -> None:
    """An exploiter's reset on a group: every rank builds a fresh LoRA at once, rank 0 publishes it."""
    import ray

    from diprl.learn.model import build_peft_model
    from diprl.messages import PolicyRef

    actor, queue, root = group
    like = build_peft_model(load_preset("tiny"), CONFIG)
    before, step = ray.get(actor.latest_version.remote()), ray.get(actor.state.remote())["step"]
    fresh = ray.get(actor.reset.remote())
    assert PolicyRef.parse(fresh).version == PolicyRef.parse(before).version + 1
    assert all(float(t.abs().max()) == 0 for n, t in _published(actor, root, like).items() if "lora_B" in n)
    report = _step(actor, queue, batches[0])
    assert report.trained and report.step == step + 1 and report.metrics["ranks"] == 2


def test_a_group_the_cluster_cannot_hold_is_refused_naming_what_it_lacks(group: tuple[Any, Any, Path]) -> None:
    import ray

    from diprl.learn.actor import learner_actor

    _, _, root = group
    config = replace(CONFIG, ranks=2, policy="wide")
    actor = learner_actor(config, LearnerSite(root / "wide", root / "wide-adapters"), resources={"gpu_box": 0.5})
    with pytest.raises(
        Exception, match=r"learner.ranks=2 for wide needs 2 bundles .*gpu_box: needs 1, the cluster has 0"
    ):
        ray.get(actor.pid_of.remote(), timeout=60)
