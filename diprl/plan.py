"""`python -m diprl.plan model=qwen3_14b cluster=a100x8 [overrides]`: does a configuration fit its GPUs, and
what limits a training step?

A GPU run fails late and expensively when it does not fit: the learner runs out of memory at its first
micro-batch, a replica's KV cache cannot hold `max_num_seqs` requests, or the placement leaves the
learner without a GPU. This module answers before anything starts, by arithmetic alone (it imports
none of torch, ray, vllm), from the same Hydra groups a run composes (`model`, `inference`, `learner`)
plus `cluster` (the GPUs and their stated rates) and `workload` (what a training step asks for,
measured on our own rollouts). Every term is derived from shapes and counts, never fitted, so each can
be checked by hand and against a measurement on a real GPU: the tests do the former on a tiny model.

Memory, per GPU:
- a learner rank (bf16, gradient checkpointing, DeepSpeed ZeRO): the frozen base weights, the LoRA
  weights, their gradients, fp32 master copy and Adam moments (partitioned over the ranks from ZeRO-1
  or 2 on, the base weights too at ZeRO-3), DeepSpeed's contiguous gradient bucket, the checkpointed
  layer inputs of one micro-batch, the one layer being recomputed in the backward pass, and the LM head
  over one chunk of completion positions (prompt positions never reach it). A learner host
  (`learner.adapters_per_actor` > 1, `diprl.learn.host`) holds the base once and, per adapter, the LoRA
  weights and optimiser state; gradients, bucket and activations live only during one adapter's step,
  and the host steps one adapter at a time, so they count once; the plan says how many adapters fit;
- a replica (vLLM): its shard of the weights, the KV cache for `max_num_seqs` requests of the workload's
  length, `max_loras` LoRA slots at `max_lora_rank`, the activations of one scheduler batch and the
  sampler's logits. It must fit in `gpu_memory_utilization` of the GPU, which vLLM claims.

The league (`league.roles`: the trained policies) decides how many learners there are: one per policy, or
one host per `adapters_per_actor` policies, each of `learner.ranks` GPUs; the plan names the GPUs a host
frees for replicas compared with one learner per policy.

Time of one training step in steady state (in a league, one step of every trained policy), where
rollouts and learning overlap: the slowest of the
learner (6 x parameters x tokens FLOPs at a measured utilisation, plus the old-policy logprob pass,
optimiser, gradient exchange and storage), the replicas (decode bound by HBM bandwidth or FLOPs, plus
tensor-parallel all-reduces and the order constraint's CPU time per decode step; prefill at the
measured utilisation) and the rollout CPUs. That part is named as the limit.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diprl.structured_config import CONF_DIR

GIB = float(1 << 30)
BF16 = 2
FP32 = 4

# DeepSpeed 0.19 defaults our `deepspeed_config` leaves in place (diprl/learn/model.py).
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000  # `reduce_bucket_size`: one contiguous gradient buffer of this many
DS_PREFETCH_BUCKET_ELEMENTS = 50_000_000  # ZeRO-3 `stage3_prefetch_bucket_size`: parameters fetched ahead
# vLLM 0.32 defaults for an AsyncLLM (the engine context) unless `inference.engine_extra` sets them.
VLLM_GPU_MEMORY_UTILIZATION = 0.92
VLLM_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_BLOCK_TOKENS = 16


# ------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a Qwen3-architecture model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder block, by the name LoRA targets."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """One decoder block: its linear layers, two RMSNorms over the hidden size, q_norm and k_norm."""
        linear = sum(a * b for a, b in self.linear_dims().values())
        return linear + 2 * self.hidden + 2 * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Embedding, blocks, final norm, and an LM head of its own unless tied to the embedding."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.layers * self.layer_params + self.hidden + head

    def lora_params(self, rank: int, modules: Sequence[str]) -> int:
        """Trainable parameters of a LoRA of `rank` on `modules` in every block: rank x (in + out) each."""
        dims = self.linear_dims()
        unknown = sorted(set(modules) - set(dims))
        if unknown:
            raise PlanError(f"LoRA target modules {unknown} are not linear layers of a Qwen3 block ({sorted(dims)})")
        return self.layers * sum(rank * (dims[m][0] + dims[m][1]) for m in modules)

    def kv_bytes_per_token(self, dtype_bytes: int = BF16) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


KNOWN_SHAPES: dict[str, ModelShape] = {
    # config.json of the checkpoints on the Hugging Face hub.
    "Qwen/Qwen3-8B": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, tied_embeddings=False),
    "Qwen/Qwen3-14B": ModelShape(5120, 17408, 40, 40, 8, 128, 151936, tied_embeddings=False),
}


class PlanError(ValueError):
    """A configuration the plan cannot be made for (as opposed to one that does not fit)."""


def model_shape(preset: Any) -> ModelShape:
    """The shape of a model preset: a tiny spec's own, a local checkpoint's config.json, or a known hub model."""
    if preset.tiny is not None:
        t = preset.tiny
        return ModelShape(
            t.hidden_size,
            t.intermediate_size,
            t.num_hidden_layers,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.vocab_size,
            tied_embeddings=True,
        )
    path = Path(str(preset.path)) / "config.json"
    if path.is_file():
        c = json.loads(path.read_text())
        try:
            return ModelShape(
                c["hidden_size"],
                c["intermediate_size"],
                c["num_hidden_layers"],
                c["num_attention_heads"],
                c["num_key_value_heads"],
                c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                c["vocab_size"],
                tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            )
        except KeyError as err:
            raise PlanError(f"{path} lacks {err}: not a Qwen3-style config") from err
    if preset.path in KNOWN_SHAPES:
        return KNOWN_SHAPES[preset.path]
    raise PlanError(
        f"model {preset.name!r}: no shape for {preset.path!r} (known: {sorted(KNOWN_SHAPES)}; or point model.path "
        "at a checkpoint directory with a config.json)"
    )


# ------------------------------------------------------------------------------------------ configs
def sourced(default: float) -> Any:
    """A rate, capacity or measured count the plan rests on: it must come with its source in `sources`."""
    return field(default=default, metadata={"sourced": True})


def sourced_fields(config: type) -> tuple[str, ...]:
    """The fields of `config` declared with `sourced`, in declaration order."""
    return tuple(f.name for f in fields(config) if f.metadata.get("sourced"))


def unsourced(config: Any) -> list[str]:
    """A problem line for every sourced field of `config` whose source (in its `sources`) is missing or blank."""
    return [
        f"{name} has no source (sources.{name}: where the number comes from)"
        for name in sourced_fields(type(config))
        if not str(config.sources.get(name, "")).strip()
    ]


@dataclass
class ClusterConfig:
    """The GPUs of a cluster and the rates the time estimate assumes (Hydra group `cluster`).

    Every rate and capacity is stated with its source in `sources` (keyed by field name); the plan prints
    them beside its results, and a rate without one is an error.
    """

    name: str = "custom"
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_node: int = 96
    gpu_name: str = "gpu"
    gpu_memory_gib: float = sourced(0.0)  # what the device reports as its total capacity
    bf16_flops: float = sourced(0.0)  # dense bf16 peak, FLOP/s
    hbm_bytes_per_s: float = sourced(0.0)
    intra_node_bytes_per_s: float = sourced(0.0)  # GPU to GPU in a node, one direction
    inter_node_bytes_per_s: float = sourced(0.0)  # node to node, one direction
    interconnect: str = ""
    train_utilisation: float = sourced(0.0)  # achieved / peak FLOP/s of a LoRA step, counted as 6 x params x tokens
    decode_hbm_utilisation: float = sourced(0.0)  # achieved / peak HBM bandwidth of a vLLM decode step
    storage_bytes_per_s: float = sourced(0.0)  # durable writes (publish, checkpoint), hashing and fsync included
    runtime_reserve_gib: float = sourced(0.0)  # per GPU, outside any allocator: CUDA context, NCCL, CUDA graphs
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = [f"{n} must be >= 1" for n in ("nodes", "gpus_per_node", "cpus_per_node") if getattr(self, n) < 1]
        for name in sourced_fields(ClusterConfig):
            value = getattr(self, name)
            low_ok = value >= 0 if name == "runtime_reserve_gib" else value > 0
            if not (math.isfinite(value) and low_ok):
                problems.append(f"{name} must be a positive number, got {value}")
        problems += unsourced(self)
        for name in ("train_utilisation", "decode_hbm_utilisation"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if problems:
            raise ValueError(f"invalid cluster config {self.name!r}: " + "; ".join(problems))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Workload:
    """What one training step asks of the GPUs, from our own rollouts (Hydra group `workload`).

    Every number has its source in `sources`. `tokenizer` names the vocabulary the token counts were
    measured with; the plan refuses a model whose tokenizer differs.
    """

    tokenizer: str = "qwen3"
    prompt_tokens: float = sourced(0.0)  # mean prompt of one request (one power, one phase)
    completion_tokens: float = sourced(0.0)  # mean completion: one power's orders, `</orders>`, end of turn
    shared_prompt_share: float = sourced(0.0)  # share of a prompt identical for one phase's LLM seats (rules, board)
    group_size: int = sourced(4)  # forks of one decision state (G)
    decisions_per_fork: float = sourced(1.0)  # training records per fork: 1 for train_turns=fork
    llm_seats: float = sourced(0.0)  # LLM seats per phase of a match
    warmup_phases: float = sourced(0.0)  # phases played before the fork, on average
    phases_per_fork: float = sourced(0.0)  # phases each fork plays to its horizon
    groups_per_match: float = sourced(1.0)  # trained seats per match (each yields a group)
    stale_share: float = sourced(1.0)  # records sampled by an older version: their old logprobs cost a forward pass
    constraint_s_per_request_step: float = sourced(0.0)  # CPU time of the order constraint per request and decode step
    rollout_s_per_phase: float = sourced(0.0)  # CPU time of a rollout worker per fork-phase (engine, rewards)
    rollout_workers: int = sourced(32)
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        for name in sourced_fields(Workload):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a number >= 0, got {value}")
        problems += unsourced(self)
        for name in ("prompt_tokens", "completion_tokens", "group_size", "llm_seats", "rollout_workers"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive")
        for name in ("shared_prompt_share", "stale_share"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} must be in [0, 1]")
        if problems:
            raise ValueError("invalid workload: " + "; ".join(problems))

    @property
    def tokens_per_record(self) -> float:
        return self.prompt_tokens + self.completion_tokens

    @property
    def records_per_group(self) -> float:
        return self.group_size * self.decisions_per_fork

    @property
    def phases_per_group(self) -> float:
        """Fork-phases a rollout worker steps per group (the warm-up once, then every fork)."""
        return (self.warmup_phases + self.group_size * self.phases_per_fork) / self.groups_per_match

    @property
    def requests_per_group(self) -> float:
        return self.llm_seats * self.phases_per_group


@dataclass
class PlanConfig:
    """`conf/plan.yaml`: the run's own model, inference and learner groups plus a cluster and a workload."""

    model: Any = None
    inference: Any = None
    learner: Any = None
    cluster: Any = None
    workload: Any = None
    league: Any = None  # its `roles` are the trained policies (None: one policy)

    @property
    def policies(self) -> tuple[str, ...]:
        """The trained policies, one LoRA adapter each."""
        return tuple(self.league.roles) if self.league is not None else ("main",)

    @property
    def learners(self) -> int:
        """Learner processes: one per policy, or one host per `learner.adapters_per_actor` policies."""
        return math.ceil(len(self.policies) / self.learner.adapters_per_actor)

    @property
    def adapters_per_learner(self) -> int:
        """Adapters the fullest learner holds (and steps one after the other)."""
        return min(self.learner.adapters_per_actor, len(self.policies))


