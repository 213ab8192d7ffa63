"""The PolicyServer's OpenAI-compatible completions route, bounded so people and tools cannot crowd out training.

Rollout workers and the evaluator call the deployment's `generate` through a handle; the HTTP route
is for people and other tools. Both share one replica (Serve's `max_ongoing_requests` counts them
together), so the route is held to its own small share:

- who may call it is checked first (`diprl.inference.http_guard`: a JSON body, a loopback `Host` on
  loopback, no foreign `Origin`, the token when there is one), so a page in a browser cannot use it;
- the body is read against `max_body_bytes` before anything parses it (413, with the declared
  `Content-Length` refused before a byte is read), so a huge body costs neither memory nor time;
- at most `http_max_ongoing` completions run at once; one more is answered 429 at once instead of
  waiting, because a waiting request would hold one of the replica's slots that training needs;
- generation goes through the engine's `generate_one`, which validates and tokenises off the event
  loop, so a long prompt does not stall the handle path's streams either.

Every error is OpenAI-shaped JSON: `{"error": {"message": ..., "type": ...}}`. A caller learns what was
wrong with its request and the kind of any other failure, never the server's paths or a policy's version
list (an unknown adapter's error names the store and its versions): the full error goes to the server's
log (`public_error`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from diprl.inference.adapters import BASE
from diprl.inference.http_guard import RouteGuard, require_json
from diprl.messages import Generation, GenerationRequest

log = logging.getLogger(__name__)

Generate = Callable[[GenerationRequest], Awaitable[Generation]]
"""`PolicyEngine.generate_one`: one request in, one result out (never raises)."""


class CompletionBody(BaseModel):
    """Strict: JSON `true` is not a token id or a count, and unknown fields are an error (422)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = BASE
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0


OPENAPI_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": CompletionBody.model_json_schema()}}}
}
"""The body schema for the OpenAPI page: the route reads the raw body itself (to limit it first)."""


class BodyTooLarge(Exception):
    def __init__(self, size: int, limit: int, declared: bool) -> None:
        said = "declares" if declared else "sent more than"
        super().__init__(f"the request body {said} {size} bytes; this server takes at most {limit} (max_body_bytes)")


class BadContentLength(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read only while it stays within `limit` bytes (a declared length above it is refused unread)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadContentLength(f"Content-Length {declared[:40]!r} is not a byte count")
        if int(declared) > limit:
            raise BodyTooLarge(int(declared), limit, declared=True)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit, limit, declared=False)
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}}, headers=headers)


def status_of(error: str) -> int:
    """The HTTP status of a failed generation, from the error's kind (the text before the colon)."""
    if error.startswith("UnknownAdapter"):
        return 404
    if error.startswith("EngineDead"):
        return 503
    if error.startswith("Timeout"):
        return 504
    return 400


_ABOUT_THE_REQUEST = ("RequestError", "InvalidAdapterName", "Timeout", "ConstraintFailed")
"""Failures whose message describes the caller's own request (or its time budget): shown as they are."""


def public_error(error: str, model: str) -> str:
    """What an HTTP caller is told of a failed generation: the error itself when it is about the request,
    else its kind and a sentence without paths, versions or engine internals (those stay in the log)."""
    kind = error.split(":", 1)[0]
    model = model[:80]
    if kind in _ABOUT_THE_REQUEST:
        return error
    if kind == "UnknownAdapter":
        return f"UnknownAdapter: this server has no adapter {model!r} (GET /v1/models lists what it serves)"
    if kind in ("AdapterError", "CorruptAdapter", "IncompatibleAdapter"):
        return f"{kind}: adapter {model!r} cannot be served here; the server's log says why"
    if kind == "EngineDead":
        return "EngineDead: this replica's engine has died; Serve replaces it, retry"
    kind = kind if kind.isidentifier() and len(kind) <= 40 else "InternalError"  # an exception's class name
    return f"{kind}: the server failed to answer this request; its log says why"


class CompletionsRoute:
    """`POST /v1/completions` for one replica; holds the count of completions in flight."""

    def __init__(
        self, generate: Generate, max_body_bytes: int, max_ongoing: int, guard: RouteGuard | None = None
    ) -> None:
        self.generate = generate
        self.guard = guard  # None: only the JSON rule (unit tests of the route's other behaviour)
        self.max_body_bytes = max_body_bytes
        self.max_ongoing = max_ongoing
        self.ongoing = 0
        self.refused_busy = 0

    async def __call__(self, request: Request) -> Response:
        refused = self.guard.check_json(request) if self.guard is not None else require_json(request)
        if refused is not None:
            return refused
        if self.ongoing >= self.max_ongoing:
            self.refused_busy += 1
            return error_response(
                429,
                f"this replica already runs {self.max_ongoing} HTTP completions (http_max_ongoing); retry shortly",
                "rate_limit_error",
                **{"Retry-After": "1"},
            )
        self.ongoing += 1
        try:
            return await self._complete(request)
        finally:
            self.ongoing -= 1

    async def _complete(self, request: Request) -> Response:
        try:
            raw = await read_body(request, self.max_body_bytes)
        except BodyTooLarge as exc:
            return error_response(413, str(exc))
        except BadContentLength as exc:
            return error_response(400, str(exc))
        try:
            body = CompletionBody.model_validate(json.loads(raw))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            return error_response(400, f"the body is not JSON: {type(exc).__name__}: {exc}")
        except ValidationError as exc:
            return error_response(422, f"invalid completion request: {exc}")
        result = await self.generate(
            GenerationRequest(
                policy=body.model, prompt=body.prompt, max_tokens=body.max_tokens, temperature=body.temperature
            )
        )
        if result.error:
            log.warning("HTTP completion for %r failed: %s", body.model, result.error)
            return error_response(status_of(result.error), public_error(result.error, body.model))
        prompt_tokens, completion_tokens = len(result.prompt_ids), len(result.token_ids)
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [{"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )
