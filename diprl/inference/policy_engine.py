"""PolicyEngine: vLLM's async engine serving the base model and many LoRA versions at once.

Each request names its policy (`base`, `<policy>@v<N>` or a shipped `zoo:<name>`) and, for constrained
decoding, its legal orders; requests for different adapters share the engine's batches. The Ray Serve
deployment around the engine is `diprl.inference.server`, its deployment on a cluster `diprl.inference.deploy`.

The adapters it holds (versions loaded on first use, verified, kept in an LRU; zoo entries) are
`diprl.inference.engine_adapters`. A bad request (unknown or malformed version, corrupt or incompatible
adapter, malformed legal orders) fails alone with a clear error in its result; it never fails the batch
or the replica.

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
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from diprl.game.legal import PowerOrders
from diprl.inference.adapters import BASE, AdapterError, AdapterStore, AdapterVersion, CorruptAdapter
from diprl.inference.canary import CANARY_FILE, Canary, CanaryMismatch, CorruptCanary, ReplicaCanaries
from diprl.inference.concurrency import Occupancy
from diprl.inference.config import ServerConfig
from diprl.inference.engine import order_sampling_params, sampled_logprobs, start_async_engine
from diprl.inference.engine_adapters import EngineAdapters
from diprl.inference.engine_adapters import error_text as _error
from diprl.inference.logits_processor import constraint_args
from diprl.inference.requests import (
    EngineLimits,
    RequestError,
    ValidRequest,
    check_prompt_length,
    validate_batch,
    validate_request,
)
from diprl.messages import Generation, GenerationRequest
from diprl.policy.constraint import OrderConstraint, ReasoningOptions
from diprl.policy.parser import legal_complete, parse_orders

log = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT_S = 30.0
# Prompts whose token ids are kept: the forks of a decision send one prompt several times at once, and
# tokenising was a quarter of the replica's CPU in a `+experiment=random` run (docs/inference.md).
PROMPT_CACHE_SIZE = 1024

__all__ = ["HEALTH_CHECK_TIMEOUT_S", "PolicyEngine", "resolve_model"]


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(local model path, dtype) for a preset name or a checkpoint path (looked up: entry points build it)."""
    from diprl.policy.models import known_presets, load_preset, resolve_model_path

    if config.model in known_presets():
        preset = load_preset(config.model)
        return str(resolve_model_path(preset)), config.dtype or preset.dtype
    return config.model, config.dtype or "auto"


class PolicyEngine:
    """The async vLLM engine plus adapter management; the deployment is a thin shell around it."""

    adapters_class: type[EngineAdapters] = EngineAdapters  # a fault-injecting one in the canary bench and tests

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
        self.canaries = ReplicaCanaries()
        self.adapters = self.adapters_class(
            config, self.engine, model_path, self.store, self.canaries, self._check_canary, self._note_engine_failure
        )
        self.dead: str | None = None  # why the engine is unusable; health checks fail from then on
        self.failed_requests = 0
        self.occupancy = Occupancy()
        # Text -> ids is a pure function of the tokenizer, kept for the last PROMPT_CACHE_SIZE prompts.
        self._prompt_ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._prompt_lock = threading.Lock()

    def _encode(self, prompt: str) -> tuple[int, ...]:
        """The prompt's token ids, tokenised once however many requests send it. `prepare` runs in threads
        and a decision's forks arrive together: a second thread asking for a prompt being tokenised waits
        for it under the lock instead of tokenising it again."""
        with self._prompt_lock:
            ids = self._prompt_ids.get(prompt)
            if ids is None:
                ids = tuple(self.tokenizer.encode(prompt))
                self._prompt_ids[prompt] = ids
                if len(self._prompt_ids) > PROMPT_CACHE_SIZE:
                    self._prompt_ids.popitem(last=False)
            else:
                self._prompt_ids.move_to_end(prompt)
            return ids

    # ------------------------------------------------------------ canaries

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
            why = f"{name}: its canary cannot be served ({_error(exc)}); refused"
            self.canaries.refuse(name, why, math.inf)
            log.error("%s", why)
            raise CanaryMismatch(why) from None
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
            self.canaries.seconds += time.perf_counter() - started
        tokens = [list(f.outputs[0].token_ids) for f in finals]
        logprobs = [sampled_logprobs(t, f.outputs[0].logprobs) for t, f in zip(tokens, finals, strict=True)]
        try:
            detail = self.canaries.judge(name, canary, tokens, logprobs)
        except CanaryMismatch as exc:
            log.error("%s", exc)
            raise
        log.info("%s: canary matched (%s)", name, detail)

    # ---------------------------------------------------------- generation
    def _note_engine_failure(self, exc: BaseException) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or getattr(self.engine, "errored", False):
            if self.dead is None:
                log.error("the vLLM engine died (%s); this replica reports unhealthy until replaced", _error(exc))
            self.dead = self.dead or _error(exc)

    def prepare(self, request: ValidRequest) -> tuple[list[int], Any]:
        """Token ids and sampling parameters for a valid request; raises `RequestError`."""
        from vllm.sampling_params import RequestOutputKind

        if isinstance(request.prompt, str):
            prompt_ids = list(self._encode(request.prompt))
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
        # One output at the end: `_run` reads only the last, and a streamed output per token per request
        # was a sixth of the replica's CPU.
        params = order_sampling_params(
            request.temperature, request.max_tokens, extra, output_kind=RequestOutputKind.FINAL_ONLY
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
            lora = await self.adapters.acquire(request.policy)
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
            await self.adapters.release(lora)
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
            self.adapters.private.close()
