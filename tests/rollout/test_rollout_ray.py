"""Rollouts on a real local Ray cluster: well-formed groups, stratified heroes, exactly-once delivery
when a worker dies mid-rollout, and the real PolicyServer with the tiny model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diprl.game import DiplomacyGame, PowerOrders
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.rollout.episode import EpisodeConfig
from diprl.rollout.worker import RolloutRunner, WorkerConfig, stratified_matches

OPPONENTS = ["bot:dumbbot", "base", "bot:random"]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from diprl.raysession import ray_session

    with ray_session(address="local", num_cpus=4):
        yield


def check_group(group: dict[str, Any], group_size: int) -> None:
    """What the learner relies on: G records, token-aligned arrays, masks rebuildable from the record."""
    preset = load_preset("tiny")  # the workers' model: its tokenizer spells the completions
    table = token_table(load_tokenizer(resolve_model_path(preset)), logits_width(preset))
    assert len(group["records"]) == group_size == len(group["returns"])
    for record in group["records"]:
        n = len(record["completion_ids"])
        assert n > 0 and len(record["behaviour_logprobs"]) == n == len(record["advantages"])
        assert record["prompt_ids"], "the learner needs the prompt ids"
        legal = PowerOrders.from_dict(record["legal"])
        masks = OrderConstraint(legal, table).masks_for(record["completion_ids"])  # raises if off-grammar
        assert all(t in m for t, m in zip(record["completion_ids"], masks, strict=True))
        assert record["phase"] == group["phase"] and record["power"] == group["hero"]


def test_two_workers_produce_well_formed_groups_with_stratified_heroes(
    ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = WorkerConfig(
        episode=EpisodeConfig(group_size=3, warmup_max_phases=4, horizon_years=1, trace_fraction=1.0), client="uniform"
    )
    runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
    # Ray logs an error-level line when a restartable actor's constructor takes an object-store argument
    # (an actor handle counts): the workers take the ledger's name instead (ray-project/ray#53727).
    assert "constructor arguments in the object store" not in capfd.readouterr().err
    matches = list(stratified_matches(7, "base", OPPONENTS, seed=1))
    assert sorted(m.hero for m in matches) == sorted(DiplomacyGame().powers)
    summaries = runner.run(matches)
    groups = runner.drain()
    delivered = [s for s in summaries if s["delivered"]]
    assert len(groups) == len(delivered) >= 5
    assert len({g["group_id"] for g in groups}) == len(groups)
    assert len({s["worker_pid"] for s in summaries}) == 2
    for group in groups:
        check_group(group, 3)
    lines = runner.results_path.read_text().splitlines()
    assert len(lines) == 3 * sum(1 for s in summaries if s["results"])
    assert len(list((tmp_path / "traces").glob("*.json"))) == sum(1 for s in summaries if s["trace"])


def test_a_worker_killed_mid_rollout_loses_and_duplicates_nothing(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    config = WorkerConfig(
        episode=EpisodeConfig(group_size=2, warmup_min_phases=2, warmup_max_phases=6, horizon_years=2), client="uniform"
    )
    runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
    matches = list(stratified_matches(8, "base", OPPONENTS, seed=2))
    victim = runner.workers[0]
    old_pid = ray.get(victim.pid_of.remote())  # initialised: the kill below lands in an episode
    refs = [victim.play.remote(m) for m in matches]
    ray.wait(refs, num_returns=1, timeout=300)  # one done: the other seven are running or queued
    ray.kill(victim, no_restart=False)
    summaries = ray.get(refs, timeout=600)
    new_pid = ray.get(victim.pid_of.remote())
    assert new_pid != old_pid, "the worker should have been restarted"
    assert any(s["worker_pid"] == new_pid for s in summaries), "the interrupted match should be replayed"
    groups = runner.drain()
    ids = Counter(g["group_id"] for g in groups)
    expected = {s["group_id"] for s in summaries if s["group_id"] is not None}
    assert set(ids) == expected and all(n == 1 for n in ids.values())
    # Delivering a group again (what a retry after delivery does) is refused by the ledger.
    assert groups and ray.get(runner.ledger.deliver.remote(groups[0])) is False


def test_rollout_through_the_policy_server_with_the_tiny_model(ray_cluster: None, tmp_path: Path) -> None:
    from ray import serve

    from diprl.inference.config import ServerConfig
    from diprl.inference.server import serve_policy

    # port=0: a free port, so a PolicyServer already running on this machine does not fail the test.
    serve_policy(
        ServerConfig(model="tiny", adapter_root=str(tmp_path / "adapters"), adapter_cache=str(tmp_path / "c"), port=0)
    )
    try:
        config = WorkerConfig(episode=EpisodeConfig(group_size=2, warmup_max_phases=2, horizon_years=1), client="serve")
        runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
        summaries = runner.run(list(stratified_matches(2, "base", ["base", "bot:dumbbot"], seed=3)))
        groups = runner.drain()
        assert all(s["bad_completions"] == 0 and s["completions"] > 0 for s in summaries)
        assert groups, [s["skipped_zero_variance"] for s in summaries]
        for group in groups:
            check_group(group, 2)
    finally:
        serve.delete("policy")


def test_ledger_routes_groups_to_their_policys_queue_once(ray_cluster: None) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queues = {"main": Queue(maxsize=4), "main_exploiter": Queue(maxsize=4)}
    ledger = GroupLedger.remote(queues)  # type: ignore[attr-defined]
    groups = [
        {"group_id": "a", "policy_version": "main@v1"},
        {"group_id": "b", "policy_version": "main_exploiter@v3"},
        {"group_id": "a", "policy_version": "main@v1"},  # a retried match: dropped
        {"group_id": "c", "policy_version": "base"},  # no learner trains base: counted, not queued
    ]
    delivered = [ray.get(ledger.deliver.remote(g)) for g in groups]
    assert delivered == [True, True, False, False]
    assert [g["group_id"] for g in [queues["main"].get(timeout=5)]] == ["a"]
    assert queues["main"].empty() and queues["main_exploiter"].get(timeout=5)["group_id"] == "b"
    assert ray.get(ledger.stats.remote()) == {"accepted": 2, "duplicates": 1, "unroutable": 1, "refused": 0}


def test_a_restarted_ledger_still_drops_groups_it_accepted(
    ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queue = Queue(maxsize=4, actor_options={"name": "queue-restart-test"})
    accepted = str(tmp_path / "ledger" / "accepted.txt")
    ledger = GroupLedger.remote({"main": "queue-restart-test"}, accepted)  # type: ignore[attr-defined]
    assert ray.get(ledger.deliver.remote({"group_id": "a", "policy_version": "main@v1"})) is True
    ray.kill(ledger, no_restart=False)  # Ray restarts it; its accepted ids come back from the file
    assert ray.get(ledger.deliver.remote({"group_id": "a", "policy_version": "main@v1"})) is False
    assert ray.get(ledger.deliver.remote({"group_id": "b", "policy_version": "main@v1"})) is True
    assert ray.get(ledger.stats.remote())["accepted"] == 2
    assert [queue.get(timeout=5)["group_id"] for _ in range(2)] == ["a", "b"]
    # Queues passed by name: no object-store constructor argument for Ray to lose (ray-project/ray#53727).
    assert "constructor arguments in the object store" not in capfd.readouterr().err


def test_a_delivery_waiting_on_a_full_queue_returns_once_the_ledger_closes(ray_cluster: None) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queue = Queue(maxsize=1)
    ledger = GroupLedger.remote(queue)  # type: ignore[attr-defined]
    assert ray.get(ledger.deliver.remote({"group_id": "a", "policy_version": "main@v1"})) is True
    waiting = ledger.deliver.remote({"group_id": "b", "policy_version": "main@v1"})
    assert ray.wait([waiting], timeout=2)[0] == []  # backpressure: it waits while the queue is full
    ray.get(ledger.close.remote())  # the driver stopped taking batches
    assert ray.get(waiting, timeout=30) is False
    assert ray.get(ledger.stats.remote())["refused"] == 1 and queue.qsize() == 1
    # Not accepted: the same group is still deliverable by a later ledger (nothing half-delivered).
    assert ray.get(GroupLedger.remote(queue).stats.remote())["accepted"] == 0  # type: ignore[attr-defined]
