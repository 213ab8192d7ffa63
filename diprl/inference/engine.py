"""vLLM engines set up for order generation (offline `make_llm`, the PolicyServer's async `start_async_engine`),
and a batch helper that returns what RL needs.

Every request in a batch carries its own legal orders, so the seven powers of a phase, the forks
of a group and free (unconstrained) baselines all go through one `generate` call. Behaviour
log-probabilities are vLLM's processed ones: after the order mask and the temperature, i.e. of
the distribution actually sampled, which is what the learner's importance ratio must compare to.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diprl.game.legal import PowerOrders
from diprl.policy.parser import ParsedOrders, legal_complete, parse_orders

if TYPE_CHECKING:
    from diprl.inference.config import ServerConfig

log = logging.getLogger(__name__)

# Settings every engine here needs: single-process engine core, CPU KV cache size, V1 model runner
# (docs/policy.md, "The vLLM runner").
ENGINE_ENV = {
    # GPU builds default to Model Runner V2, whose logits-processor interface differs: pin V1.
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    # In-process engine core: 9 s start instead of 30 s on CPU, and the processor runs in-process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def engine_env() -> dict[str, str]:
    """Apply the engine settings to this process (explicit environment values win) and return them."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in ENGINE_ENV}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 8
    max_loras: int = 4
    max_num_seqs: int = 64
    extra: dict[str, Any] = field(default_factory=dict)


def make_llm(config: EngineConfig) -> Any:
    """An offline `vllm.LLM` with the order constraint installed and processed logprobs."""
    engine_env()
    from vllm import LLM  # imported late: `import vllm` costs seconds

    from diprl.inference.logits_processor import OrderConstraintLogitsProcessor

    kwargs: dict[str, Any] = dict(
        model=str(config.model),
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        seed=config.seed,
        enable_prefix_caching=config.enable_prefix_caching,
        logits_processors=[OrderConstraintLogitsProcessor],
        logprobs_mode="processed_logprobs",
        # Ignore sampling defaults in the model's generation_config.json (Qwen3 ships temperature 0.6,
        # top_p 0.95, top_k 20): the learner recomputes logprobs assuming exactly our parameters.
        generation_config="vllm",
        max_num_seqs=config.max_num_seqs,
    )
    if config.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank, max_loras=config.max_loras)
    kwargs.update(config.extra)
    return LLM(**kwargs)


def find_tcmalloc(find: Callable[[str], str | None] = ctypes.util.find_library) -> str | None:
    """The name the loader knows this machine's tcmalloc by (Debian's libtcmalloc-minimal4 first), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = find(name)
        if found:
            return found
    return None


@contextlib.contextmanager
def engine_core_preload(
    enabled: bool, on_cpu: Callable[[], bool], find: Callable[[str], str | None] = ctypes.util.find_library
) -> Iterator[str | None]:
    """Inside this block, processes started from this one preload tcmalloc (`LD_PRELOAD`); yields its name.

    vLLM's `AsyncLLM` runs its engine core in a process of its own, started (spawned) inside
    `from_engine_args`: with tcmalloc preloaded there the bare CPU engine generated 1.22 times the tokens
    a second of glibc's allocator (docs/benchmarks.md, "Preloaded runtimes"). A preload must be in the
    environment when a process starts, so this sets it for the block and restores it after: the replica
    itself keeps its allocator. Only on the CPU platform (`on_cpu`), and only when `enabled`
    (`inference.preload_tcmalloc`); a machine without the library is told how to get it.
    """
    if not enabled or not on_cpu():
        yield None
        return
    library = find_tcmalloc(find)
    if library is None:
        log.warning(
            "no tcmalloc on this machine: the CPU engine runs on glibc's allocator, slower "
            "(install Debian's libtcmalloc-minimal4; `make install` does)"
        )
        yield None
        return
    before = os.environ.get("LD_PRELOAD")
    preloads = [p for p in (before or "").split(":") if p]
    os.environ["LD_PRELOAD"] = ":".join([library, *[p for p in preloads if p != library]])
    try:
        yield library
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def start_async_engine(config: ServerConfig, model_path: str, dtype: str) -> Any:
    """vLLM's `AsyncLLM` for a PolicyServer replica: every LoRA slot of `config`, the order constraint installed,
    processed logprobs, and with tensor parallelism Ray workers for the shards."""
    engine_env()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from diprl.inference.logits_processor import OrderConstraintLogitsProcessor

    engine_args: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_seqs=config.max_num_seqs,
        enable_lora=True,
        max_lora_rank=config.max_lora_rank,
        max_loras=config.max_loras,
        max_cpu_loras=max(config.max_cpu_loras, config.max_loras),
        logits_processors=[OrderConstraintLogitsProcessor],
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        **config.engine_extra,
    )
    if config.tensor_parallel_size > 1:
        # Ray workers in the replica's own placement group (see `deploy.replica_options`), one per GPU bundle.
        engine_args["distributed_executor_backend"] = "ray"
    with engine_core_preload(config.preload_tcmalloc, _platform_is_cpu):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


@dataclass(frozen=True)
class OrderRequest:
    """One seat's decision: a prompt (text from `build_prompt`, or token ids) and its legal orders."""

    prompt: str | Sequence[int]
    legal: PowerOrders
    constrained: bool = True
    reasoning_max_tokens: int | None = None
    lora_request: Any = None
    sample_seed: int | None = None  # sampled by our logits processor, reproducibly (evaluation only)


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the masked, tempered distribution
    text: str
    parsed: ParsedOrders
    complete: bool  # exactly one legal order per unit (or n_required adjustments), closed
    finish_reason: str

    @property
    def orders(self) -> list[str]:
        return self.parsed.orders


