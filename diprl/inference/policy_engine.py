"""PolicyEngine: vLLM's async engine serving the base model and many LoRA versions at once.

Each request names its policy (`base`, `<policy>@v<N>` or a shipped `zoo:<name>`) and, for constrained
decoding, its legal orders; requests for different adapters share the engine's batches. The Ray Serve
deployment around the engine is `diprl.inference.server`, its deployment on a cluster `diprl.inference.deploy`.

Versions are loaded on first use from the AdapterStore (shared directory) or the local copy of one
that travelled through Ray's object store, kept in an LRU and unloaded when it overflows. A bad
request (unknown or malformed version, corrupt or incompatible adapter, malformed legal orders)
fails alone with a clear error in its result; it never fails the batch or the replica. Adapter files
are re-hashed on every load, checked against the fingerprint pinned when the version was published
and against the served base model (name and weight shapes), and vLLM is given the replica's private
copy of exactly the verified bytes (it re-reads the path after its own cache evicts an adapter).
Each adapter has its own load lock, so a cold load never holds up requests for other adapters.

A version published with a canary (`diprl.inference.canary`) is then proven by its behaviour: right
after vLLM loads it, its canary requests go through the engine's normal generate path (prefix cache
included) and their greedy tokens and log-probabilities must match the learner's. A version that
does not is unloaded and refused (`CanaryMismatch`) to every request for it, for the replica's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diprl.game.legal import PowerOrders
from diprl.inference.adapters import (
    BASE,
    AdapterError,
    AdapterStore,
    AdapterVersion,
    CorruptAdapter,
    LocalAdapterCache,
    check_compatible,
    model_ref,
)
from diprl.inference.adapters.private import PrivateCopies
from diprl.inference.canary import (
    CANARY_FILE,
    TOLERANCE,
    Canary,
    CanaryMismatch,
    CorruptCanary,
    check_canary,
    compare_canary,
)
from diprl.inference.concurrency import KeyedLocks, Occupancy
from diprl.inference.config import ServerConfig
from diprl.inference.engine import sampled_logprobs, start_async_engine
from diprl.inference.logits_processor import constraint_args
from diprl.inference.requests import (
    EngineLimits,
    RequestError,
    ValidRequest,
    check_prompt_length,
    validate_batch,
    validate_request,
)
from diprl.messages import Generation, GenerationRequest, PolicyRef
from diprl.policy.constraint import OrderConstraint, ReasoningOptions
from diprl.policy.parser import legal_complete, parse_orders

log = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT_S = 30.0

__all__ = ["HEALTH_CHECK_TIMEOUT_S", "LoadedAdapter", "PolicyEngine", "resolve_model"]


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(local model path, dtype) for a preset name or a checkpoint path (looked up: entry points build it)."""
    from diprl.policy.models import known_presets, load_preset, resolve_model_path

    if config.model in known_presets():
        preset = load_preset(config.model)
        return str(resolve_model_path(preset)), config.dtype or preset.dtype
    return config.model, config.dtype or "auto"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class LoadedAdapter:
    """A version loaded into the engine: the request vLLM knows it by, and its private copy's key."""

    request: Any  # vllm.lora.request.LoRARequest
    fingerprint: str


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
        self.engine = engine if engine is not None else start_async_engine(config, model_path, dtype)
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
        self.canary_tolerance = TOLERANCE
        self.canary_checks = 0
        self.canary_failures = 0
        self.canary_seconds = 0.0
        self.canary_errors: dict[str, float] = {}  # per version checked: its canary error (inf: tokens differ)
        self._refused: dict[str, str] = {}  # versions whose canary failed: why, answered to every request

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
        if PolicyRef.parse(policy).is_zoo:  # validated: base, <policy>@v<N> or zoo:<name>
            return await self._acquire_zoo(policy)
        ref = model_ref(policy)
        if ref.is_base:
            return None
        name = str(ref)
        if name in self._refused:
            raise CanaryMismatch(self._refused[name])
        loaded = self._loras.get(name)
        if loaded is None:
            async with self._loading.hold(name):
                loaded = self._loras.get(name)  # a request that held the lock before us loaded it
                if name in self._refused:  # or found it refused by its canary
                    raise CanaryMismatch(self._refused[name])
                if loaded is None:
                    loaded = await self._load(name)
                    self._loras[name] = loaded
                    self.loads += 1
                self._in_use[name] += 1  # before the lock goes: nothing can evict it in between
        else:
            self._in_use[name] += 1
        self._loras.move_to_end(name)
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
        try:
            served = str(resolve_model_path(load_preset(entry.model)))
        except FileNotFoundError as err:  # ModelNotBuilt: its model is not this server's, which built its own
            raise AdapterError(f"{ref} plays on model {entry.model!r}, which this server does not run: {err}") from None
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
        try:
            await self._check_canary(version, lora)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.remove_lora(lora.lora_int_id), timeout)
            self.private.release(version.fingerprint)
            raise
        return LoadedAdapter(lora, version.fingerprint)

    async def _check_canary(self, version: AdapterVersion, lora: Any) -> None:
        """Serve the version's canary (if it has one) and refuse the version unless it matches.

        The canary is read from the verified version (its hash checked again) and sent as ordinary
        greedy constrained requests with the version's LoRA, side by side with live traffic. A mismatch
        or a corrupt canary refuses the version for good; an engine failure fails this load only."""
        expected = version.canary_file
        if expected is None:
            return  # published before canaries, or by a publisher that made none: bytes checks only
        name = version.name
        started = time.perf_counter()
        # Read from the verified version, never from the path vLLM was handed: were that the wrong copy (a
        # reload that never happened), its own canary would match it.
        data = await asyncio.to_thread((version.path / CANARY_FILE).read_bytes)
        if len(data) != expected.size or hashlib.sha256(data).hexdigest() != expected.sha256:
            raise CorruptAdapter(f"{name}: its {CANARY_FILE} changed after it was verified")
        try:
            canary = Canary.from_bytes(data, name)
            prepared = [self._validate_and_prepare(item.request(name))[1:] for item in canary.items]
        except (CorruptCanary, RequestError) as exc:
            self._refuse(name, f"{name}: its canary cannot be served ({_error(exc)}); refused", math.inf)
            raise CanaryMismatch(self._refused[name]) from None
        ids = [uuid.uuid4().hex for _ in prepared]
        try:
            with self.occupancy.busy():
                finals = await asyncio.wait_for(
                    asyncio.gather(
                        *(self._run(p, params, i, lora) for (p, params), i in zip(prepared, ids, strict=True))
                    ),
                    self.config.request_timeout_s,
                )
        except TimeoutError:
            for engine_id in ids:
                with contextlib.suppress(Exception):
                    await self.engine.abort(engine_id)
            raise AdapterError(
                f"{name}: its canary was not served within {self.config.request_timeout_s:g} s"
            ) from None
        except Exception as exc:
            self._note_engine_failure(exc)
            raise AdapterError(f"{name}: serving its canary failed: {_error(exc)}") from exc
        finally:
            self.canary_seconds += time.perf_counter() - started
        tokens = [list(f.outputs[0].token_ids) for f in finals]
        logprobs = [sampled_logprobs(t, f.outputs[0].logprobs) for t, f in zip(tokens, finals, strict=True)]
        check = compare_canary(canary, tokens, logprobs)
        self.canary_checks += 1
        self.canary_errors[name] = check.error
        try:
            check_canary(name, check, self.canary_tolerance)
        except CanaryMismatch as exc:
            self._refuse(name, str(exc), check.error)
            raise
        log.info("%s: canary matched (%s)", name, check.detail)

    def _refuse(self, name: str, why: str, error: float) -> None:
        self.canary_failures += 1
        self.canary_errors[name] = error
        self._refused[name] = why
        log.error("%s", why)

    def canary_stats(self) -> dict[str, Any]:
        """Canary metrics of this replica: checks, failures, probe seconds, each checked version's error."""
        return {
            "canary_checks": self.canary_checks,
            "canary_failures": self.canary_failures,
            "canary_seconds": self.canary_seconds,
            "canary_errors": dict(self.canary_errors),
            "canary_refused": sorted(self._refused),
        }

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
