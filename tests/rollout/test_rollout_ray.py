"""Rollouts on a real local Ray cluster: well-formed groups, stratified heroes, exactly-once delivery
when a worker dies mid-rollout, and the real PolicyServer with the tiny model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from diprl.game import DiplomacyGame, PowerOrders
from diprl.messages import PolicyRef, TrajectoryGroup, group_id, group_seat
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import token_table
from diprl.rollout.episode import EpisodeConfig
from diprl.rollout.worker import RolloutRunner, WorkerConfig, stratified_matches

OPPONENTS = ["bot:dumbbot", "base", "bot:random"]


def _group(gid: str, version: str = "main@v1") -> TrajectoryGroup:
    return TrajectoryGroup(gid, "m", "FRANCE", "S1901M", PolicyRef.parse(version), [], [], 0.0)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from diprl.raysession import ray_session

    with ray_session(address="local", num_cpus=4):
        yield


def drain(runner: RolloutRunner) -> list[TrajectoryGroup]:
    """Everything in the runner's queue now (what a learner would consume)."""
    items = []
    while not runner.queue.empty():
        items.append(runner.queue.get(timeout=1.0))
    return items


def check_group(group: TrajectoryGroup, group_size: int) -> None:
    """What the learner relies on: G records, token-aligned arrays, masks rebuildable from the record."""
    preset = load_preset("tiny")  # the workers' model: its tokenizer spells the completions
    table = token_table(load_tokenizer(resolve_model_path(preset)), logits_width(preset))
    assert len(group.records) == group_size == len(group.returns)
    for record in group.records:
        n = len(record.completion_ids)
        assert n > 0 and len(record.behaviour_logprobs) == n == len(record.advantages)
        assert record.prompt_ids, "the learner needs the prompt ids"
        legal = PowerOrders.from_dict(record.legal)
        masks = OrderConstraint(legal, table).masks_for(record.completion_ids)  # raises if off-grammar
        assert all(t in m for t, m in zip(record.completion_ids, masks, strict=True))
        assert record.phase == group.phase and record.power == group.power