def sampling_params(request: OrderRequest, temperature: float, max_tokens: int, **overrides: Any) -> Any:
    """Sampling exactly as the learner assumes it, for an `OrderRequest` (`order_sampling_params`)."""
    from diprl.inference.logits_processor import constraint_args

    extra = (
        constraint_args(request.legal, request.reasoning_max_tokens, request.sample_seed)
        if request.constrained
        else None
    )
    return order_sampling_params(temperature, max_tokens, extra, **overrides)


def order_sampling_params(temperature: float, max_tokens: int, extra: dict[str, Any] | None, **overrides: Any) -> Any:
    """Sampling exactly as the learner assumes it: plain temperature sampling, no top-p/top-k, the sampled
    token's own logprob; `extra` carries the order constraint's arguments (`constraint_args`) or None.

    No vLLM per-request seed: the CPU build cannot use seeded per-request generators with chunked
    prefill ("CPU Generator does not use offset"). A request's `sample_seed` is drawn in our logits
    processor instead (`diprl.policy.sampling`), independent of the rest of the batch.
    """
    from vllm import SamplingParams

    return SamplingParams(
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=max_tokens,
        logprobs=0,  # the sampled token's own logprob
        skip_special_tokens=True,
        extra_args=extra,
        **overrides,
    )


def sampled_logprobs(token_ids: Sequence[int], steps: Sequence[Any] | None) -> list[float]:
    """The logprob of each sampled token from vLLM's per-step logprob dicts (requested with logprobs=0)."""
    if steps is None or len(steps) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs; requests must set logprobs=0")
    return [float(step[token].logprob) for token, step in zip(token_ids, steps, strict=True)]


def generate_orders(
    llm: Any,
    requests: Sequence[OrderRequest],
    *,
    temperature: float = 1.0,
    max_tokens: int = 384,
) -> list[Generation]:
    """Run a batch of order requests through the engine and parse each completion."""
    if not requests:
        return []
    prompts: list[Any] = [
        {"prompt_token_ids": list(r.prompt)} if not isinstance(r.prompt, str) else r.prompt for r in requests
    ]
    params = [sampling_params(r, temperature, max_tokens) for r in requests]
    loras = [r.lora_request for r in requests]
    outputs = llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)
    out = []
    for request, result in zip(requests, outputs, strict=True):
        completion = result.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = sampled_logprobs(token_ids, completion.logprobs)
        parsed = parse_orders(completion.text, request.legal)
        out.append(
            Generation(
                prompt_ids=list(result.prompt_token_ids or []),
                token_ids=token_ids,
                logprobs=logprobs,
                text=completion.text,
                parsed=parsed,
                complete=legal_complete(parsed, request.legal),
                finish_reason=str(completion.finish_reason),
            )
        )
    return out