# ------------------------------------------------------------------------------------------ memory
@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    note: str = ""
    adapters: int = 0  # > 0: `bytes` are this many adapters' (one term per adapter a learner host holds)

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Memory:
    """The terms on one GPU, fixed ones first, and what the GPU offers them."""

    terms: tuple[Term, ...]
    capacity: float  # bytes

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def overflow(self) -> Term | None:
        """The term at which the running sum first exceeds the capacity (None when everything fits)."""
        running = 0.0
        for term in self.terms:
            running += term.bytes
            if running > self.capacity:
                return term
        return None

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    @property
    def once(self) -> float:
        """Bytes that do not grow with the adapters held (base, runtime, one step's transients)."""
        return sum(t.bytes for t in self.terms if not t.adapters)

    @property
    def per_adapter(self) -> float:
        """Bytes each further adapter adds."""
        return sum(t.bytes / t.adapters for t in self.terms if t.adapters)

    def adapters_fit(self) -> int:
        """The most adapters that fit beside what counts once (0 when not even one does)."""
        if self.per_adapter <= 0:
            return 0
        return max(0, math.floor((self.capacity - self.once) / self.per_adapter))


def layer_activation_elements(shape: ModelShape, lora_rank: int, lora_modules: int) -> int:
    """Elements per token that one decoder layer keeps for its backward pass, plus the backward's own
    largest transients (bf16 elements; fp32 tensors count twice).

    Counted tensor by tensor for HF's Qwen3 layer under autograd with frozen base weights (a frozen
    linear keeps only its input's gradient path, so it saves nothing of its own):
    - two RMSNorms upcast their input to fp32 and keep it (2 x 2h), and their bf16 outputs feed the
      LoRA A matrices, which keep them (2h);
    - q_norm and k_norm keep their fp32 inputs (2q + 2kv); attention keeps q, k, v after RoPE
      (q + 2kv) and its output (q), and o_proj's LoRA keeps a contiguous copy of it (q);
    - the MLP keeps gate, up, SiLU(gate) and their product (4I);
    - every LoRA keeps its rank-wide A output (r per module); attention's log-sum-exp is fp32 per head;
    - the backward then holds the gradients of gate and up (2I) and of the layer's input and output (2h).
    Memory-efficient attention is assumed (no sequence-squared scores: HF picks SDPA on CUDA).
    """
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    saved = 4 * h + 2 * h + (2 * q + 2 * kv) + (q + 2 * kv) + q + q + 4 * i + lora_rank * lora_modules + 2 * shape.heads
    backward = 2 * i + 2 * h
    return saved + backward