def test_two_workers_produce_well_formed_groups_with_stratified_heroes(
    ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = WorkerConfig(
        episode=EpisodeConfig(group_size=3, warmup_max_phases=4, horizon_years=1, trace_fraction=1.0), client="uniform"
    )
    import ray

    runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
    # Ray logs an error-level line when a restartable actor's constructor takes an object-store argument
    # (an actor handle counts): the workers take the ledger's name instead (ray-project/ray#53727).
    assert "constructor arguments in the object store" not in capfd.readouterr().err
    matches = list(stratified_matches(7, "main@v1", OPPONENTS, seed=1))
    assert sorted(m.hero for m in matches) == sorted(DiplomacyGame().powers)
    reports = runner.run(matches)
    groups = drain(runner)
    delivered = [gid for r in reports for gid in r.groups]
    assert sorted(g.group_id for g in groups) == sorted(delivered) and delivered
    # every match's hero seat is accounted for: a group delivered, or forks that all scored the same (random
    # orders tie a group of 3 forks in 1901-1902 about 4 times in 10, so how many are delivered is chance)
    tied = sum(r.counts.skipped_zero_variance for r in reports)
    assert len(delivered) + tied == len(matches) and not any(r.undelivered for r in reports)
    assert len({g.group_id for g in groups}) == len(groups)
    assert len({r.worker_pid for r in reports}) == 2
    for group in groups:
        check_group(group, 3)
    lines = runner.results_path.read_text().splitlines()
    assert len(lines) == 3 * sum(1 for r in reports if r.results)
    traces = sorted((tmp_path / "traces").glob("*.json"))
    assert traces and [str(p) for p in traces] == sorted(r.trace for r in reports if r.trace)
    # Every worker played its matches in lockstep: one call per phase held several matches' seats (the mean
    # requests per policy call is the batch the PolicyServer saw from that worker).
    stats = ray.get([w.__ray_call__.remote(lambda worker: worker.stats) for w in runner.workers])
    assert max(s.requests / s.calls for s in stats) > 3


def test_a_worker_killed_mid_rollout_loses_and_duplicates_nothing(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    config = WorkerConfig(
        episode=EpisodeConfig(group_size=2, warmup_min_phases=2, warmup_max_phases=6, horizon_years=2),
        client="uniform",
        matches_in_flight=8,
    )
    runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
    matches = list(stratified_matches(8, "main@v1", OPPONENTS, seed=2))
    victim = runner.workers[0]
    old_pid = ray.get(victim.pid_of.remote())  # initialised: the kill below lands in an episode
    refs = [victim.play.remote(m) for m in matches]  # all eight in flight at once (matches_in_flight=8)
    ray.wait(refs, num_returns=1, timeout=300)  # one done: the other seven are being played
    ray.kill(victim, no_restart=False)
    reports = ray.get(refs, timeout=600)
    new_pid = ray.get(victim.pid_of.remote())
    assert new_pid != old_pid, "the worker should have been restarted"
    replayed = [r for r in reports if r.worker_pid == new_pid]
    assert len(replayed) >= 2, "every match in flight when the worker died is replayed"
    groups = drain(runner)
    ids = Counter(g.group_id for g in groups)
    # What the reports name is what was queued (a replay names the group an earlier attempt of its match
    # delivered for a seat), each once, and one group per seat of a match whatever phase a replay forked at.
    expected = {gid for r in reports for gid in r.groups}
    assert set(ids) == expected and all(n == 1 for n in ids.values())
    assert all(n == 1 for n in Counter(group_seat(g) for g in ids).values())
    # Delivering a group again (what a retry after delivery does) is refused by the ledger.
    assert groups and ray.get(runner.ledger.deliver.remote(groups[0])) is False


def test_rollout_through_the_policy_server_with_the_tiny_model(ray_cluster: None, tmp_path: Path) -> None:
    from ray import serve

    from diprl.inference.adapters import AdapterStore
    from diprl.inference.config import ServerConfig
    from diprl.inference.deploy import serve_policy
    from tests.inference.lora_fixtures import make_lora_dir

    # A published version for the hero: only a learner's version is trained.
    assert str(AdapterStore(tmp_path / "adapters").publish("main", make_lora_dir(tmp_path, seed=1))) == "main@v1"
    # port=0: a free port, so a PolicyServer already running on this machine does not fail the test.
    serve_policy(ServerConfig(model="tiny", adapter_root=str(tmp_path / "adapters"), port=0))
    try:
        # Four forks of four matches: with fewer, every fork of every match often ends a year later with the
        # same return (the engine's sampling is not seeded), and a group without variance is not delivered.
        config = WorkerConfig(episode=EpisodeConfig(group_size=4, warmup_max_phases=2, horizon_years=1), client="serve")
        runner = RolloutRunner(config, num_workers=2, run_dir=tmp_path)
        reports = runner.run(list(stratified_matches(4, "main@v1", ["main@v1", "bot:dumbbot"], seed=3)))
        groups = drain(runner)
        assert all(r.counts.bad_completions == 0 and r.counts.completions > 0 for r in reports)
        assert groups, [r.counts.skipped_zero_variance for r in reports]
        for group in groups:
            check_group(group, 4)
    finally:
        serve.delete("policy")


def test_ledger_routes_groups_to_their_policys_queue_once(ray_cluster: None) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queues = {"main": Queue(maxsize=4), "main_exploiter": Queue(maxsize=4)}
    ledger = GroupLedger.remote(queues)  # type: ignore[attr-defined]
    groups = [
        _group("a", "main@v1"),
        _group("b", "main_exploiter@v3"),
        _group("a", "main@v1"),  # a retried match: dropped
        _group("c", "base"),  # no learner trains base: counted, not queued
    ]
    delivered = [ray.get(ledger.deliver.remote(g)) for g in groups]
    assert delivered == [True, True, False, False]
    assert [g.group_id for g in [queues["main"].get(timeout=5)]] == ["a"]
    assert queues["main"].empty() and queues["main_exploiter"].get(timeout=5).group_id == "b"
    assert ray.get(ledger.stats.remote()) == {"accepted": 2, "duplicates": 1, "unroutable": 1, "refused": 0}


def test_a_match_is_reported_with_what_went_through_once_its_deliveries_settle(ray_cluster: None) -> None:
    """A replay's report names the group an earlier attempt delivered: also when that attempt's put still
    waits on a full queue, and whether or not the replay forked that seat at all (its forks may tie)."""
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queue = Queue(maxsize=1)
    ledger = GroupLedger.remote({"main": queue})  # type: ignore[attr-defined]
    assert ray.get(ledger.deliver.remote(_group("filler"))) is True  # the queue is full now
    first = group_id("m9", "S1902M", "FRANCE")
    waiting = ledger.deliver.remote(_group(first))  # the first attempt's put, waiting on the full queue
    assert ray.get(ledger.deliver.remote(_group(group_id("m9", "F1903M", "FRANCE")))) is False  # its replay
    report = ledger.delivered_for.remote("m9")
    ready, _ = ray.wait([report], timeout=1.0)
    assert not ready, "a match's report waits until the deliveries for its seats settle"
    assert queue.get(timeout=5).group_id == "filler"  # the learner consumes: the waiting put goes through
    assert ray.get(waiting) is True and ray.get(report, timeout=30) == [first]
    assert ray.get(ledger.delivered_for.remote("m8")) == []


def test_a_restarted_ledger_still_drops_groups_it_accepted(
    ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queue = Queue(maxsize=5, actor_options={"name": "queue-restart-test"})
    accepted = str(tmp_path / "ledger" / "accepted.txt")
    ledger = GroupLedger.remote({"main": "queue-restart-test"}, accepted)  # type: ignore[attr-defined]
    first = group_id("m7", "S1902M", "FRANCE")
    assert ray.get(ledger.deliver.remote(_group("a"))) is True
    assert ray.get(ledger.deliver.remote(_group(first))) is True
    ray.kill(ledger, no_restart=False)  # Ray restarts it; its accepted ids come back from the file
    assert ray.get(ledger.deliver.remote(_group("a"))) is False
    # A replay of match m7 whose sampling went another way forked a year later: the same seat, dropped.
    replay = _group(group_id("m7", "F1903M", "FRANCE"))
    assert ray.get(ledger.deliver.remote(replay)) is False
    assert ray.get(ledger.delivered_for.remote("m7")) == [first]
    assert ray.get(ledger.deliver.remote(_group(group_id("m7", "F1903M", "ENGLAND")))) is True  # another seat
    # The match's second fork point (`episode.fork_points`) is a seat of its own; its replay is dropped too.
    second = group_id("m7", "S1903M", "FRANCE", point=1)
    assert ray.get(ledger.deliver.remote(_group(second))) is True
    assert ray.get(ledger.deliver.remote(_group(group_id("m7", "F1904M", "FRANCE", point=1)))) is False
    assert ray.get(ledger.delivered_for.remote("m7")) == sorted([first, "m7/F1903M/ENGLAND", second])
    assert ray.get(ledger.deliver.remote(_group("b"))) is True
    assert ray.get(ledger.stats.remote())["accepted"] == 5
    assert [queue.get(timeout=5).group_id for _ in range(5)] == ["a", first, "m7/F1903M/ENGLAND", second, "b"]
    # Queues passed by name: no object-store constructor argument for Ray to lose (ray-project/ray#53727).
    assert "constructor arguments in the object store" not in capfd.readouterr().err


def test_a_delivery_waiting_on_a_full_queue_returns_once_the_ledger_closes(ray_cluster: None) -> None:
    import ray
    from ray.util.queue import Queue

    from diprl.rollout.worker import GroupLedger

    queue = Queue(maxsize=1)
    ledger = GroupLedger.remote(queue)  # type: ignore[attr-defined]
    assert ray.get(ledger.deliver.remote(_group("a"))) is True
    waiting = ledger.deliver.remote(_group("b"))
    assert ray.wait([waiting], timeout=2)[0] == []  # backpressure: it waits while the queue is full
    ray.get(ledger.close.remote())  # the driver stopped taking batches
    assert ray.get(waiting, timeout=30) is False
    assert ray.get(ledger.stats.remote())["refused"] == 1 and queue.qsize() == 1
    # Not accepted: the same group is still deliverable by a later ledger (nothing half-delivered).
    assert ray.get(GroupLedger.remote(queue).stats.remote())["accepted"] == 0  # type: ignore[attr-defined]
