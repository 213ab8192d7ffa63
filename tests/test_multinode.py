"""Placement by configuration, and a run that loses a node: the smoke experiment on a head and two worker nodes
of one machine (`ray.cluster_utils.Cluster`), whose custom resources stand in for a GPU cluster's node types.

The run asks `placement=node_types` (conf/placement/node_types.yaml): learner and PolicyServer replica on the
node that declares `learner_node` and `inference_node` (a GPU machine), rollout workers on the one that declares
`rollout_node` (a CPU machine), league, ledger, queue and evaluator on the head. Each actor's node is read back
from Ray's state API. Then a spare node of the GPU type joins, the GPU node is killed mid-run (its raylet and
every process on it, as when a machine dies) and the run goes on: the learner and the replica come back on
the spare, every learner step is in metrics.jsonl once and in order, and the restart is on record as a fault.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diprl.inference.config import ServerConfig
from diprl.inference.deploy import replica_options
from diprl.ports import free_port
from diprl.run.config import ConfigError, PlacementConfig, compose_config
from diprl.run.rundir import config_differences, run_namespace, serve_app_name
from diprl.tracking import read_metrics

LOOPBACK = "127.0.0.1"
GPU_NODE = {"learner_node": 1.0, "inference_node": 1.0}  # what a GPU node type declares (docs/cluster.md)
CPU_NODE = {"rollout_node": 1.0}
HEAD_ROLES = ("league", "group-ledger", "queue-main", "evaluator")
# A lost node is noticed after about 5 s instead of Ray's default of about 17 s.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}


# ------------------------------------------------------------------------------------ configuration
def test_placement_presets_compose_and_bad_placements_are_named() -> None:
    config, _ = compose_config(["+experiment=smoke"])
    assert config.placement == PlacementConfig()  # the default: Ray places by CPUs and GPUs alone
    config, _ = compose_config(["+experiment=smoke", "placement=node_types"])
    assert config.placement.learner == {"learner_node": 0.001}
    assert config.placement.inference == {"inference_node": 0.001}
    assert config.placement.rollout == {"rollout_node": 0.001}
    for role in ("league", "ledger", "queues", "evaluator"):
        assert getattr(config.placement, role) == {"node:__internal_head__": 0.001}
    config, _ = compose_config(["+experiment=smoke", "+placement.rollout={cpu_box: 1}"])
    assert config.placement.rollout == {"cpu_box": 1.0}
    config, _ = compose_config(["+experiment=smoke", "placement=node_types", "++placement.rollout={cpu_box: 1}"])
    assert config.placement.rollout == {"rollout_node": 0.001, "cpu_box": 1.0}  # added to the preset's
    for override, message in [
        ("+placement.learner.GPU=1", "placement.learner: 'GPU' is set by the role's own"),
        ("+placement.rollout.cpu_box=1.5", "placement.rollout.cpu_box must be at most 1 or a whole number"),
        ("+placement.inference.gpu_box=0", "placement.inference.gpu_box must be a positive number"),
        ("+placement.nodes.gpu_box=1", "nodes"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
            compose_config(["+experiment=smoke", override])


def test_missing_resources_are_named_by_role() -> None:
    placement = PlacementConfig(learner={"learner_node": 0.001}, rollout={"rollout_node": 0.001, "CPU_box": 1.0})
    declared = {"CPU": 8.0, "learner_node": 1.0, "node:__internal_head__": 1.0}
    assert placement.missing(declared) == {"rollout": ["CPU_box", "rollout_node"]}


def test_a_resume_may_move_a_run_to_other_nodes() -> None:
    """Where a run runs is how this invocation reaches its cluster, not what the run is."""
    before, _ = compose_config(["+experiment=smoke"])
    after, _ = compose_config(["+experiment=smoke", "placement=node_types"])
    assert config_differences(before, after) == []
    changed, _ = compose_config(["+experiment=smoke", "placement=node_types", "learner.lr=0.5"])
    assert config_differences(before, changed) == ["learner.lr"]


def test_replicas_ask_for_their_placement_in_the_actor_and_the_first_bundle() -> None:
    options = replica_options(ServerConfig(replica_cpus=2.0), {"inference_node": 0.001})
    assert options["ray_actor_options"]["resources"] == {"inference_node": 0.001}
    assert "resources" not in replica_options(ServerConfig())["ray_actor_options"]
    tp = replica_options(ServerConfig(replica_cpus=4.0, replica_gpus=1.0, tensor_parallel_size=2), {"gpu_box": 0.5})
    # Serve puts the replica actor in the first bundle: it must hold what the actor asks for.
    assert tp["ray_actor_options"]["resources"] == {"gpu_box": 0.5}
    assert tp["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0, "gpu_box": 0.5}, {"GPU": 1.0}]


def test_actor_factories_pass_the_placement_and_a_learner_takes_whole_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `start_actors` hands each factory reaches Ray's options; a learner's GPU is never a fraction, so
    Ray never gives a replica part of it (the plan counts learner and replica GPUs apart the same way)."""
    import ray

    from diprl.learn.actor import learner_actor
    from diprl.learn.config import LearnerConfig
    from diprl.learn.site import LearnerSite
    from diprl.rollout.worker import WorkerConfig, worker_actor

    seen: list[dict[str, Any]] = []

    class Remote:
        def options(self, **options: Any) -> Remote:
            seen.append(options)
            return self

        def remote(self, *args: Any, **kwargs: Any) -> None:
            return None

    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    learner_actor(LearnerConfig(use_gpu=True), LearnerSite("run", "adapters"), resources={"learner_node": 0.001})
    worker_actor(WorkerConfig(), "ledger", 0, 0.5, "rollout-0", {"rollout_node": 0.001})
    learner_actor(LearnerConfig(), LearnerSite("run", "adapters"))
    assert seen[0]["resources"] == {"learner_node": 0.001} and seen[0]["num_gpus"] == 1
    assert seen[1]["resources"] == {"rollout_node": 0.001} and seen[1]["num_cpus"] == 0.5
    assert "resources" not in seen[2] and seen[2]["num_gpus"] == 0


# ------------------------------------------------------------------------------------ the cluster
@contextlib.contextmanager
def _private_home() -> Iterator[None]:
    """Ray's processes start with the HOME `diprl.raysession` gives a local head: its `{}` bootstrap file
    keeps the dashboard's usage-stats module from asking cloud metadata services who hosts it."""
    from diprl.raysession import private_home

    old = os.environ.get("HOME")
    os.environ["HOME"] = str(private_home())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old


def _add_node(cluster: Any, resources: dict[str, float], num_cpus: int) -> Any:
    with _private_home():
        return cluster.add_node(node_ip_address=LOOPBACK, num_cpus=num_cpus, resources=resources)


def _actors(dashboard: str, namespace: str, serve_app: str) -> list[Any]:
    """The run's named actors and its PolicyServer replicas, alive or dead (a restarted actor keeps its id)."""
    from ray.util.state import list_actors

    return [
        a
        for a in list_actors(address=dashboard, detail=True, limit=10_000, raise_on_missing_output=False)
        if a.ray_namespace == namespace or (a.class_name or "").startswith(f"ServeReplica:{serve_app}:")
    ]


def _where(actors: list[Any], state: str = "ALIVE") -> dict[str, set[str]]:
    """Role -> the nodes its actors in `state` run on; every replica is `replica`."""
    nodes: dict[str, set[str]] = {}
    for a in actors:
        if a.state == state:
            role = "replica" if (a.class_name or "").startswith("ServeReplica:") else a.name
            nodes.setdefault(role, set()).add(a.node_id)
    return nodes