def learner_memory(
    shape: ModelShape,
    lora_rank: int,
    lora_modules: Sequence[str],
    learner: Any,
    workload: Workload,
    cluster: ClusterConfig,
    adapters: int = 1,
) -> Memory:
    """Peak memory of one learner rank (bf16 weights with fp32 optimiser state, the way DeepSpeed runs it)
    holding `adapters` LoRA adapters on one base (a learner host, `diprl.learn.host`).

    Between its steps an adapter's DeepSpeed engine keeps its LoRA weights and its fp32 master and Adam
    moments. Its fp32 gradient partition and contiguous gradient bucket live only inside its step
    (DeepSpeed 0.19 `stage_1_and_2.py`: `setup_buckets` allocates the bucket at the step's first backward,
    `_release_ipg_buffers` frees it and the gradient partition after the reduction, `step` drops the
    averaged gradients); the host steps one adapter at a time, so those, like the activations, count once.
    """
    if adapters < 1:
        raise PlanError(f"a learner holds at least one adapter, got {adapters}")
    n, stage = learner.ranks, learner.zero_stage
    wbytes = BF16 if learner.bf16 else FP32
    base = shape.total_params
    lora = shape.lora_params(lora_rank, lora_modules)
    state_split = n if stage >= 1 else 1
    grad_split = n if stage >= 2 else 1
    param_split = n if stage >= 3 else 1
    t = learner.micro_batch_tokens
    completion_share = workload.completion_tokens / workload.tokens_per_record
    head_rows = min(learner.logprob_chunk_tokens, math.ceil(t * completion_share))
    if learner.gradient_checkpointing:
        checkpoints = shape.layers * t * shape.hidden * wbytes
        layer = layer_activation_elements(shape, lora_rank, len(lora_modules)) * t * wbytes
        act_note = f"{t} tokens: {shape.layers} layer inputs kept, one layer recomputed"
    else:
        checkpoints = 0.0
        layer = layer_activation_elements(shape, lora_rank, len(lora_modules)) * t * wbytes * shape.layers
        act_note = f"{t} tokens: every layer's activations kept (no gradient checkpointing)"
    terms = [
        Term("runtime_reserve", cluster.runtime_reserve_gib * GIB, "CUDA context, NCCL (stated)"),
        Term("base_weights", base * wbytes / param_split, f"{base / 1e9:.2f}B parameters" + _split(param_split)),
        Term(
            "lora_weights",
            adapters * lora * wbytes / param_split,
            f"{lora / 1e6:.1f}M trainable" + _split(param_split) + _times(adapters),
            adapters,
        ),
        Term(
            "lora_grads",
            lora * FP32 / grad_split,
            "fp32 gradient partition" + _split(grad_split) + _one_step(adapters),
        ),
        Term(
            "optimizer",
            adapters * lora * 3 * FP32 / state_split,
            "fp32 master + Adam m, v" + _split(state_split) + _times(adapters),
            adapters,
        ),
        Term(
            "grad_bucket",
            0.0 if stage == 0 else DS_REDUCE_BUCKET_ELEMENTS * (FP32 if stage == 1 else wbytes),
            "DeepSpeed's contiguous gradient buffer (reduce_bucket_size)" + _one_step(adapters),
        ),
    ]
    if stage >= 3:
        # The tied LM head is gathered for the whole forward and backward (the learner registers it with
        # the module it wraps), while each layer is gathered in turn and the next ones prefetched.
        gathered = shape.embedding_params + shape.layer_params + DS_PREFETCH_BUCKET_ELEMENTS
        terms.append(
            Term("zero3_gathered", gathered * wbytes, "the LM head, one layer and the prefetch bucket, gathered")
        )
    terms += [
        Term("checkpoints", checkpoints, act_note),
        Term("layer_recompute", layer, "saved tensors and backward transients of one layer"),
        Term("lm_head", head_rows * shape.vocab * (wbytes + FP32 + FP32), f"{head_rows} completion positions x vocab"),
    ]
    return Memory(tuple(terms), cluster.gpu_memory_gib * GIB)


