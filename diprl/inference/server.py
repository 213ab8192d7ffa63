"""PolicyServer: one Ray Serve deployment of vLLM serving the base model and many LoRA versions at once.

Rollout workers call `generate` through a deployment handle with batches of plain-dict requests,
each naming its policy (`base` or `<policy>@v<N>`) and, for constrained decoding, its legal orders.
Requests for different adapters share the engine's batches. People and other tools can query any
version through a small OpenAI-compatible route (`POST /v1/completions`, model = version name).

Versions are loaded on first use from the AdapterStore (shared directory) or the local copy of one
that travelled through Ray's object store, kept in an LRU and unloaded when it overflows. A bad
request (unknown or malformed version, corrupt or incompatible adapter, malformed legal orders)
fails alone with a clear error in its result; it never fails the batch or the replica.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray import serve

from diprl.game.legal import PowerOrders
from diprl.inference.adapters import (
    AdapterError,
    AdapterStore,
    LocalAdapterCache,
    check_compatible,
    parse_policy_ref,
)
from diprl.inference.config import ServerConfig
from diprl.inference.engine import ENGINE_ENV, engine_env, sampled_logprobs
from diprl.inference.logits_processor import OrderConstraintLogitsProcessor, constraint_args
from diprl.policy.parser import legal_complete, parse_orders

BASE = "base"


class RequestError(ValueError):
    """A malformed generation request (missing prompt, bad types, malformed legal orders)."""


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(local model path, dtype) for a preset name or a checkpoint path; builds the tiny model if needed."""
    from diprl.policy.models import known_presets, load_preset, resolve_model_path

    if config.model in known_presets():
        preset = load_preset(config.model)
        return str(resolve_model_path(preset)), config.dtype or preset.dtype
    return config.model, config.dtype or "auto"


