"""The trained model: base preset + PEFT LoRA, wrapped by DeepSpeed, and how it scores completions.

Only the positions that predict completion tokens reach the LM head, a chunk at a time, and only
the logits of the tokens the constraint allows are kept: with Qwen's 152k-wide vocabulary the full
logits of every prompt position would cost more memory than the whole tiny model, while the masked
distribution (everything else is -inf) is fully described by the allowed entries. The result equals
the dense masked, tempered log-softmax over the whole vocabulary (`tests/dense_logprobs.py`, tested) and
vLLM's processed logprobs (tested against a running engine).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diprl.adapter_files import WEIGHTS_FILE
from diprl.learn.batching import choice_positions
from diprl.learn.config import LearnerConfig, shared_base_refusal
from diprl.learn.partitions import whole
from diprl.learn.prefix import PrefixLayout
from diprl.learn.prefix_attention import IMPLEMENTATION, use_prefix_attention
from diprl.learn.ranks import RankSpec, rendezvous_store
from diprl.policy.logprobs import allowed_mask
from diprl.policy.models import ModelPreset, resolve_model_path
from diprl.ports import free_port

DENSE_THRESHOLD = 4096
"""Above this many allowed ids at some position of a chunk (free reasoning), mask the dense logits instead."""


def base_model_name(preset: ModelPreset) -> str:
    """What published adapters record as their base model (the directory or hub id vLLM loads)."""
    return str(resolve_model_path(preset))


def load_base(preset: ModelPreset, config: LearnerConfig) -> Any:
    """The preset's base model (the weights LoRA adapts, frozen once wrapped), in the learner's precision."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if config.bf16 else torch.float32
    with _partitioned_loading(config):
        base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(preset)), dtype=dtype)
    base.config.use_cache = False
    return base


def sharing_copy(base: nn.Module) -> Any:
    """A module tree of its own over the same weight tensors as `base` (parameters and buffers shared).

    PEFT wraps a base model in place, so every adapter needs a tree of its own; sharing the tensors keeps
    one copy of the base weights in memory for all of them (`diprl.learn.host`). The base is frozen under
    every adapter, and a device or dtype move changes the shared tensors of all trees at once.
    """
    shared: dict[int, Any] = {id(t): t for t in (*base.parameters(), *base.buffers())}
    return copy.deepcopy(base, shared)