def _split(ways: int) -> str:
    return f", / {ways} ranks" if ways > 1 else ""


def _times(adapters: int) -> str:
    return f", x {adapters} adapters" if adapters > 1 else ""


def _one_step(adapters: int) -> str:
    return ", one adapter's step at a time" if adapters > 1 else ""


def request_context(workload: Workload) -> int:
    """Tokens of KV cache one request holds at its end, in whole vLLM blocks."""
    return math.ceil(workload.tokens_per_record / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS


def replica_memory(
    shape: ModelShape, inference: Any, workload: Workload, cluster: ClusterConfig, per_gpu: int = 1
) -> Memory:
    """One GPU of a replica (its 1/TP shard); `per_gpu` replicas share the GPU when replica_gpus < 1.

    The capacity is the part vLLM may claim (`gpu_memory_utilization`, less the runtime reserve).
    """
    tp = inference.tensor_parallel_size
    extra = inference.engine_extra or {}
    utilisation = float(extra.get("gpu_memory_utilization", VLLM_GPU_MEMORY_UTILIZATION))
    batched = int(extra.get("max_num_batched_tokens", VLLM_MAX_NUM_BATCHED_TOKENS))
    kv_per_token = 2 * shape.layers * math.ceil(shape.kv_heads / tp) * shape.head_dim * BF16
    context = request_context(workload)
    slot = shape.lora_params(inference.max_lora_rank, list(shape.linear_dims())) * BF16
    activations = batched * (3 * shape.intermediate + 2 * shape.q_dim + 2 * shape.kv_dim + 2 * shape.hidden) * BF16
    logits = inference.max_num_seqs * shape.vocab * FP32 * 2
    terms = [
        Term(
            "weights", per_gpu * shape.total_params * BF16 / tp, f"{shape.total_params / 1e9:.2f}B parameters / TP {tp}"
        ),
        Term(
            "lora_slots",
            per_gpu * inference.max_loras * slot / tp,
            f"{inference.max_loras} slots at rank {inference.max_lora_rank}",
        ),
        Term(
            "activations",
            per_gpu * (activations / tp + logits),
            f"{batched} batched tokens through a layer; fp32 logits and noise, {inference.max_num_seqs} rows",
        ),
        Term(
            "kv_cache",
            per_gpu * inference.max_num_seqs * context * kv_per_token,
            f"{inference.max_num_seqs} sequences x {context} tokens",
        ),
    ]
    capacity = utilisation * cluster.gpu_memory_gib * GIB - cluster.runtime_reserve_gib * GIB
    return Memory(tuple(terms), capacity)


# ------------------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class Placement:
    """Which GPUs hold learner ranks and which hold replicas (never the same GPU)."""

    learner: tuple[tuple[int, int], ...]  # (node, gpu) per rank, learner after learner
    replicas: tuple[tuple[tuple[int, int], ...], ...]  # the GPUs of each replica
    replicas_per_gpu: int
    problem: str | None = None
    learners: int = 1  # learner processes (or groups of ranks), each `len(learner) / learners` GPUs

    def learner_groups(self) -> list[tuple[tuple[int, int], ...]]:
        """The GPUs of each learner."""
        ranks = len(self.learner) // max(1, self.learners)
        return [self.learner[i : i + ranks] for i in range(0, len(self.learner), max(1, ranks))]

    @property
    def learner_nodes(self) -> int:
        """Nodes the widest learner spans (its gradient exchange crosses nodes when above 1)."""
        return max((len({node for node, _ in g}) for g in self.learner_groups()), default=0)


def place(
    cluster: ClusterConfig, ranks: int, tp: int, replica_gpus: float, low: int, high: int, learners: int = 1
) -> Placement:
    """`learners` learners of `ranks` GPUs first, packed from node 0; replicas then fill what is left, TP GPUs
    of one node each.

    Replicas scale up to `high` (autoscaling's max_replicas or num_replicas) and must reach `low`.
    """
    per_gpu = 1 if tp > 1 or replica_gpus >= 1 else int(1 / replica_gpus)
    free: list[list[int]] = [list(range(cluster.gpus_per_node)) for _ in range(cluster.nodes)]
    total = learners * ranks
    if total > cluster.gpus:
        of = f" ({learners} learners of {ranks})" if learners > 1 else ""
        return Placement(
            (), (), per_gpu, f"{total} learner ranks{of} need {total} GPUs; the cluster has {cluster.gpus}", learners
        )
    learner: list[tuple[int, int]] = []
    for _ in range(learners):
        # each learner on the first node with room for all its ranks (its exchange stays on NVLink), else
        # packed over the nodes in order
        whole = [node for node, gpus in enumerate(free) if len(gpus) >= ranks]
        nodes = whole[:1] or range(cluster.nodes)
        mine: list[tuple[int, int]] = []
        for node in nodes:
            while free[node] and len(mine) < ranks:
                mine.append((node, free[node].pop(0)))
        learner += mine
    width = max(1, math.ceil(replica_gpus)) if tp == 1 else tp
    replicas: list[tuple[tuple[int, int], ...]] = []
    for node, gpus in enumerate(free):
        while len(gpus) >= width:
            chunk = tuple((node, gpus.pop(0)) for _ in range(width))
            replicas.extend([chunk] * per_gpu)
    replicas = replicas[:high]
    problem = None
    if len(replicas) < low:
        problem = (
            f"{low} replicas of {width} GPU(s) need {math.ceil(low / per_gpu) * width} GPUs on nodes of "
            f"{cluster.gpus_per_node} beside {total} learner rank(s); room for {len(replicas)}"
        )
    return Placement(tuple(learner), tuple(replicas), per_gpu, problem, learners)


def gpu_list(gpus: Sequence[tuple[int, int]]) -> str:
    """`node0:0-3,node1:0-1`: GPUs grouped by node, consecutive ones as a range ("-" for none)."""
    by_node: dict[int, list[int]] = {}
    for node, gpu in sorted(set(gpus)):
        by_node.setdefault(node, []).append(gpu)
    parts = []
    for node, ids in by_node.items():
        runs: list[list[int]] = []
        for gpu in ids:
            if runs and gpu == runs[-1][-1] + 1:
                runs[-1].append(gpu)
            else:
                runs.append([gpu])
        text = ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
        parts.append(f"node{node}:{text}")
    return ",".join(parts) or "-"


# ------------------------------------------------------------------------------------------ time
@dataclass(frozen=True)
class LearnerTime:
    tokens_per_rank: float
    compute_s: float
    optimizer_s: float
    exchange_s: float
    storage_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exchange_s + self.storage_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_rank / self.step_s


def learner_time(
    shape: ModelShape, lora: int, learner: Any, workload: Workload, cluster: ClusterConfig, nodes: int
) -> LearnerTime:
    """Seconds of one learner step on each rank.

    Compute: a step's tokens split evenly over the ranks, at 6 x parameters x tokens FLOPs for forward
    and backward (the counting of the measured utilisation, whose run used gradient checkpointing, so
    its recompute is inside the rate) plus 2 x parameters x tokens for the old-policy logprobs of stale
    records and again for the KL reference. Optimiser: Adam reads and writes the rank's partition
    (fp32 gradient, master, m and v, bf16 weight out) at HBM speed. Exchange: ZeRO reduce-scatters
    the bf16 gradients and all-gathers the weights (a ring moves 2 (N-1)/N of each); ZeRO-3 also gathers
    the base weights for the forward, the recompute and the backward of every micro-batch. Storage: the
    published adapter every `publish_every` steps and a checkpoint (adapter, fp32 master, m, v and the
    EMA reference) every `checkpoint_every`.
    """
    n = learner.ranks
    tokens = learner.groups_per_step * workload.records_per_group * workload.tokens_per_record
    per_rank = tokens / n
    passes = 6 + 2 * workload.stale_share + (2 if learner.kl_coef > 0 else 0)
    compute = passes * shape.total_params * per_rank / (cluster.bf16_flops * cluster.train_utilisation)
    split = n if learner.zero_stage >= 1 else 1
    optimizer = lora / split * (FP32 * 2 + FP32 * 4 + BF16) / cluster.hbm_bytes_per_s
    link = cluster.intra_node_bytes_per_s if nodes <= 1 else cluster.inter_node_bytes_per_s
    ring = 2 * (n - 1) / n
    exchange = 2 * lora * BF16 * ring / link if n > 1 else 0.0
    if learner.zero_stage >= 3 and n > 1:
        micro_batches = math.ceil(per_rank / learner.micro_batch_tokens)
        exchange += 3 * micro_batches * shape.total_params * BF16 * (n - 1) / n / link
    adapter = lora * BF16
    checkpoint = adapter + lora * FP32 * 4
    storage = adapter / learner.publish_every / cluster.storage_bytes_per_s
    if learner.checkpoint_every > 0:
        storage += checkpoint / learner.checkpoint_every / cluster.storage_bytes_per_s
    return LearnerTime(per_rank, compute, optimizer, exchange, storage)


@dataclass(frozen=True)
class ReplicaRate:
    """One replica's decode step at a full batch, and what a request costs it."""

    batch: int
    memory_s: float
    compute_s: float
    allreduce_s: float
    constraint_s: float
    prefill_s_per_request: float

    @property
    def decode_step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.allreduce_s + self.constraint_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode_step_s

    @property
    def bound(self) -> str:
        return "hbm" if self.memory_s >= self.compute_s else "compute"


def replica_rate(shape: ModelShape, inference: Any, workload: Workload, cluster: ClusterConfig) -> ReplicaRate:
    """Decode at `max_num_seqs` requests in flight (rollout workers keep batches full: contract 8).

    A decode step reads the replica's weight shard, the active LoRA slots and every request's KV cache
    (at the mean context mid-completion) from HBM, or is bound by 2 x parameters FLOPs per token,
    whichever is slower; tensor parallelism adds two all-reduces of the batch's hidden states per layer
    over NVLink, and the order constraint's CPU time per request runs in the engine's step. Prefill
    computes the unshared part of each prompt, and the shared part (rules, board) once per phase.
    """
    tp, batch = inference.tensor_parallel_size, inference.max_num_seqs
    weights = shape.total_params * BF16 / tp
    slots = inference.max_loras * shape.lora_params(inference.max_lora_rank, list(shape.linear_dims())) * BF16 / tp
    context = workload.prompt_tokens + workload.completion_tokens / 2
    kv = batch * context * shape.kv_bytes_per_token() / tp
    memory = (weights + slots + kv) / (cluster.hbm_bytes_per_s * cluster.decode_hbm_utilisation)
    rate = cluster.bf16_flops * cluster.train_utilisation
    compute = 2 * shape.total_params / tp * batch / rate
    allreduce = 0.0
    if tp > 1:
        allreduce = 2 * shape.layers * batch * shape.hidden * BF16 * 2 * (tp - 1) / tp / cluster.intra_node_bytes_per_s
    constraint = batch * workload.constraint_s_per_request_step
    s = workload.shared_prompt_share
    prefill_tokens = workload.prompt_tokens * ((1 - s) + s / workload.llm_seats)
    prefill = 2 * shape.total_params * prefill_tokens / (tp * rate)
    return ReplicaRate(batch, memory, compute, allreduce, constraint, prefill)


# ------------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    shape: ModelShape
    learner_mem: Memory
    replica_mem: Memory
    placement: Placement
    learner: LearnerTime
    replica: ReplicaRate
    inference_s: float
    rollout_s: float
    refusals: tuple[str, ...]
    notes: tuple[str, ...]
    per_policy: Placement | None = None  # one learner per policy, when hosts hold several (for comparison)

    @property
    def fits(self) -> bool:
        return not self.refusals

    @property
    def learner_round_s(self) -> float:
        """One step of every policy a learner holds: a host steps its adapters one after the other."""
        return self.learner.step_s * self.config.adapters_per_learner

    @property
    def step_s(self) -> float:
        return max(self.learner_round_s, self.inference_s, self.rollout_s)

    @property
    def limiting(self) -> str:
        parts = {"learner": self.learner_round_s, "inference": self.inference_s, "rollout": self.rollout_s}
        return max(parts, key=lambda k: parts[k])

    @property
    def freed(self) -> tuple[tuple[int, int], ...]:
        """GPUs one learner per policy would take that the hosts leave to replicas."""
        if self.per_policy is None:
            return ()
        return tuple(sorted(set(self.per_policy.learner) - set(self.placement.learner)))


def _overflow_message(role: str, memory: Memory, knob: str) -> str:
    term = memory.overflow()
    assert term is not None
    before = sum(t.bytes for t in memory.terms[: memory.terms.index(term)])
    return (
        f"{role} GPU needs {memory.total / GIB:.2f} GiB of {memory.capacity / GIB:.2f}: {term.name} "
        f"({term.gib:.2f} GiB, {term.note}) overflows what the terms before it leave "
        f"({(memory.capacity - before) / GIB:.2f} GiB); {knob}"
    )


def make_plan(config: PlanConfig) -> Plan:
    """The whole plan of a typed configuration (pure: no I/O beyond a local checkpoint's config.json)."""
    model, inference, learner, cluster, workload = (
        config.model,
        config.inference,
        config.learner,
        config.cluster,
        config.workload,
    )
    problems = []
    if not learner.use_gpu:
        problems.append("learner.use_gpu is false: the learner would run on CPU (use learner=cluster)")
    if inference.replica_gpus <= 0:
        problems.append("inference.replica_gpus is 0: the replicas would run on CPU (use inference=cluster)")
    tokenizer = model.tiny.tokenizer if model.tiny is not None else "qwen3"
    if str(tokenizer) != workload.tokenizer:
        problems.append(
            f"the workload's token counts were measured with the {workload.tokenizer!r} tokenizer, model "
            f"{model.name!r} uses {str(tokenizer)!r}: pick a workload of its tokenizer"
        )
    if problems:
        raise PlanError("; ".join(problems))
    shape = model_shape(model)
    tp = inference.tensor_parallel_size
    refusals = []
    notes: list[str] = []
    if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
        refusals.append(
            f"inference.tensor_parallel_size {tp} does not divide {shape.heads} attention heads / "
            f"{shape.kv_heads} KV heads"
        )
    auto = inference.autoscaling or {}
    high = int(auto.get("max_replicas", inference.num_replicas)) if auto else inference.num_replicas
    low = int(auto.get("min_replicas", 1)) if auto else inference.num_replicas
    policies = len(config.policies)
    placement = place(cluster, learner.ranks, tp, inference.replica_gpus, low, high, config.learners)
    if placement.problem:
        refusals.append("placement: " + placement.problem)
    per_policy = None
    if config.learners < policies:
        per_policy = place(cluster, learner.ranks, tp, inference.replica_gpus, low, high, policies)
    if learner.adapters_per_actor > policies:
        notes.append(
            f"learner.adapters_per_actor {learner.adapters_per_actor} exceeds the {policies} trained "
            f"polic{'y' if policies == 1 else 'ies'}: the learner holds {policies}"
        )
    lmem = learner_memory(
        shape, model.lora.rank, model.lora.target_modules, learner, workload, cluster, config.adapters_per_learner
    )
    if lmem.overflow():
        knob = "lower learner.micro_batch_tokens, or add ranks with zero_stage 3"
        if config.adapters_per_learner > 1:
            knob = (
                f"{lmem.adapters_fit()} adapter(s) fit beside the base: lower learner.adapters_per_actor or "
                "learner.micro_batch_tokens"
            )
        refusals.append(_overflow_message("learner", lmem, knob))
    rmem = replica_memory(shape, inference, workload, cluster, placement.replicas_per_gpu)
    if rmem.overflow():
        refusals.append(
            _overflow_message(
                "replica", rmem, "lower inference.max_num_seqs or max_loras, or raise inference.tensor_parallel_size"
            )
        )
    kv_room = rmem.capacity - sum(t.bytes for t in rmem.terms if t.name != "kv_cache")
    one_sequence = inference.max_model_len * 2 * shape.layers * math.ceil(shape.kv_heads / tp) * shape.head_dim * BF16
    if one_sequence > kv_room:
        refusals.append(
            f"replica: one sequence of max_model_len {inference.max_model_len} needs {one_sequence / GIB:.2f} GiB "
            f"of KV cache, {max(kv_room, 0) / GIB:.2f} GiB are left (vLLM refuses to start)"
        )
    lora = shape.lora_params(model.lora.rank, model.lora.target_modules)
    ltime = learner_time(shape, lora, learner, workload, cluster, max(1, placement.learner_nodes))
    rrate = replica_rate(shape, inference, workload, cluster)
    # A step of every trained policy: each asks for its own groups of the replicas and the rollout CPUs.
    groups = policies * learner.groups_per_step
    requests = groups * workload.requests_per_group
    replicas = max(1, len(placement.replicas))
    inference_s = requests * (workload.completion_tokens / rrate.tokens_per_s + rrate.prefill_s_per_request) / replicas
    rollout_s = groups * workload.phases_per_group * workload.rollout_s_per_phase
    rollout_s /= workload.rollout_workers
    if workload.rollout_workers > cluster.nodes * cluster.cpus_per_node:
        notes.append(f"workload.rollout_workers {workload.rollout_workers} exceed the cluster's CPUs")
    return Plan(
        config,
        shape,
        lmem,
        rmem,
        placement,
        ltime,
        rrate,
        inference_s,
        rollout_s,
        tuple(refusals),
        tuple(notes),
        per_policy,
    )


def _g(value: float) -> str:
    return f"{value / GIB:.2f}"


def render(plan: Plan) -> list[str]:
    """The report: explanation lines (`#`), one `key=value` line per GPU role, and the verdict last."""
    c, w, s = plan.config.cluster, plan.config.workload, plan.shape
    learner, inference = plan.config.learner, plan.config.inference
    lines = [
        f"# model={plan.config.model.name} ({s.total_params / 1e9:.2f}B parameters, {s.layers} layers, hidden "
        f"{s.hidden}) cluster={c.name}: {c.nodes} node(s) x {c.gpus_per_node} {c.gpu_name} ({c.gpu_memory_gib} GiB), "
        f"{c.interconnect}",
    ]
    for name in sourced_fields(ClusterConfig):
        lines.append(f"#   cluster.{name}={getattr(c, name):g}  ({c.sources[name]})")
    for name in sourced_fields(Workload):
        lines.append(f"#   workload.{name}={getattr(w, name):g}  ({w.sources[name]})")
    lines.append(
        f"# step: {learner.groups_per_step} groups x {w.records_per_group:g} records x {w.tokens_per_record:g} tokens "
        f"= {learner.groups_per_step * w.records_per_group * w.tokens_per_record:,.0f} learner tokens; "
        f"{learner.groups_per_step * w.requests_per_group:,.0f} LLM requests of {w.completion_tokens:g} tokens"
    )
    p, policies, held = plan.placement, plan.config.policies, plan.config.adapters_per_learner
    if len(policies) > 1:
        lines.append(
            f"# league: {len(policies)} trained policies ({', '.join(policies)}), each step above per policy; "
            f"learner.adapters_per_actor={learner.adapters_per_actor}: {plan.config.learners} learner(s) of "
            f"{learner.ranks} rank(s), up to {held} adapter(s) on one base each"
        )
    for role, memory in (("learner rank", plan.learner_mem), ("replica GPU", plan.replica_mem)):
        terms = ", ".join(f"{t.name} {t.gib:.2f} ({t.note})" for t in memory.terms)
        lines.append(f"# {role} GiB: {terms}; total {_g(memory.total)} of {_g(memory.capacity)}")
    lm = plan.learner_mem
    lines.append(
        f"# adapters beside the base on one learner GPU: {lm.adapters_fit()} (once: {_g(lm.once)} GiB of base, "
        f"runtime and one adapter's step; each adapter {_g(lm.per_adapter)} GiB of LoRA weights, fp32 master and "
        f"Adam moments; capacity {_g(lm.capacity)})"
    )
    if plan.per_policy is not None:
        lines.append(
            f"# the {len(policies)}-policy league's learners take GPU(s) {gpu_list(p.learner)} where one learner per "
            f"policy would take {gpu_list(plan.per_policy.learner)}; freed for replicas: "
            + ", ".join(gpu_list([g]) for g in plan.freed)
            + f" (replicas {len(plan.per_policy.replicas)} -> {len(p.replicas)})"
        )
    lt, rr = plan.learner, plan.replica
    lines.append(
        f"# learner step s: compute {lt.compute_s:.2f}, optimizer {lt.optimizer_s:.3f}, exchange {lt.exchange_s:.3f}, "
        f"storage {lt.storage_s:.2f}"
        + (f"; {held} adapters stepped in turn: {plan.learner_round_s:.2f} s a round" if held > 1 else "")
    )
    lines.append(
        f"# replica decode step ms at batch {rr.batch}: hbm {rr.memory_s * 1e3:.1f}, compute {rr.compute_s * 1e3:.1f}, "
        f"tp all-reduce {rr.allreduce_s * 1e3:.1f}, constraint {rr.constraint_s * 1e3:.1f}; prefill "
        f"{rr.prefill_s_per_request * 1e3:.1f} ms per request"
    )
    lines += [f"# note: {n}" for n in plan.notes]
    lines += [f"# refused: {r}" for r in plan.refusals]
    freed = f" freed_gpus={gpu_list(plan.freed)}" if plan.per_policy is not None else ""
    lines.append(
        f"role=learner policies={len(policies)} adapters_per_actor={learner.adapters_per_actor} "
        f"learners={plan.config.learners} ranks={learner.ranks} gpus={gpu_list(p.learner)}{freed} "
        f"zero_stage={learner.zero_stage} micro_batch_tokens={learner.micro_batch_tokens} "
        f"learner_gpu_gib={_g(lm.total)} capacity_gib={_g(lm.capacity)} adapters_fit={lm.adapters_fit()} "
        f"learner_tokens_per_s={lt.tokens_per_s:.0f} learner_step_s={lt.step_s:.2f} "
        f"learner_round_s={plan.learner_round_s:.2f}"
    )
    lines.append(
        f"role=replica replicas={len(p.replicas)} tensor_parallel_size={inference.tensor_parallel_size} "
        f"gpus={gpu_list([g for r in p.replicas for g in r])} max_num_seqs={inference.max_num_seqs} "
        f"replica_gpu_gib={_g(plan.replica_mem.total)} capacity_gib={_g(plan.replica_mem.capacity)} "
        f"decode_tokens_per_s={rr.tokens_per_s:.0f} bound={rr.bound} inference_step_s={plan.inference_s:.2f}"
    )
    lines.append(f"role=rollout workers={w.rollout_workers} rollout_step_s={plan.rollout_s:.2f}")
    lines.append(f"fits={int(plan.fits)} limiting={plan.limiting} step_s={plan.step_s:.2f}")
    return lines


# ------------------------------------------------------------------------------------------ composing
def register_configs() -> None:
    """The schemas behind `conf/plan.yaml` and the `cluster` and `workload` groups."""
    from hydra.core.config_store import ConfigStore

    from diprl.inference.config import register_configs as register_inference
    from diprl.league.config import register_configs as register_league
    from diprl.learn.config import register_configs as register_learner
    from diprl.policy.models import register_configs as register_models

    store = ConfigStore.instance()
    store.store(name="base_plan", node=PlanConfig)
    store.store(group="cluster", name="base_cluster", node=ClusterConfig)
    store.store(group="workload", name="base_workload", node=Workload)
    register_league()
    register_models()
    register_inference()
    register_learner()


def typed_plan_config(cfg: Any) -> PlanConfig:
    """Every section of a composed plan as its typed config (a bad value names its section)."""
    from omegaconf import OmegaConf

    from diprl.inference.config import ServerConfig
    from diprl.league.config import LeagueConfig
    from diprl.learn.config import LearnerConfig
    from diprl.policy.models import preset_from_config

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    sections: dict[str, Any] = {}
    for name, schema in (
        ("inference", ServerConfig),
        ("learner", LearnerConfig),
        ("cluster", ClusterConfig),
        ("workload", Workload),
        ("league", LeagueConfig),
    ):
        body = dict(raw.get(name) or {})
        body.pop("defaults", None)
        try:
            sections[name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), body))
        except Exception as exc:  # OmegaConf validation or a dataclass __post_init__
            raise PlanError(f"{name}: {exc}") from exc
    try:
        model = preset_from_config(raw["model"])
    except ValueError as exc:
        raise PlanError(f"model: {exc}") from exc
    inference, learner = sections["inference"], sections["learner"]
    inference.model = learner.model = model.name  # as a run does: the model section decides
    return PlanConfig(
        model=model,
        inference=inference,
        learner=learner,
        cluster=sections["cluster"],
        workload=sections["workload"],
        league=sections["league"],
    )


def compose_plan(overrides: Sequence[str]) -> PlanConfig:
    """`conf/plan.yaml` with Hydra overrides (`model=qwen3_14b cluster=h100x8 learner.ranks=2`,
    `league=league learner.adapters_per_actor=3`)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="plan", overrides=list(overrides))
    return typed_plan_config(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; exit 0 when it fits, 1 when it does not (each refusal says which term), 2 on a bad config."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("clusters:", ", ".join(sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))))
        return 0
    try:
        plan = make_plan(compose_plan(args))
    except (HydraException, OmegaConfBaseException, PlanError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(render(plan)))
    for refusal in plan.refusals:
        print(f"does not fit: {refusal}", file=sys.stderr)
    return 0 if plan.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