def _check_request(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise RequestError(f"a request must be a dict, got {type(request).__name__}")
    prompt = request.get("prompt")
    if not (isinstance(prompt, str) and prompt) and not (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        raise RequestError("'prompt' must be a non-empty string or list of token ids")
    temperature = request.get("temperature", 1.0)
    max_tokens = request.get("max_tokens", 384)
    if not isinstance(temperature, int | float) or temperature <= 0:
        raise RequestError(f"'temperature' must be a positive number, got {temperature!r}")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise RequestError(f"'max_tokens' must be a positive int, got {max_tokens!r}")
    return request


class PolicyEngine:
    """The async vLLM engine plus adapter management; the deployment is a thin shell around it."""

    def __init__(self, config: ServerConfig) -> None:
        engine_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        model_path, dtype = resolve_model(config)
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
            **config.engine_extra,
        )
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        self.store = AdapterStore(Path(config.adapter_root))
        fetch = None
        if config.adapter_registry:
            from diprl.inference.registry import registry_fetch

            fetch = registry_fetch(config.adapter_registry)
        self.cache = LocalAdapterCache(Path(config.adapter_cache), fetch=fetch, store=self.store)
        self._loras: OrderedDict[str, Any] = OrderedDict()
        self._in_use: Counter[str] = Counter()
        self._next_lora_id = 1
        self._lock = asyncio.Lock()
        self.loads = 0
        self.unloads = 0

    # ------------------------------------------------------------ adapters
    async def _acquire(self, policy: str) -> Any:
        """The LoRARequest for `policy` (None for base), loaded if needed; marks it in use."""
        from vllm.lora.request import LoRARequest

        ref = parse_policy_ref(policy)
        if ref is None:
            return None
        async with self._lock:
            lora = self._loras.get(ref.name)
            if lora is None:
                version = self.cache.get(ref.name)
                check_compatible(version, max_rank=self.config.max_lora_rank, base_model=None, allowed_modules=None)
                lora = LoRARequest(ref.name, self._next_lora_id, str(version.path))
                self._next_lora_id += 1
                try:
                    await self.engine.add_lora(lora)  # load now: a broken adapter fails here, alone
                except Exception as exc:
                    raise AdapterError(f"{ref.name} could not be loaded by the engine: {exc}") from exc
                self._loras[ref.name] = lora
                self.loads += 1
            self._loras.move_to_end(ref.name)
            self._in_use[ref.name] += 1
            await self._evict()
            return lora

    async def _release(self, lora: Any) -> None:
        if lora is not None:
            async with self._lock:
                self._in_use[lora.lora_name] -= 1
                await self._evict()

    async def _evict(self) -> None:
        """Unload least recently used versions beyond the LRU size (never one a request is using)."""
        while len(self._loras) > self.config.loaded_adapters:
            idle = next((name for name in self._loras if self._in_use[name] <= 0), None)
            if idle is None:
                return
            lora = self._loras.pop(idle)
            await self.engine.remove_lora(lora.lora_int_id)
            self.unloads += 1

    def loaded(self) -> list[str]:
        return list(self._loras)

    # ---------------------------------------------------------- generation
    async def generate_one(self, request: Any) -> dict[str, Any]:
        from vllm import SamplingParams

        policy = request.get("policy", BASE) if isinstance(request, dict) else BASE
        result: dict[str, Any] = {"policy": policy, "error": None}
        try:
            request = _check_request(request)
            legal = PowerOrders.from_dict(request["legal"]) if request.get("legal") is not None else None
            extra = constraint_args(legal, request.get("reasoning_max_tokens")) if legal is not None else None
            params = SamplingParams(
                temperature=float(request.get("temperature", 1.0)),
                top_p=1.0,
                top_k=0,
                max_tokens=int(request.get("max_tokens", 384)),
                logprobs=0,
                skip_special_tokens=True,
                extra_args=extra,
            )
            lora = await self._acquire(str(policy))
        except (AdapterError, RequestError, ValueError, TypeError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            return result
        prompt = request["prompt"]
        engine_prompt: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        final = None
        try:
            async for output in self.engine.generate(
                engine_prompt, params, request_id=request.get("request_id") or uuid.uuid4().hex, lora_request=lora
            ):
                final = output
        finally:
            await self._release(lora)
        assert final is not None
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        result.update(
            prompt_ids=list(final.prompt_token_ids or []),
            token_ids=token_ids,
            logprobs=sampled_logprobs(token_ids, completion.logprobs),
            text=completion.text,
            finish_reason=str(completion.finish_reason),
        )
        if legal is not None:
            parsed = parse_orders(completion.text, legal)
            result.update(
                orders=parsed.orders,
                complete=legal_complete(parsed, legal),
                rejected=[[r.line, str(r.reason)] for r in parsed.rejected],
            )
        return result

    async def generate(self, requests: Sequence[Any]) -> list[dict[str, Any]]:
        """All requests concurrently (vLLM batches them, across adapters); results in request order."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in requests)))

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()


class CompletionBody(BaseModel):
    model: str = BASE
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0


app = FastAPI(title="diprl PolicyServer", description="Completions from the base model or any adapter version.")


@serve.deployment
@serve.ingress(app)
class PolicyServer:
    """The Ray Serve deployment: `generate` for rollout workers, `/v1/*` for people and tools."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServerConfig(**config)
        self.engine = PolicyEngine(self.config)

    async def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return await self.engine.generate(requests)

    async def status(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "loaded": self.engine.loaded(),
            "loads": self.engine.loads,
            "unloads": self.engine.unloads,
            "replica": context.get_actor_name(),
            "actor_id": context.get_actor_id(),
        }

    async def check_health(self) -> None:
        await self.engine.check_health()

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        names = [BASE] + [
            ref.name for policy in self.engine.store.policies() for ref in self.engine.store.versions(policy)
        ]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "diprl"} for n in names]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionBody) -> Any:
        request = {
            "policy": body.model,
            "prompt": body.prompt,
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
        }
        result = await self.engine.generate_one(request)
        if result["error"]:
            status = 404 if "Unknown" in result["error"] else 400
            return JSONResponse(
                status_code=status, content={"error": {"message": result["error"], "type": "invalid_request_error"}}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [
                {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": len(result["prompt_ids"]),
                "completion_tokens": len(result["token_ids"]),
                "total_tokens": len(result["prompt_ids"]) + len(result["token_ids"]),
            },
        }


def serve_policy(config: ServerConfig) -> Any:
    """Start (or update) the PolicyServer on the running Ray cluster and return its deployment handle."""
    model_path, dtype = resolve_model(config)  # build the tiny model once, here, not in every replica
    config = replace(
        config,
        model=model_path,
        dtype=dtype,
        adapter_root=str(Path(config.adapter_root).resolve()),
        adapter_cache=str(Path(config.adapter_cache).resolve()),
    )
    serve.start(http_options={"host": config.host, "port": config.port})
    scaling: dict[str, Any] = (
        {"autoscaling_config": config.autoscaling, "num_replicas": "auto"}
        if config.autoscaling
        else {"num_replicas": config.num_replicas}
    )
    deployment = PolicyServer.options(  # type: ignore[attr-defined]
        name=config.name,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": config.replica_cpus,
            "num_gpus": config.replica_gpus,
            "runtime_env": {"env_vars": dict(ENGINE_ENV)},
        },
        **scaling,
    )
    return serve.run(deployment.bind(asdict(config)), name=config.name, route_prefix="/")