def build_peft_model(
    preset: ModelPreset, config: LearnerConfig, adapter_dir: Path | None = None, base: nn.Module | None = None
) -> Any:
    """The preset's base model with a LoRA adapter of the preset's shape (fresh, or `adapter_dir`'s weights).

    A fresh adapter is PEFT's default initialisation (B = 0), seeded by `config.seed`, so it computes
    exactly the base model: the first published version plays like `base`. With `prefix_sharing` the
    model's attention also takes packed prefix trees (`diprl.learn.prefix_attention`). `base` (from
    `load_base`): the adapter goes on a `sharing_copy` of it instead of a base loaded for it alone.
    """
    from peft import LoraConfig, get_peft_model

    unshareable = shared_base_refusal(config)
    if base is not None and unshareable is not None:
        raise ValueError(f"a shared base {unshareable}: grouped and ZeRO-3 learners load their own (one adapter each)")
    base_model = sharing_copy(base) if base is not None else load_base(preset, config)
    lora = LoraConfig(
        r=preset.lora.rank,
        lora_alpha=preset.lora.alpha,
        lora_dropout=preset.lora.dropout,
        target_modules=list(preset.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = get_peft_model(base_model, lora)
    if adapter_dir is not None:
        load_lora_state_(model, read_adapter_dir(adapter_dir, model))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.prefix_sharing:
        use_prefix_attention(model.get_base_model())
    return model


@contextlib.contextmanager
def _partitioned_loading(config: LearnerConfig) -> Iterator[None]:
    """At ZeRO-3, transformers loads the base weights straight into each rank's partition (`zero.Init`).

    So no rank ever holds the whole base model: what ZeRO-3 is for when it does not fit one GPU. It needs
    the learner's process group first (`init_distributed`); other stages load as usual.
    """
    if config.zero_stage != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    if not torch.distributed.is_initialized():
        raise RuntimeError("a ZeRO-3 model is built after init_distributed (its weights are loaded partitioned)")
    keep_alive = HfDeepSpeedConfig(deepspeed_config(config))  # transformers reads it through a weak reference
    try:
        yield
    finally:
        del keep_alive


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable LoRA parameters by name (sorted: a stable order for EMA and checkpoints)."""
    return {n: p for n, p in sorted(model.named_parameters()) if p.requires_grad}


def whole_lora(model: nn.Module, modify: bool = False) -> contextlib.AbstractContextManager[None]:
    """The model's LoRA weights whole inside the block, also at ZeRO-3 (`partitions.whole`)."""
    return whole(list(lora_parameters(model).values()), modify)


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of the LoRA weights."""
    with whole_lora(model):
        return {n: p.detach().float().cpu().clone() for n, p in lora_parameters(model).items()}


@torch.no_grad()
def load_lora_state_(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model's LoRA weights in place (names and shapes must match exactly)."""
    params = lora_parameters(model)
    if set(params) != set(state):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"LoRA state does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with whole_lora(model, modify=True):
        for name, p in params.items():
            if p.shape != state[name].shape:
                raise ValueError(f"LoRA weight {name}: shape {tuple(state[name].shape)}, model has {tuple(p.shape)}")
            p.copy_(state[name].to(device=p.device, dtype=p.dtype))


def read_adapter_dir(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT `save_pretrained` directory's weights, renamed to this model's parameter names.

    PEFT saves `...q_proj.lora_A.weight` for the parameter `...q_proj.lora_A.default.weight`.
    A rank or module mismatch is an error naming the first offending weight.
    """
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} holds no {WEIGHTS_FILE} (save with safe_serialization=True)")
    saved = load_file(str(file))
    state: dict[str, torch.Tensor] = {}
    for name in lora_parameters(model):
        key = name.replace(".default", "")
        if key not in saved:
            raise ValueError(f"adapter {path} lacks {key}: it was trained for other modules or another base model")
        state[name] = saved[key].float()
    return state


class CompletionHidden(nn.Module):
    """The module DeepSpeed wraps: the PEFT model's backbone, returning only completion-predicting states.

    The LM head is applied outside (in chunks, see `completion_logprobs`); it is tied to the
    embeddings and frozen, so gradients reach the LoRA weights through these hidden states. A plain
    causal LM (no PEFT) is taken too: pretraining (`diprl.imitation.pretrain`) trains every weight,
    the head included, through the same scoring.
    """

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        self.peft_model = peft_model

    @property
    def causal_lm(self) -> Any:
        """The transformers model: the PEFT model's (LoRA layers injected), or the plain one given."""
        get_base = getattr(self.peft_model, "get_base_model", None)
        return get_base() if get_base is not None else self.peft_model

    @property
    def lm_head_weight(self) -> torch.Tensor:
        weight: torch.Tensor = self.causal_lm.get_output_embeddings().weight
        return weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rows: torch.Tensor,
        cols: torch.Tensor,
        prefix: PrefixLayout | None = None,
    ) -> torch.Tensor:
        """Padded rows (`attention_mask`), or one packed prefix tree (`prefix`: positions and attention blocks)."""
        backbone = self.causal_lm.model
        if prefix is None:
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            return hidden[rows, cols]
        if backbone.config._attn_implementation != IMPLEMENTATION:
            raise RuntimeError("a packed prefix tree needs a model built with prefix_sharing (its attention takes it)")
        # A mask mapping is used as given: every layer's attention receives the layout itself.
        masks = {"full_attention": prefix}
        hidden = backbone(
            input_ids=input_ids, attention_mask=masks, position_ids=prefix.position_ids, use_cache=False
        ).last_hidden_state
        return hidden[rows, cols]


class CompletionScorer(CompletionHidden):
    """The module DeepSpeed wraps: backbone and chunked LM head in one forward, returning (logp, entropy).

    The head's weight (the tied embedding, frozen) is used inside the wrapped forward and registered as
    one of its parameters for ZeRO-3, which partitions the frozen base too: ZeRO-3 then gathers the head
    for the forward and again for the backward, as it does the layers' own weights.
    """

    def __init__(self, peft_model: Any, chunk_tokens: int = 512) -> None:
        super().__init__(peft_model)
        self.chunk_tokens = chunk_tokens

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
        temperatures: torch.Tensor,
        allowed: Sequence[np.ndarray],
        prefix: PrefixLayout | None = None,
        with_entropy: bool = False,
        free: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = super().forward(input_ids, attention_mask, rows, cols, prefix)
        return completion_logprobs(
            hidden, self.lm_head_weight, targets, temperatures, allowed, self.chunk_tokens, with_entropy, free
        )


def _padded_allowed(allowed: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(a) for a in allowed)
    idx = np.zeros((len(allowed), width), dtype=np.int64)
    valid = np.zeros((len(allowed), width), dtype=bool)
    for i, a in enumerate(allowed):
        idx[i, : len(a)] = a
        valid[i, : len(a)] = True
    return idx, valid


def completion_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    allowed: Sequence[np.ndarray],
    chunk_tokens: int = 512,
    with_entropy: bool = False,
    free: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probability of each target, entropy per position or None) under softmax(mask(logits) / T).

    `hidden` [N, H] are the states predicting the N targets, `allowed` the constraint's allowed ids
    before each (`OrderConstraint.masks_for`), `temperatures` [N] the sampler's temperature per token.
    `free`: the positions with a choice (`choice_positions(allowed)`, which a micro-batch carries from its
    records); found here when not given.

    Two savings, both exact. A **forced** position (one allowed id) has log-probability 0 and entropy 0
    whatever the weights, so no gradient: it is left out of the head and filled with 0 (the loss still counts
    it in its token normalisation). At the other positions only the **allowed columns** of the head are
    computed: one chunk's states against the rows of the ids any of its positions allows, instead of the
    whole vocabulary (Qwen3's 151,936 rows, of which a chunk of order tokens allows a few thousand at most).
    The masked distribution is the same: its other entries are -inf, with no gradient either way.
    """
    n = hidden.shape[0]
    free = choice_positions(allowed) if free is None else free
    if len(free) == n:
        return _head_logprobs(hidden, lm_head_weight, targets, temperatures, allowed, chunk_tokens, with_entropy)
    # Score the free positions alone, then put them back among the forced zeros.
    zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if not len(free):
        return zeros, (zeros if with_entropy else None)
    index = torch.as_tensor(free, dtype=torch.long, device=hidden.device)
    logp, entropy = _head_logprobs(
        hidden.index_select(0, index),
        lm_head_weight,
        targets.index_select(0, index),
        temperatures.index_select(0, index),
        [allowed[i] for i in free],
        chunk_tokens,
        with_entropy,
    )
    return zeros.index_copy(0, index, logp), (None if entropy is None else zeros.index_copy(0, index, entropy))


def _head_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    allowed: Sequence[np.ndarray],
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs` at positions that all go through the head, chunk by chunk (allowed columns only)."""
    from diprl.learn.loss import masked_entropy

    n = hidden.shape[0]
    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        temp = temperatures[start:end].unsqueeze(-1)
        target = targets[start:end].unsqueeze(-1)
        chunk_allowed = allowed[start:end]
        if max(len(a) for a in chunk_allowed) <= DENSE_THRESHOLD:
            scaled, target_logit = _allowed_columns(hidden[start:end], lm_head_weight, target, chunk_allowed)
            scaled = scaled / temp
            logp = target_logit / temp.squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        else:
            logits = nn.functional.linear(hidden[start:end], lm_head_weight).float()
            mask = allowed_mask(chunk_allowed, logits.shape[-1], logits.device)
            scaled = logits.masked_fill(~mask, float("-inf")) / temp
            logp = torch.log_softmax(scaled, dim=-1).gather(1, target).squeeze(-1)
        logps.append(logp)
        if with_entropy:
            entropies.append(masked_entropy(scaled))
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


def _allowed_columns(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, allowed: Sequence[np.ndarray]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The allowed logits of a chunk, padded with -inf ([n, widest]), and each target's logit ([n]).

    Only the head rows of the ids some position allows are multiplied: the union is sorted, each position's
    allowed ids and its target are found in it. A target outside the union cannot be allowed: an error.
    """
    union = torch.from_numpy(np.unique(np.concatenate(allowed))).to(hidden.device)
    logits = nn.functional.linear(hidden, lm_head_weight.index_select(0, union)).float()  # [n, |union|]
    idx_np, valid_np = _padded_allowed(allowed)
    columns = torch.searchsorted(union, torch.from_numpy(idx_np).to(hidden.device))
    valid = torch.from_numpy(valid_np).to(hidden.device)
    scaled = logits.gather(1, columns.clamp(max=union.numel() - 1)).masked_fill(~valid, float("-inf"))
    target_columns = torch.searchsorted(union, target).clamp(max=union.numel() - 1)
    if not bool((union[target_columns] == target).all()):
        raise ValueError("a completion token is outside the ids its constraint allows")
    return scaled, logits.gather(1, target_columns).squeeze(-1)


def process_group_options(use_gpu: bool, local_rank: int) -> dict[str, Any]:
    """Backend of the learner's process group and, on GPUs, its device.

    NCCL is told its device: given none, it guesses one from the global rank ("Guessing device ID
    based on global rank"), which is wrong once ranks span nodes.
    """
    if not use_gpu:
        return {"backend": "gloo"}
    return {"backend": "nccl", "device_id": torch.device("cuda", local_rank)}


def init_distributed(use_gpu: bool, rank: RankSpec | None = None) -> None:
    """The torch.distributed group for DeepSpeed (gloo on CPU, NCCL on GPU), once per process.

    Without `rank`, a one-process group; with it, rank `rank.rank` of a learner group of
    `rank.world_size` processes that meet at `rank.init_method` (rank 0's `tcp://` address).
    On CPU nothing is compiled: DeepSpeed's shared-memory collective would build a C++ op on first
    use (about a minute), so it is switched off; gloo does the reductions. The group is created here
    (DeepSpeed's initialiser takes no device) and DeepSpeed adopts it.
    """
    import deepspeed

    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if not use_gpu:
        # gloo otherwise resolves this machine's host name (a DNS query) to pick its interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if rank is None:
        # The group has one rank and lives in this process. Its rendezvous is a file, not a TCP store: a
        # TCP store would need a port free HERE (a parent's inherited MASTER_PORT is still bound by that
        # parent) and torch's socket code asks DNS for the name of ::ffff:127.0.0.1 when it connects.
        rank = RankSpec(0, 1, (Path(tempfile.mkdtemp(prefix="diprl-learner-")) / "rendezvous").as_uri())
        os.environ["MASTER_PORT"] = str(free_port())
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    # Each rank is a Ray actor that sees only its own GPU: its local device is always 0.
    for key, value in (("RANK", rank.rank), ("LOCAL_RANK", 0), ("WORLD_SIZE", rank.world_size)):
        os.environ[key] = str(value)
    options = process_group_options(use_gpu, int(os.environ["LOCAL_RANK"]))
    if use_gpu:
        torch.cuda.set_device(options["device_id"])
    store = rendezvous_store(rank)  # bound where the init method says, not on every interface
    where = {"store": store} if store is not None else {"init_method": rank.init_method}
    torch.distributed.init_process_group(rank=rank.rank, world_size=rank.world_size, **where, **options)
    _forget_destroyed_groups()
    deepspeed.init_distributed(
        dist_backend=options["backend"],
        auto_mpi_discovery=False,
        verbose=False,
        init_method=rank.init_method,
        rank=rank.rank,
        world_size=rank.world_size,
    )


def _forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached process groups: they belong to a world group that is gone.

    DeepSpeed clones the world group once and keeps it in module globals. When something else
    destroyed the world (vLLM's in-process engine tears down torch.distributed on shutdown), a new
    learner in the same process would reach DeepSpeed's dead clone and fail ("Group ... is not
    registered"). DeepSpeed's own teardown releases them the same way; older versions lack the hook.
    """
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    else:
        groups._WORLD_GROUP = None


def deepspeed_config(config: LearnerConfig) -> dict[str, Any]:
    """DeepSpeed settings: ZeRO stage, precision and clipping from the learner config.

    Gradient accumulation is driven by the learner (a step has as many micro-batches as its records
    need), so DeepSpeed is told 1 and the accumulation boundary is set by hand on the last one.
    """
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = config.zero3_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": config.bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def make_engine(module: CompletionScorer, config: LearnerConfig, rank: RankSpec | None = None) -> Any:
    """DeepSpeed engine over `module` with a plain torch AdamW on the LoRA weights (nothing compiled).

    In a learner group every rank builds it at once: DeepSpeed's initialiser broadcasts rank 0's weights.
    At ZeRO-3 the module stays where it was loaded (its partitions) and the LM head is registered with it.
    """
    import deepspeed

    init_distributed(config.use_gpu, rank)
    params = list(lora_parameters(module).values())
    if not params:
        raise ValueError("the model has no trainable parameters: was LoRA applied?")
    optimizer = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    if config.zero_stage == 3:
        deepspeed.zero.register_external_parameter(module, module.lm_head_weight)
    elif config.use_gpu:
        module = module.cuda()
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=deepspeed_config(config))
    return engine
