"""What the PolicyServer's HTTP route tells a caller when a completion fails: what was wrong with the request,
never where the server keeps its files (the full error goes to the server's log)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI

from diprl.inference.http_route import CompletionsRoute
from diprl.messages import Generation, GenerationRequest

STORE = "/home/alice/runs/secret-run/adapters"


def _answer(error: str) -> Generation:
    return Generation.failed("main@v9", error)


@pytest.mark.parametrize(
    ("error", "status", "shown"),
    [
        (f"UnknownAdapter: unknown adapter main@v9 in {STORE} (versions of 'main': main@v1, main@v2)", 404,
         "UnknownAdapter: this server has no adapter 'main@v9'"),
        (f"CorruptAdapter: main@v9: {STORE}/main/v9/adapter_model.safetensors does not match the SHA-256", 400,
         "CorruptAdapter: adapter 'main@v9' cannot be served"),
        (f"AdapterError: cannot write adapter main@v9 into {STORE}/cache: disk full", 400,
         "AdapterError: adapter 'main@v9' cannot be served"),
        (f"InternalError: FileNotFoundError: {STORE}/x", 400, "InternalError: the server failed to answer"),
        (f"EngineError: RuntimeError: CUDA error in {STORE}", 400, "EngineError: the server failed to answer"),
        (f"EngineDead: this replica's engine has died (RuntimeError: {STORE}); Serve replaces it, retry", 503,
         "EngineDead: this replica's engine has died"),
        ("RequestError: 'max_tokens' must be an int in [1, 256], got 0", 400,
         "RequestError: 'max_tokens' must be an int in [1, 256], got 0"),
        ("Timeout: no answer within 30 s (request_timeout_s)", 504, "Timeout: no answer within 30 s"),
    ],
)  # fmt: skip
def test_a_failed_completion_names_no_path_or_version_list_to_the_caller(
    error: str, status: int, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review (L4): an unknown adapter's error gave the HTTP caller the store's path and the policy's
    versions. The caller gets the kind of failure and its own request's words; the log keeps the rest."""

    async def generate(request: GenerationRequest) -> Generation:
        return _answer(error)

    app = FastAPI()
    app.post("/v1/completions")(CompletionsRoute(generate, 4096, 2).__call__)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", json={"model": "main@v9", "prompt": "A PAR"})

    with caplog.at_level(logging.WARNING, logger="diprl.inference.http_route"):
        response = asyncio.run(post())
    message = response.json()["error"]["message"]
    assert response.status_code == status
    assert message.startswith(shown)
    assert STORE not in message and "main@v1" not in message
    assert error in caplog.text  # the whole story, for whoever runs the server
