"""Tensor-parallel PolicyServer replicas: each replica in placement-group bundles of its own, one GPU per shard.

vLLM's CUDA build is not on this machine, so the engine itself is not started with two shards here. What
is tested: the options `serve_policy` deploys with (and that tensor parallelism 1 keeps the CPU path's),
the engine arguments a replica hands vLLM, and, on a real local Ray with stand-in GPUs, that Ray Serve
gives each replica its own placement group in which workers placed the way vLLM's Ray executor places
them get one GPU each, never one another replica holds.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diprl.inference import deploy
from diprl.inference.config import ServerConfig
from diprl.inference.deploy import replica_options
from diprl.inference.engine import start_async_engine


def test_tensor_parallel_1_keeps_the_replica_actor_as_it_was() -> None:
    cpu = ServerConfig(replica_cpus=1.0)
    options = replica_options(cpu)
    assert set(options) == {"ray_actor_options"}  # no placement group on the CPU path
    actor = options["ray_actor_options"]
    assert actor["num_cpus"] == 1.0 and actor["num_gpus"] == 0.0
    assert actor["runtime_env"]["env_vars"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    gpu = replica_options(ServerConfig(replica_cpus=4.0, replica_gpus=1.0))
    assert set(gpu) == {"ray_actor_options"} and gpu["ray_actor_options"]["num_gpus"] == 1.0


def test_tensor_parallel_2_gives_each_replica_two_one_gpu_bundles_on_one_node() -> None:
    options = replica_options(ServerConfig(replica_cpus=4.0, replica_gpus=1.0, tensor_parallel_size=2))
    assert options["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}, {"GPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 4.0
    assert options["ray_actor_options"]["num_gpus"] == 0  # the shards' workers hold the GPUs


def test_tensor_parallelism_needs_whole_gpus_and_its_own_field() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs replica_gpus: 1"):
        ServerConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="engine_extra may not set"):
        ServerConfig(engine_extra={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServerConfig(tensor_parallel_size=0)


def test_serve_policy_deploys_the_bundles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ray Serve's own `Deployment.options` checks that the replica actor fits its first bundle."""
    deployed: dict[str, Any] = {}

    def run(app: Any, **kwargs: Any) -> str:
        deployed["replica"] = app._bound_deployment._replica_config
        return "handle"

    monkeypatch.setattr(deploy.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(deploy.serve, "run", run)
    monkeypatch.setattr(deploy, "_serve_running", lambda: True)
    monkeypatch.setattr(deploy, "_served_adapter_root", lambda name: None)
    monkeypatch.setattr(deploy, "resolve_model", lambda config: (str(tmp_path / "model"), "bfloat16"))
    config = ServerConfig(
        adapter_root=str(tmp_path / "adapters"), replica_cpus=4.0, replica_gpus=1.0, tensor_parallel_size=2
    )
    assert deploy.serve_policy(config) == "handle"
    replica = deployed["replica"]
    assert replica.placement_group_bundles == [{"CPU": 4.0, "GPU": 1.0}, {"GPU": 1.0}]
    assert replica.placement_group_strategy == "STRICT_PACK"
    assert replica.ray_actor_options["num_gpus"] == 0


def test_the_engine_is_asked_for_the_shards_and_ray_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []

    class EngineArgs:
        def __init__(self, **kwargs: Any) -> None:
            asked.append(kwargs)

    class AsyncLLM:
        @staticmethod
        def from_engine_args(args: Any) -> str:
            return "engine"

    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(AsyncEngineArgs=EngineArgs))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", types.SimpleNamespace(AsyncLLM=AsyncLLM))
    start_async_engine(ServerConfig(replica_gpus=1.0, tensor_parallel_size=2), "model-dir", "bfloat16")
    start_async_engine(ServerConfig(), "model-dir", "float32")
    assert asked[0]["tensor_parallel_size"] == 2 and asked[0]["distributed_executor_backend"] == "ray"
    assert asked[1]["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in asked[1]


@pytest.fixture(scope="module")
def ray_with_four_gpus() -> Iterator[None]:
    """A local Ray that believes it has four GPUs (Ray schedules by count; nothing touches a device)."""
    import ray
    from ray import serve

    from diprl.ports import free_port
    from diprl.raysession import connect

    connect(address="local", num_cpus=2, num_gpus=4, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": free_port("127.0.0.1")})
    yield
    serve.shutdown()
    ray.shutdown()


def test_each_replica_gets_its_own_gpus_in_its_own_placement_group(ray_with_four_gpus: None) -> None:
    import ray
    from ray import serve
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Shard:
        """Stands in for a vLLM worker: placed like vLLM's Ray executor places one (0 CPUs, 1 GPU, a bundle)."""

        def gpus(self) -> list[str]:
            return [str(g) for g in ray.get_gpu_ids()]

    @serve.deployment
    class Replica:
        def __init__(self) -> None:
            group = ray.util.get_current_placement_group()
            assert group is not None, "a replica with placement_group_bundles runs in its placement group"
            self.bundles = group.bundle_specs
            indices = [i for i, bundle in enumerate(self.bundles) if bundle.get("GPU")]
            self.shards = [
                Shard.options(  # type: ignore[attr-defined]
                    num_cpus=0,
                    num_gpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle_index, True),
                ).remote()
                for bundle_index in indices
            ]

        def report(self) -> dict[str, Any]:
            return {
                "bundles": self.bundles,
                "own_gpus": ray.get_gpu_ids(),
                "shard_gpus": ray.get([s.gpus.remote() for s in self.shards]),
            }

    config = ServerConfig(replica_cpus=0.5, replica_gpus=1.0, tensor_parallel_size=2)
    app = Replica.options(num_replicas=2, **replica_options(config)).bind()  # type: ignore[attr-defined]
    handle = serve.run(app, name="tp-probe", route_prefix="/tp-probe")
    reports: dict[str, dict[str, Any]] = {}
    for _ in range(40):  # requests reach both replicas sooner or later
        report = handle.report.remote().result(timeout_s=60)
        reports[str(report["shard_gpus"])] = report
        if len(reports) == 2:
            break
    assert len(reports) == 2
    shard_gpus = [g for report in reports.values() for shard in report["shard_gpus"] for g in shard]
    assert len(shard_gpus) == 4 and len(set(shard_gpus)) == 4  # two shards each, no GPU shared
    for report in reports.values():
        assert report["bundles"] == [{"CPU": 0.5, "GPU": 1.0}, {"GPU": 1.0}]
        assert report["own_gpus"] == []
    serve.delete("tp-probe")
