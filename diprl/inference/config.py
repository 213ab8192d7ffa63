"""Typed configuration of the inference service (Hydra group `inference`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.structured_config import load_structured


@dataclass
class ServerConfig:
    """One PolicyServer deployment: its replicas, the vLLM engine in each, and where adapters come from.

    `model` is a preset name (`tiny`, `qwen3_8b`, ...) or a local checkpoint path. `adapter_root` is
    the AdapterStore directory (shared between learner and replicas on one machine or a shared
    filesystem); `adapter_cache` is each replica's local copy when adapters travel through Ray's
    object store instead.
    """

    model: str = "tiny"
    dtype: str | None = None  # None: the preset's dtype
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_lora_rank: int = 8
    max_loras: int = 4  # adapters in one batch (GPU slots)
    max_cpu_loras: int = 8  # adapters kept loaded by the engine
    loaded_adapters: int = 8  # this server's LRU of versions; older ones are unloaded
    adapter_root: str = "runs/adapters"
    adapter_cache: str = ".cache/adapter_cache"
    # Name of an AdapterRegistry actor: versions missing from adapter_root are fetched from Ray's
    # object store through it (clusters without a shared filesystem). None: the directory only.
    adapter_registry: str | None = None
    seed: int = 0
    engine_extra: dict[str, Any] = field(default_factory=dict)
    # Ray Serve
    name: str = "policy"
    num_replicas: int = 1
    autoscaling: dict[str, Any] | None = None  # e.g. {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 32}
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing_requests: int = 64
    host: str = "127.0.0.1"  # never a public interface unless the config says so
    port: int = 8000


def register_configs() -> None:
    """Register the `base_inference` schema (group `inference`) that the YAML files extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="inference", name="base_inference", node=ServerConfig)


def load_server_config(name: str, conf_dir: Path | None = None) -> ServerConfig:
    """Read `conf/inference/<name>.yaml` into a validated `ServerConfig` (typos and wrong types fail)."""
    return load_structured(ServerConfig, "inference", name, conf_dir)
