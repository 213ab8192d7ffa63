"""Typed configuration of the inference service (Hydra group `inference`), checked when it is built.

A config is validated in `__post_init__`, so a bad value fails where the config is read (the YAML
loader, Hydra's `OmegaConf.to_object`, or `ServerConfig(**dict)` in a replica) with the field's
name, instead of as an engine error minutes later on a replica.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diprl.ports import is_loopback
from diprl.structured_config import CONF_DIR, load_structured

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM's kernels are built for; `max_lora_rank` must be one of them."""


def rank_to_serve(max_lora_rank: int, adapter_rank: int) -> int:
    """`max_lora_rank`, raised to the smallest rank vLLM's kernels take that holds `adapter_rank` (a model
    preset's LoRA rank): below it vLLM refuses every adapter of the policy, so every request fails."""
    if adapter_rank <= max_lora_rank:
        return max_lora_rank
    for rank in LORA_RANKS:
        if rank >= adapter_rank:
            return rank
    raise ValueError(f"LoRA rank {adapter_rank} is above every rank vLLM serves ({LORA_RANKS[-1]})")


ENGINE_MANAGED = frozenset(
    {
        "model",
        "dtype",
        "max_model_len",
        "enable_prefix_caching",
        "max_num_seqs",
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "max_cpu_loras",
        "logits_processors",
        "logprobs_mode",
        "generation_config",
        "seed",
        "tensor_parallel_size",
        "distributed_executor_backend",
    }
)
"""Engine arguments the server sets itself: `engine_extra` may not override them (turning LoRA or the
order constraint off would break every request, silently)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """One PolicyServer deployment: its replicas, the vLLM engine in each, and where adapters come from.

    `model` is a preset name (`tiny`, `qwen3_8b`, ...) or a local checkpoint path. `adapter_root` is
    the AdapterStore directory the learners publish to and the replicas read: one machine's, or on a
    cluster the run directory every node mounts (`docs/cluster.md`).
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
    seed: int = 0
    engine_extra: dict[str, Any] = field(default_factory=dict)
    # On CPU, start the engine core with tcmalloc preloaded where the machine has it (`make install` installs
    # Debian's libtcmalloc-minimal4): 1.22 times the bare engine's tokens a second (docs/benchmarks.md).
    preload_tcmalloc: bool = True
    # Ray Serve
    name: str = "policy"  # the Serve application and its deployment; one per run on a shared cluster
    route_prefix: str = "/"  # where the HTTP route lives; applications on one cluster need distinct ones
    num_replicas: int = 1
    autoscaling: dict[str, Any] | None = None  # e.g. {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 32}
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0  # GPUs of a replica with tensor_parallel_size 1 (a fraction shares one GPU)
    # GPUs one replica's engine shards the model over (vLLM tensor parallelism). Above 1 every replica gets
    # its own placement group of that many one-GPU bundles on one node, and replica_gpus must be 1.
    tensor_parallel_size: int = 1
    max_ongoing_requests: int = 64
    host: str = "127.0.0.1"  # never a public interface unless allow_public_host says so
    allow_public_host: bool = False  # opt in to a non-loopback host (it warns without a token)
    # A file whose first line is the bearer token every HTTP request must carry (else $DIPRL_POLICY_TOKEN;
    # neither: no token). Read by each replica, so the token never sits in the deployment's config.
    http_token_file: str | None = None
    port: int = 8000  # 0: pick a free port (the server logs which)
    # A request that has not finished after this long fails with a timeout (and is aborted in the
    # engine); loading an adapter has the same limit. Nothing a client sends can wait forever.
    request_timeout_s: float = 300.0
    # The HTTP route shares each replica with training's handle calls (`max_ongoing_requests` counts
    # both): it runs at most this many completions at once and answers 429 beyond (0: refuses all),
    # and refuses bodies above max_body_bytes with 413 before parsing them.
    http_max_ongoing: int = 4
    max_body_bytes: int = 1 << 20
    max_batch: int = 4096  # requests in one `generate` call
    # vLLM, Ray and Serve logging inside the replicas (their INFO lines bury results); DEBUG/INFO to debug.
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        problems = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        def positive_int(name: str, low: int = 1, high: int | None = None) -> None:
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            ok = ok and (high is None or value <= high)
            need(ok, f"{name} must be an integer in [{low}, {high if high is not None else 'inf'}], got {value!r}")

        need(
            isinstance(self.model, str) and bool(self.model.strip()),
            f"model must be a non-empty string, got {self.model!r}",
        )
        need(
            self.dtype in (None, "auto", "float32", "float16", "bfloat16"),
            f"dtype must be auto/float32/float16/bfloat16 or null, got {self.dtype!r}",
        )
        positive_int("max_model_len", 16, 1 << 20)
        positive_int("max_num_seqs", 1, 1 << 16)
        need(
            self.max_lora_rank in LORA_RANKS,
            f"max_lora_rank must be one of {list(LORA_RANKS)} (vLLM's kernels), got {self.max_lora_rank!r}",
        )
        positive_int("max_loras", 1, 1024)
        positive_int("max_cpu_loras", 1, 1 << 16)
        positive_int("loaded_adapters", 1, 1 << 16)
        positive_int("seed", 0)
        positive_int("num_replicas", 1, 1024)
        positive_int("max_ongoing_requests", 1, 1 << 20)
        positive_int("port", 0, 65535)
        positive_int("max_batch", 1, 1 << 20)
        positive_int("tensor_parallel_size", 1, 64)
        positive_int("http_max_ongoing", 0, 1 << 20)
        positive_int("max_body_bytes", 1024, 1 << 30)
        if not problems:
            need(
                self.max_cpu_loras >= self.max_loras,
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "the engine keeps every batch's adapters loaded",
            )
            need(
                self.loaded_adapters <= self.max_cpu_loras,
                f"loaded_adapters ({self.loaded_adapters}) must be <= max_cpu_loras ({self.max_cpu_loras}): "
                "the server would keep more versions loaded than the engine holds",
            )
            need(
                self.tensor_parallel_size == 1 or self.replica_gpus == 1,
                f"tensor_parallel_size {self.tensor_parallel_size} needs replica_gpus: 1 (one whole GPU per shard), "
                f"got {self.replica_gpus!r}",
            )
            need(
                self.http_max_ongoing < self.max_ongoing_requests,
                f"http_max_ongoing ({self.http_max_ongoing}) must be < max_ongoing_requests "
                f"({self.max_ongoing_requests}): the HTTP route must leave room for training's generate calls",
            )
        for name in ("replica_cpus", "replica_gpus", "request_timeout_s"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            low = 0.0 if name == "replica_gpus" else 1e-3
            need(ok and value >= low, f"{name} must be a finite number >= {low}, got {value!r}")
        for name in ("adapter_root", "name"):
            value = getattr(self, name)
            need(isinstance(value, str) and bool(value.strip()), f"{name} must be a non-empty string, got {value!r}")
        need(
            isinstance(self.route_prefix, str) and re.fullmatch(r"/[A-Za-z0-9._/-]*", self.route_prefix) is not None,
            f"route_prefix must be a URL path starting with '/', got {self.route_prefix!r}",
        )
        need(isinstance(self.engine_extra, dict), f"engine_extra must be a mapping, got {self.engine_extra!r}")
        need(
            isinstance(self.preload_tcmalloc, bool),
            f"preload_tcmalloc must be true or false, got {self.preload_tcmalloc!r}",
        )
        if isinstance(self.engine_extra, dict):
            managed = sorted(ENGINE_MANAGED & set(self.engine_extra))
            need(not managed, f"engine_extra may not set {managed}: the server sets them (use the config's own fields)")
        if self.autoscaling is not None:
            auto = self.autoscaling
            low, high = auto.get("min_replicas", 1), auto.get("max_replicas", 1)
            ok = (
                all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high))
                and 0 <= low <= high
                and high >= 1
            )
            need(ok, f"autoscaling needs integers 0 <= min_replicas <= max_replicas >= 1, got {auto!r}")
        need(self.log_level in LOG_LEVELS, f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        need(isinstance(self.host, str) and bool(self.host), f"host must be an address, got {self.host!r}")
        need(
            self.http_token_file is None or (isinstance(self.http_token_file, str) and bool(self.http_token_file)),
            f"http_token_file must be a path or null, got {self.http_token_file!r}",
        )
        if not problems and not is_loopback(self.host):
            need(
                self.allow_public_host,
                f"host {self.host!r} is not a loopback address: binding it needs allow_public_host: true "
                "(and a token: http_token_file or $DIPRL_POLICY_TOKEN)",
            )
        if problems:
            raise ValueError("invalid inference config: " + "; ".join(problems))
        if not is_loopback(self.host) and not self.http_token_file and not os.environ.get("DIPRL_POLICY_TOKEN"):
            log.warning(
                "PolicyServer HTTP route will listen on %s:%s, reachable from other machines and unauthenticated "
                "(set http_token_file or $DIPRL_POLICY_TOKEN to demand a bearer token)",
                self.host,
                self.port,
            )


def register_configs() -> None:
    """Register the `base_inference` schema (group `inference`) that the YAML files extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="inference", name="base_inference", node=ServerConfig)


def load_server_config(name: str, conf_dir: Path | None = None) -> ServerConfig:
    """Read `conf/inference/<name>.yaml` into a validated `ServerConfig` (typos, wrong types, bad ranges fail).

    An empty file is an error, not the defaults: it is far more likely a failed write than a choice.
    `max_lora_rank` holds at least the rank of `model`'s preset (`with_preset_lora_rank`).
    """
    path = (conf_dir or CONF_DIR) / "inference" / f"{name}.yaml"
    if path.is_file() and "/" not in name and not path.read_text().strip():
        raise ValueError(
            f"{path}: the file is empty (write the settings, or `defaults: [base_inference]` for defaults)"
        )
    return with_preset_lora_rank(load_structured(ServerConfig, "inference", name, conf_dir))


def with_preset_lora_rank(config: ServerConfig) -> ServerConfig:
    """`config` with LoRA slots wide enough for its model preset's adapters (`rank_to_serve`).

    A training run's composed config gets this from its model preset; a standalone server
    (`python -m diprl.evaluate server=<name>`) has only its YAML, which would otherwise have to repeat the
    preset's rank. A `model` that is a checkpoint path names no preset and keeps its setting. Presets are
    looked up where the server resolves `model` (`policy_engine.resolve_model`), the default conf directory.
    """
    from diprl.policy.models import known_presets, load_preset

    if config.model not in known_presets():
        return config
    rank = rank_to_serve(config.max_lora_rank, load_preset(config.model).lora.rank)
    return config if rank == config.max_lora_rank else replace(config, max_lora_rank=rank)