def _wait(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> Any:
    """Poll `ready()` until it returns something true; fail with the run's output if it ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not (value := ready()):
        tail = log.read_text()[-3000:] + log.with_suffix(".err").read_text()[-3000:]
        assert proc.poll() is None, f"the run ended before {what}:\n{tail}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s:\n{tail}"
        time.sleep(0.5)
    return value


def _learner_steps(run_dir: Path) -> list[int]:
    records = read_metrics(run_dir / "metrics.jsonl")
    # trained steps: a restarted learner whose first answer trained nothing (its checkpoint already held the
    # step in flight at the loss) logs a record of the version it published, with trained 0
    return [r["step"] for r in records if r["kind"] == "learner" and r["policy"] == "main" and r.get("trained", 1)]


@pytest.mark.slow
def test_smoke_run_is_placed_by_node_type_and_survives_a_lost_gpu_node(tmp_path: Path) -> None:
    """The node is lost right after the first step; the run goes on until two more steps are logged, then
    SIGTERM stops it the way a user would (it drains and writes its final checkpoint): no step budget
    can run out before the loss, however fast this machine is."""
    from ray.cluster_utils import Cluster

    dashboard_port = free_port(LOOPBACK)
    with _private_home():
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": LOOPBACK,
                "num_cpus": 2,
                "include_dashboard": True,  # Ray's state API (where each actor runs) lives in the dashboard
                "dashboard_host": LOOPBACK,
                "dashboard_port": dashboard_port,
                "_system_config": FAST_HEALTH_CHECKS,
            },
        )
    proc: subprocess.Popen[bytes] | None = None
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    try:
        gpu = _add_node(cluster, GPU_NODE, num_cpus=2)  # learner (1 CPU) + replica (1 CPU)
        cpu = _add_node(cluster, CPU_NODE, num_cpus=1)  # two rollout workers of 0.5 CPU
        cluster.wait_for_nodes()
        head = cluster.head_node.node_id
        args = [
            "+experiment=smoke",
            "placement=node_types",
            f"train.run_dir={run_dir}",
            "train.max_steps=100",  # stopped by SIGTERM once the loss is behind it
            "train.wandb=false",
            "train.web_port=null",
            "inference.port=0",
        ]
        env = dict(os.environ, RAY_ADDRESS=cluster.address)  # joins the cluster, as `ray job submit` does
        with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "diprl.train", *args], stdout=out, stderr=err, env=env, start_new_session=True
            )
        dashboard = f"http://{LOOPBACK}:{dashboard_port}"
        namespace, app = run_namespace(run_dir), serve_app_name(run_dir)

        # Placed where the configuration says, every role on the node that declares its resource.
        _wait("learner step 1", lambda: _learner_steps(run_dir), proc, log, 420)
        where = _where(_actors(dashboard, namespace, app))
        assert where.get("learner-main") == {gpu.node_id} and where.get("replica") == {gpu.node_id}, where
        assert where.get("rollout-0") == where.get("rollout-1") == {cpu.node_id}, where
        for role in HEAD_ROLES:
            assert where.get(role) == {head}, (role, where)

        # A spare GPU node joins; the GPU node dies mid-run with the learner and the replica on it.
        spare = _add_node(cluster, GPU_NODE, num_cpus=2)
        cluster.remove_node(gpu, allow_graceful=False)
        lost_at = max(_learner_steps(run_dir))

        def recovered() -> bool:
            if max(_learner_steps(run_dir)) < lost_at + 2:  # the step in flight at the loss, and one more
                return False
            now = _where(_actors(dashboard, namespace, app))
            return now.get("learner-main") == {spare.node_id} and now.get("replica") == {spare.node_id}

        _wait("two learner steps after the loss, learner and replica on the spare node", recovered, proc, log, 420)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log.with_suffix(".err").read_text()[-3000:]
        final = _actors(dashboard, namespace, app)  # dead now, each with the node it ran on last
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cluster.shutdown()

    output = log.read_text()
    summary = dict(kv.split("=", 1) for kv in output.strip().splitlines()[-1].split())
    assert summary["stopped"] == "signal_SIGTERM", output[-3000:]
    assert "no node of this Ray cluster declares" not in log.with_suffix(".err").read_text()
    # Every learner step once, in order, across the loss; the last one is the final checkpoint's.
    steps = _learner_steps(run_dir)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= lost_at + 2, (lost_at, steps)
    assert summary["train_steps"] == str(steps[-1])
    # The restart is on record: the learner's new process on the spare, and what it replayed.
    records = read_metrics(run_dir / "metrics.jsonl")
    faults = [r for r in records if r["kind"] == "fault"]
    restarts = [r for r in faults if r.get("restarted") == "learner-main"]
    assert restarts and all(r["pid"] != r["previous_pid"] for r in restarts), faults
    # Nothing ran where its placement did not allow: replicas on GPU nodes only, the others never moved.
    last = _where(final, "DEAD")
    assert last.get("learner-main") == {spare.node_id}, last
    replicas = last.get("replica", set())
    assert spare.node_id in replicas and replicas <= {gpu.node_id, spare.node_id}, last
    assert last.get("rollout-0") == last.get("rollout-1") == {cpu.node_id}, last
    assert all(last.get(role) == {head} for role in HEAD_ROLES), last
