"""PolicyServer: one Ray Serve deployment of vLLM serving the base model and many LoRA versions at once.

Rollout workers call `generate` through a deployment handle with batches of plain-dict requests,
each naming its policy (`base` or `<policy>@v<N>`) and, for constrained decoding, its legal orders.
Requests for different adapters share the engine's batches. People and other tools can query any
version through a small OpenAI-compatible route (`POST /v1/completions`, model = version name).

Versions are loaded on first use from the AdapterStore (shared directory) or the local copy of one
that travelled through Ray's object store, kept in an LRU and unloaded when it overflows. A bad
request (unknown or malformed version, corrupt or incompatible adapter, malformed legal orders)
fails alone with a clear error in its result; it never fails the batch or the replica. Adapter files
are re-hashed on every load, checked against the fingerprint pinned when the version was published
and against the served base model (name and weight shapes), and vLLM is given the replica's private
copy of exactly the verified bytes (it re-reads the path after its own cache evicts an adapter).
Each adapter has its own load lock, so a cold load never holds up requests for other adapters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

from diprl.game.legal import PowerOrders
from diprl.inference.adapters import (
    BASE,
    AdapterError,
    AdapterStore,
    AdapterVersion,
    LocalAdapterCache,
    check_compatible,
    parse_policy_ref,
)
from diprl.inference.adapters.private import PrivateCopies
from diprl.inference.config import ServerConfig, is_loopback
from diprl.inference.engine import ENGINE_ENV, engine_env, sampled_logprobs
from diprl.inference.http_route import OPENAPI_BODY, CompletionsRoute
from diprl.inference.logits_processor import OrderConstraintLogitsProcessor, constraint_args
from diprl.inference.requests import (
    EngineLimits,
    RequestError,
    ValidRequest,
    check_prompt_length,
    validate_batch,
    validate_request,
)
from diprl.messages import ZOO_PREFIX, Generation, GenerationRequest
from diprl.policy.constraint import OrderConstraint, ReasoningOptions
from diprl.policy.parser import legal_complete, parse_orders

log = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT_S = 30.0

__all__ = [
    "BASE",
    "PolicyEngine",
    "PolicyServer",
    "RequestError",
    "ServeConflict",
    "port_in_use",
    "resolve_model",
    "serve_policy",
    "stop_serving",
]


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(local model path, dtype) for a preset name or a checkpoint path; builds the tiny model if needed."""
    from diprl.policy.models import known_presets, load_preset, resolve_model_path

    if config.model in known_presets():
        preset = load_preset(config.model)
        return str(resolve_model_path(preset)), config.dtype or preset.dtype
    return config.model, config.dtype or "auto"


def _child_pids() -> list[int]:
    """This process's children (vLLM's engine core runs in one), from /proc; empty where there is none."""
    pids: list[int] = []
    for tasks in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.extend(int(pid) for pid in tasks.read_text().split())
    return sorted(set(pids))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class KeyedLocks:
    """One `asyncio.Lock` per key, forgotten once no one holds or waits for it (the keys requests can
    name are unbounded: every well-formed adapter name, loadable or not)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


@dataclass(frozen=True)
class LoadedAdapter:
    """A version loaded into the engine: the request vLLM knows it by, and its private copy's key."""

    request: Any  # vllm.lora.request.LoRARequest
    fingerprint: str


class Occupancy:
    """The time-weighted mean number of requests inside the engine while it holds any: the batch the
    engine sees (what matches in flight and several workers are for), reported by `status`."""

    def __init__(self) -> None:
        self.inside = 0
        self.last = time.monotonic()
        self.weighted = 0.0
        self.busy_s = 0.0

    def _tick(self) -> None:
        now = time.monotonic()
        if self.inside:
            self.weighted += self.inside * (now - self.last)
            self.busy_s += now - self.last
        self.last = now

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._tick()
        self.inside += 1
        try:
            yield
        finally:
            self._tick()
            self.inside -= 1

    def mean(self) -> float:
        self._tick()
        return self.weighted / self.busy_s if self.busy_s else 0.0


class PolicyEngine:
    """The async vLLM engine plus adapter management; the deployment is a thin shell around it."""

    def __init__(self, config: ServerConfig, engine: Any = None, tokenizer: Any = None) -> None:
        """Build vLLM's `AsyncLLM` for `config`, or use the `engine` and `tokenizer` given (tests drive
        the adapter and request logic with a fake engine that answers like `AsyncLLM`)."""
        from diprl.policy.tokenizer import load_tokenizer
        from diprl.policy.vocab import token_table

        self.config = config
        model_path, dtype = resolve_model(config)
        self.model_path = model_path
        self.engine = engine if engine is not None else self._start_vllm(config, model_path, dtype)
        # The server's own copy of what the engine and its logits processor use, to validate requests
        # (prompt length, token ids, the order grammar) before the engine sees them.
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        model_config = getattr(self.engine, "model_config", None)
        logits_width = model_config.get_vocab_size() if model_config is not None else len(self.tokenizer)
        self.table = token_table(self.tokenizer, logits_width)
        context = model_config.max_model_len if model_config is not None else config.max_model_len
        self.limits = EngineLimits(max_model_len=int(context), vocab_size=min(len(self.tokenizer), logits_width))
        self.store = AdapterStore(Path(config.adapter_root))
        fetch = None
        if config.adapter_registry:
            from diprl.inference.registry import registry_fetch

            fetch = registry_fetch(config.adapter_registry)
        self.cache = LocalAdapterCache(Path(config.adapter_cache), fetch=fetch, store=self.store)
        self.private = PrivateCopies()  # what vLLM reads: never the store's own files
        self._loras: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._in_use: Counter[str] = Counter()
        self._next_lora_id = 1
        self._zoo: dict[str, Any] = {}  # zoo entries verified and loaded: their LoRARequest, None for a base
        self._loading = KeyedLocks()  # one per adapter: a cold load never holds up other adapters
        self.loads = 0
        self.unloads = 0
        self.dead: str | None = None  # why the engine is unusable; health checks fail from then on
        self.failed_requests = 0
        self.occupancy = Occupancy()

    @staticmethod
    def _start_vllm(config: ServerConfig, model_path: str, dtype: str) -> Any:
        engine_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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
            # Ray workers in the replica's own placement group (see `replica_options`), one per GPU bundle.
            engine_args["distributed_executor_backend"] = "ray"
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

    # ------------------------------------------------------------ adapters
    def _verified_copy(self, name: str) -> tuple[AdapterVersion, Path]:
        """The version re-hashed and checked against its pin now, then against this server's rank
        limit and base model, and the private copy of exactly those bytes that vLLM will read."""
        version = self.cache.get(name)
        check_compatible(version, max_rank=self.config.max_lora_rank, base_model=self.model_path)
        return version, self.private.acquire(version)

    async def _acquire(self, policy: str) -> Any:
        """The LoRARequest for `policy` (None for base), loaded if needed; marks it in use.

        Only requests for the same adapter wait for its load; one already loaded is served at once."""
        if policy.startswith(ZOO_PREFIX):
            return await self._acquire_zoo(policy)
        ref = parse_policy_ref(policy)
        if ref is None:
            return None
        loaded = self._loras.get(ref.name)
        if loaded is None:
            async with self._loading.hold(ref.name):
                loaded = self._loras.get(ref.name)  # a request that held the lock before us loaded it
                if loaded is None:
                    loaded = await self._load(ref.name)
                    self._loras[ref.name] = loaded
                    self.loads += 1
                self._in_use[ref.name] += 1  # before the lock goes: nothing can evict it in between
        else:
            self._in_use[ref.name] += 1
        self._loras.move_to_end(ref.name)
        return loaded.request

    async def _acquire_zoo(self, ref: str) -> Any:
        """A shipped policy (`zoo:<name>`): its LoRARequest, or None when the entry is this engine's base alone.

        The entry is verified file by file (off the event loop) and checked against this engine's model and
        LoRA slots the first time it is asked for; its adapter is then loaded once and kept (the zoo is a few
        read-only entries, never evicted). An entry of another model is refused, naming both models."""
        if ref not in self._zoo:
            async with self._loading.hold(ref):
                if ref not in self._zoo:
                    self._zoo[ref] = await self._load_zoo(ref)
        lora = self._zoo[ref]
        if lora is not None:
            self._in_use[ref] += 1  # balanced by `_release`; zoo adapters are not in the LRU
        return lora

    async def _load_zoo(self, ref: str) -> Any:
        from vllm.lora.request import LoRARequest

        entry = await asyncio.to_thread(self._verified_zoo_entry, ref)
        if entry.adapter_dir is None:
            return None
        lora = LoRARequest(ref, self._next_lora_id, str(entry.adapter_dir))
        self._next_lora_id += 1
        try:
            await asyncio.wait_for(self.engine.add_lora(lora), self.config.request_timeout_s)
        except Exception as exc:
            self._note_engine_failure(exc)
            raise AdapterError(f"{ref} could not be loaded by the engine: {_error(exc)}") from exc
        return lora

    def _verified_zoo_entry(self, ref: str) -> Any:
        import json

        from diprl.inference.adapters.names import same_base_model
        from diprl.policy.models import load_preset, resolve_model_path
        from diprl.policy.zoo import ZooError, load_entry

        try:
            entry = load_entry(ref)
        except ZooError as err:
            raise AdapterError(str(err)) from None
        served = str(resolve_model_path(load_preset(entry.model)))
        if not same_base_model(served, self.model_path):
            raise AdapterError(f"{ref} plays on model {entry.model!r} ({served}); this server runs {self.model_path!r}")
        if entry.adapter_dir is not None:
            rank = json.loads((entry.adapter_dir / "adapter_config.json").read_text()).get("r")
            if not isinstance(rank, int) or rank > self.config.max_lora_rank:
                raise AdapterError(
                    f"{ref}: its adapter's rank {rank!r} exceeds the server's max LoRA rank {self.config.max_lora_rank}"
                )
        return entry

    async def _load(self, name: str) -> LoadedAdapter:
        from vllm.lora.request import LoRARequest

        timeout = self.config.request_timeout_s
        # Hashing and copying a large adapter take a moment: off the event loop, so streams keep flowing.
        copying = asyncio.ensure_future(asyncio.to_thread(self._verified_copy, name))
        try:
            version, path = await asyncio.wait_for(asyncio.shield(copying), timeout)
        except BaseException as exc:  # the thread runs on: whatever copy it makes must not be kept forever
            copying.add_done_callback(self._release_abandoned_copy)
            if isinstance(exc, TimeoutError):
                raise AdapterError(f"{name}: fetching and verifying it took more than {timeout:g} s") from None
            raise
        lora = LoRARequest(name, self._next_lora_id, str(path))
        self._next_lora_id += 1
        try:
            # Load now: a broken adapter fails here, alone.
            await asyncio.wait_for(self.engine.add_lora(lora), timeout)
        except BaseException as exc:
            self.private.release(version.fingerprint)
            if isinstance(exc, TimeoutError):
                raise AdapterError(f"{name}: the engine did not load it within {timeout:g} s") from None
            if not isinstance(exc, Exception):
                raise
            self._note_engine_failure(exc)
            raise AdapterError(f"{name} could not be loaded by the engine: {_error(exc)}") from exc
        return LoadedAdapter(lora, version.fingerprint)

    def _release_abandoned_copy(self, copying: asyncio.Future[tuple[AdapterVersion, Path]]) -> None:
        if not copying.cancelled() and copying.exception() is None:
            self.private.release(copying.result()[0].fingerprint)

    async def _release(self, lora: Any) -> None:
        """No lock: releasing never waits for another adapter's load."""
        if lora is not None:
            self._in_use[lora.lora_name] -= 1
            await self._evict()

    async def _evict(self) -> None:
        """Unload least recently used versions beyond the LRU size (never one a request is using)."""
        while len(self._loras) > self.config.loaded_adapters:
            idle = next((name for name in self._loras if self._in_use[name] <= 0), None)
            if idle is None:
                return
            loaded = self._loras.pop(idle)  # chosen and removed with no await between: no two evict one
            del self._in_use[idle]
            try:
                await asyncio.wait_for(
                    self.engine.remove_lora(loaded.request.lora_int_id), self.config.request_timeout_s
                )
            except Exception as exc:  # the engine keeps its own LRU; failing to unload costs memory only
                self._note_engine_failure(exc)
                log.warning("could not unload adapter %s: %s", idle, _error(exc))
            self.private.release(loaded.fingerprint)
            self.unloads += 1

    def loaded(self) -> list[str]:
        return list(self._loras)

    # ---------------------------------------------------------- generation
    def _note_engine_failure(self, exc: BaseException) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or getattr(self.engine, "errored", False):
            if self.dead is None:
                log.error("the vLLM engine died (%s); this replica reports unhealthy until replaced", _error(exc))
            self.dead = self.dead or _error(exc)

    def prepare(self, request: ValidRequest) -> tuple[list[int], Any]:
        """Token ids and sampling parameters for a valid request; raises `RequestError`."""
        from vllm import SamplingParams

        if isinstance(request.prompt, str):
            prompt_ids = list(self.tokenizer.encode(request.prompt))
            if not prompt_ids:
                raise RequestError("'prompt' encodes to no tokens")
            check_prompt_length(len(prompt_ids), self.limits)
        else:
            prompt_ids = list(request.prompt)
        extra = None
        if request.legal is not None:
            reasoning = request.reasoning_max_tokens
            self._check_constraint(request.legal, None if reasoning is None else ReasoningOptions(max_tokens=reasoning))
            extra = constraint_args(request.legal, reasoning, request.sample_seed)
        params = SamplingParams(
            temperature=request.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=request.max_tokens,
            logprobs=0,
            skip_special_tokens=True,
            extra_args=extra,
        )
        return prompt_ids, params

    def _validate_and_prepare(self, raw: Any) -> tuple[ValidRequest, list[int], Any]:
        request = validate_request(raw, self.limits)
        return (request, *self.prepare(request))

    def _check_constraint(self, legal: PowerOrders, reasoning: ReasoningOptions | None) -> None:
        """Build the order grammar here, as the engine's logits processor will: if it cannot, the
        request fails now instead of inside the engine's loop."""
        try:
            allowed = OrderConstraint(legal, self.table, reasoning).allowed_token_ids([])
        except Exception as exc:
            raise RequestError(f"'legal' cannot be decoded under the order constraint: {_error(exc)}") from exc
        if len(allowed) == 0:
            raise RequestError("'legal' admits no first token under the order constraint")

    async def generate_one(self, raw: GenerationRequest | dict[str, Any]) -> Generation:
        """One request, start to finish; never raises (every failure is the result's `error`).

        `raw` is a `GenerationRequest` (rollout workers, evaluation) or its wire form, a dict (the
        HTTP route, fuzzing): both are validated field by field the same way.
        """
        wire = raw.to_dict() if isinstance(raw, GenerationRequest) else raw
        policy = wire.get("policy", BASE) if isinstance(wire, dict) else None
        request_id = wire.get("request_id") if isinstance(wire, dict) else None
        policy = policy if isinstance(policy, str) else None
        request_id = request_id if isinstance(request_id, str) else None
        try:
            return await self._generate_one(wire, policy, request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours must still cost only this request
            log.exception("unexpected failure serving one request")
            self.failed_requests += 1
            return Generation.failed(policy, f"InternalError: {_error(exc)}", request_id)

    def _fail(self, policy: str | None, error: str, request_id: str | None) -> Generation:
        self.failed_requests += 1
        return Generation.failed(policy, error, request_id)

    async def _generate_one(self, raw: Any, policy: str | None, request_id: str | None) -> Generation:
        if self.dead is not None:
            dead = f"EngineDead: this replica's engine has died ({self.dead}); Serve replaces it, retry"
            return Generation.failed(policy, dead, request_id)
        try:
            # Validation and tokenisation are CPU work proportional to the prompt (0.24 s for 131k
            # characters): in a thread, so one long prompt does not stall every other request's stream.
            request, prompt_ids, params = await asyncio.to_thread(self._validate_and_prepare, raw)
            lora = await self._acquire(request.policy)
        except (AdapterError, RequestError) as exc:
            return self._fail(policy, _error(exc), request_id)
        engine_id = uuid.uuid4().hex  # never the client's id: two requests must never share one
        try:
            with self.occupancy.busy():
                final = await asyncio.wait_for(
                    self._run(prompt_ids, params, engine_id, lora), self.config.request_timeout_s
                )
        except TimeoutError:
            with contextlib.suppress(Exception):
                await self.engine.abort(engine_id)
            timeout = f"Timeout: no answer within {self.config.request_timeout_s:g} s (request_timeout_s)"
            return self._fail(policy, timeout, request_id)
        except Exception as exc:
            self._note_engine_failure(exc)
            kind = "EngineDead" if self.dead is not None else "EngineError"
            return self._fail(policy, f"{kind}: {_error(exc)}", request_id)
        finally:
            await self._release(lora)
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        fields: dict[str, Any] = {
            "prompt_ids": list(final.prompt_token_ids or prompt_ids),
            "token_ids": token_ids,
            "logprobs": sampled_logprobs(token_ids, completion.logprobs),
            "text": completion.text,
            "finish_reason": str(completion.finish_reason),
        }
        error: str | None = None
        legal = request.legal
        if legal is not None:
            parsed = parse_orders(completion.text, legal)
            fields.update(
                orders=list(parsed.orders),
                complete=legal_complete(parsed, legal),
                rejected=[[r.line, str(r.reason)] for r in parsed.rejected],
            )
            if not completion.text.strip():
                # The logits processor fails closed (EOS only) when a constraint breaks in the engine.
                error = "ConstraintFailed: the order constraint failed inside the engine for this request"
                self.failed_requests += 1
        return Generation(policy=request.policy, error=error, request_id=request.request_id, **fields)

    async def _run(self, prompt_ids: list[int], params: Any, engine_id: str, lora: Any) -> Any:
        final = None
        async for output in self.engine.generate(
            {"prompt_token_ids": prompt_ids}, params, request_id=engine_id, lora_request=lora
        ):
            final = output
        if final is None:
            raise RuntimeError("the engine returned no output")
        return final

    async def generate(self, requests: Any) -> list[Generation]:
        """All requests concurrently (vLLM batches them, across adapters); one result per request, in order.

        `requests` must be a list of `GenerationRequest`s (or their dict wire form); anything else (a
        string, one request) is a `RequestError` for the whole call: there is no per-request answer to give.
        """
        batch = validate_batch(requests, self.config.max_batch)
        return list(await asyncio.gather(*(self.generate_one(r) for r in batch)))

    async def check_health(self) -> None:
        """Raise if the engine is unusable, so Serve replaces this replica."""
        if self.dead is not None:
            raise RuntimeError(f"vLLM engine is dead: {self.dead}")
        try:
            await asyncio.wait_for(self.engine.check_health(), HEALTH_CHECK_TIMEOUT_S)
        except Exception as exc:
            self.dead = self.dead or _error(exc)
            raise RuntimeError(f"vLLM engine is unhealthy: {_error(exc)}") from exc

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.private.close()


app = FastAPI(title="diprl PolicyServer", description="Completions from the base model or any adapter version.")


@serve.deployment
@serve.ingress(app)
class PolicyServer:
    """The Ray Serve deployment: `generate` for rollout workers, `/v1/*` for people and tools."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServerConfig(**config)
        self.engine = PolicyEngine(self.config)
        self.http = CompletionsRoute(
            self.engine.generate_one, self.config.max_body_bytes, max_ongoing=self.config.http_max_ongoing
        )

    async def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        return await self.engine.generate(requests)

    async def limits(self) -> dict[str, Any]:
        """The engine limits requests are checked against (context length, prompt token ids)."""
        return asdict(self.engine.limits)

    async def status(self) -> dict[str, Any]:
        """Loaded adapters, counters, and this replica's identity (actor, engine-core processes)."""
        import ray

        context = ray.get_runtime_context()
        return {
            "loaded": self.engine.loaded(),
            "loads": self.engine.loads,
            "unloads": self.engine.unloads,
            "replica": context.get_actor_name(),
            "actor_id": context.get_actor_id(),
            "failed_requests": self.engine.failed_requests,
            "mean_batch": self.engine.occupancy.mean(),
            "busy_s": self.engine.occupancy.busy_s,
            "dead": self.engine.dead,
            "engine_pids": _child_pids(),
        }

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def identity(self) -> dict[str, Any]:
        """What this server serves, so another `serve_policy` of the same name can tell whose it is."""
        return {"adapter_root": self.config.adapter_root, "model": self.config.model}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        names = [BASE] + [
            ref.name for policy in self.engine.store.policies() for ref in self.engine.store.versions(policy)
        ]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "diprl"} for n in names]}

    @app.post("/v1/completions", openapi_extra=OPENAPI_BODY)
    async def completions(self, request: Request) -> Response:
        return await self.http(request)


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on (host, port): binding it (as Serve's proxy will) fails."""
    for family, kind, proto, _name, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is not "in use"
            try:
                sock.bind(address)
            except OSError:
                return True
    return False


def free_port(host: str) -> int:
    with socket.socket(socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _serve_running() -> bool:
    """Whether this Ray cluster already runs Serve (then its proxy holds the port, legitimately)."""
    import ray

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


class ServeConflict(RuntimeError):
    """A Serve application of this name already serves another run's adapters: deploying would take it over."""


IDENTITY_TIMEOUT_S = 60.0


def _served_adapter_root(app: str) -> str | None:
    """The adapter root the running application `app` serves; None when no application has that name.

    Raises `ServeConflict` when one exists but cannot say (not a PolicyServer, or no replica answers):
    it may belong to another run, so it is not ours to replace or delete.
    """
    if not _serve_running():
        return None
    overview = serve.status().applications.get(app)
    if overview is None:
        return None
    try:
        served: dict[str, Any] = serve.get_app_handle(app).identity.remote().result(timeout_s=IDENTITY_TIMEOUT_S)
        return str(served["adapter_root"])
    except Exception as exc:
        raise ServeConflict(
            f"a Serve application named {app!r} already exists ({overview.status}) and did not say which adapter "
            f"store it serves ({_error(exc)[:300]}); it may be another run's. Give this server another name "
            f"(inference.name; training names its own per run), or delete it with `serve.delete({app!r})` "
            "if it is yours"
        ) from exc


def stop_serving(app: str, adapter_root: str | Path | None = None) -> None:
    """Delete the Serve application `app` (a PolicyServer) and wait for its replicas to stop.

    With `adapter_root`, only if `app` serves that store: a run never deletes another run's server
    (one whose `serve_policy` was refused, say, still runs its cleanup). An application that cannot
    say which store it serves is left running, with a warning.

    Not `serve.shutdown()`: that kills the Serve controller, which fails every call still waiting on
    it (its own `graceful_shutdown`, the long polls of every handle), and Ray prints each failure as a
    "(raylet) Task ServeController... failed" line in a healthy run. The controller goes with
    `ray.shutdown()` on a local cluster; on a shared one, other Serve applications stay up.
    """
    from ray.serve.exceptions import RayServeException

    if adapter_root is not None:
        try:
            served = _served_adapter_root(app)
        except ServeConflict as exc:
            log.warning("left the Serve application %r running: %s", app, exc)
            return
        if served is None:
            return
        if served != str(Path(adapter_root).resolve()):
            log.warning("left the Serve application %r running: it serves %s, not %s", app, served, adapter_root)
            return
    with contextlib.suppress(RayServeException):  # Serve never started (a run failed early): nothing to stop
        serve.delete(app)


@contextlib.contextmanager
def serving(config: ServerConfig, resources: Mapping[str, float] | None = None) -> Iterator[Any]:
    """The PolicyServer of `config` (its deployment handle) for the length of a `with` block, on the running
    Ray; deleted after it, however the block ends, and only if it still serves `config`'s adapters.
    `resources`: custom resources every replica asks for (see `replica_options`)."""
    handle = serve_policy(config, resources)
    try:
        yield handle
    finally:
        stop_serving(config.name, adapter_root=config.adapter_root)


@contextlib.contextmanager
def deploying(
    config: ServerConfig, resources: Mapping[str, float] | None = None
) -> Iterator[concurrent.futures.Future[Any]]:
    """`serving`, with the deployment on a thread of its own: the block runs while the replicas start, and
    `.result()` on the future it yields waits for the deployment handle (raising what deploying raised).
    A training run creates its other actors meanwhile: their start (imports, the learner's engine) and the
    replicas' (vLLM's) overlap instead of following one another. After the block, once the deployment
    call has returned, the server is deleted as `serving` deletes it; a deployment that raised is left
    as `serving` leaves it (nothing of this server's to delete, or another run's)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deploy-policy-server") as pool:
        deployment = pool.submit(serve_policy, config, resources)
        try:
            yield deployment
        finally:
            if deployment.exception() is None:  # waits for the deployment call to return
                stop_serving(config.name, adapter_root=config.adapter_root)


def replica_options(config: ServerConfig, resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Ray Serve options that place one replica: its CPUs, GPUs and, with tensor parallelism, its bundles.

    With `tensor_parallel_size` 1 the replica actor holds its GPU (or fraction) itself. Above 1 vLLM's Ray
    executor starts one worker per shard and puts each in a GPU bundle of the placement group the replica
    runs in, so every replica gets its own group: the first bundle holds the replica actor's CPUs and the
    first shard's GPU, the others one GPU each, STRICT_PACK so the shards share a node (their all-reduce
    runs every layer and wants NVLink, not the network). The replica actor then asks for no GPU itself.

    `resources` (custom resources, a run's `placement.inference`) go to the replica actor and, with
    tensor parallelism, to the first bundle, which must hold what the actor asks for: STRICT_PACK puts the
    other shards on the same node, one that declares them.
    """
    env = {**ENGINE_ENV, "VLLM_LOGGING_LEVEL": config.log_level, "VLLM_CONFIGURE_LOGGING": "1"}
    tp = config.tensor_parallel_size
    custom = dict(resources or {})
    actor: dict[str, Any] = {
        "num_cpus": config.replica_cpus,
        "num_gpus": config.replica_gpus if tp == 1 else 0,
        "runtime_env": {"env_vars": env},
    }
    if custom:
        actor["resources"] = custom
    options: dict[str, Any] = {"ray_actor_options": actor}
    if tp > 1:
        first = {"CPU": config.replica_cpus, "GPU": 1.0, **custom}
        options["placement_group_bundles"] = [first] + [{"GPU": 1.0}] * (tp - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def serve_policy(config: ServerConfig, resources: Mapping[str, float] | None = None) -> Any:
    """Start (or update) the PolicyServer on the running Ray cluster and return its deployment handle.

    `resources`: custom resources every replica asks for, to run only on the nodes that declare them
    (see `replica_options`).

    Fails fast with `OSError(EADDRINUSE)` when another process (another cluster's PolicyServer, say)
    already holds the HTTP port: Serve would otherwise report ready while requests reach the other
    server. `port: 0` picks a free port and logs it (the returned config's port, `handle` users need
    no port). Library logging inside the replicas follows `config.log_level` (WARNING by default).

    Fails fast with `ServeConflict`, before anything is deployed, when an application of the same
    name already serves another adapter root (another run on this cluster): updating it would repoint
    that run's replicas at this store. The same root is an update (a resumed run, a new setting).
    """
    import errno

    model_path, dtype = resolve_model(config)  # build the tiny model once, here, not in every replica
    config = replace(
        config,
        model=model_path,
        dtype=dtype,
        adapter_root=str(Path(config.adapter_root).resolve()),
        adapter_cache=str(Path(config.adapter_cache).resolve()),
    )
    served = _served_adapter_root(config.name)
    if served is not None and served != config.adapter_root:
        raise ServeConflict(
            f"the Serve application {config.name!r} already serves adapters from {served}; this server's are in "
            f"{config.adapter_root}. Deploying would repoint that server (another run's?) at this store: give this "
            "one another name (inference.name; training names its own per run) or stop the other first"
        )
    if not _serve_running():
        if config.port == 0:
            config = replace(config, port=free_port(config.host))
            log.warning("PolicyServer HTTP route: picked free port %d on %s", config.port, config.host)
        elif port_in_use(config.host, config.port):
            raise OSError(
                errno.EADDRINUSE,
                f"PolicyServer cannot listen on {config.host}:{config.port}: the port is already in use (another "
                "PolicyServer or Ray Serve instance?). Stop it, set inference.port to a free port, or port: 0 to "
                "pick one",
            )
    logging_config = {"log_level": config.log_level, "enable_access_log": config.log_level in ("DEBUG", "INFO")}
    # A loopback route is reached only on its own node, and one proxy per node of a multi-node cluster on one
    # host (tests, `ray.cluster_utils`) would collide on the port: one proxy, on the head, where the driver is.
    proxies = "HeadOnly" if is_loopback(config.host) else "EveryNode"
    serve.start(
        proxy_location=proxies,
        http_options={"host": config.host, "port": config.port},
        logging_config=logging_config,
    )
    scaling: dict[str, Any] = (
        {"autoscaling_config": config.autoscaling, "num_replicas": "auto"}
        if config.autoscaling
        else {"num_replicas": config.num_replicas}
    )
    deployment = PolicyServer.options(  # type: ignore[attr-defined]
        name=config.name,
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=5.0,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S + 10.0,
        logging_config=logging_config,
        **replica_options(config, resources),
        **scaling,
    )
    return serve.run(
        deployment.bind(asdict(config)),
        name=config.name,
        route_prefix=config.route_prefix,
        logging_config=logging_config,
    )
