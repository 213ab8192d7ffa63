"""What the PolicyServer's HTTP route tells a caller when a completion fails: what was wrong with the request,
never where the server keeps its files (the full error goes to the server's log)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from diprl.inference.http_guard import TOKEN_ENV, RouteGuard, route_token
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


# ---- who may call the route (N3, M4) ---------------------------------------------------------------------

TOKEN = "policy-token-0123456789abcdef"


def _guarded_app(guard: RouteGuard) -> tuple[FastAPI, list[GenerationRequest]]:
    seen: list[GenerationRequest] = []

    async def generate(request: GenerationRequest) -> Generation:
        seen.append(request)
        return Generation.failed(request.policy, "RequestError: fake engine")

    app = FastAPI()
    app.post("/v1/completions")(CompletionsRoute(generate, 4096, 2, guard=guard).__call__)
    return app, seen


def _post(app: FastAPI, base_url: str, **kwargs: object) -> httpx.Response:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as http:
            return await http.post("/v1/completions", **kwargs)  # type: ignore[arg-type]

    return asyncio.run(post())


BODY = '{"model": "base", "prompt": "A PAR"}'


def test_a_cross_site_text_plain_post_never_reaches_the_engine() -> None:
    """Found by review (N3): a page on another site could POST `text/plain` (no CORS preflight) to the route on
    127.0.0.1:8000 and spend the replica's time. The route takes JSON only and refuses a foreign Origin."""
    app, seen = _guarded_app(RouteGuard(loopback_hosts_only=True))
    plain = _post(app, "http://127.0.0.1:8000", content=BODY, headers={"Content-Type": "text/plain"})
    form = _post(
        app, "http://127.0.0.1:8000", content=BODY, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    foreign = _post(
        app,
        "http://127.0.0.1:8000",
        content=BODY,
        headers={"Content-Type": "application/json", "Origin": "https://evil.example"},
    )
    assert plain.status_code == 415 and form.status_code == 415
    assert "application/json" in plain.json()["error"]["message"]
    assert foreign.status_code == 403
    assert seen == []
    same = _post(
        app, "http://127.0.0.1:8000", content=BODY, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert same.status_code == 400 and len(seen) == 1  # reached the (fake) engine


def test_a_loopback_route_refuses_a_host_that_is_not_loopback() -> None:
    """Found by review (N3): any `Host` was served, so a DNS name rebound to 127.0.0.1 could read and use it."""
    app, seen = _guarded_app(RouteGuard(loopback_hosts_only=True))
    rebound = _post(app, "http://attacker.example:8000", content=BODY, headers={"Content-Type": "application/json"})
    assert rebound.status_code == 403 and seen == []
    for base in ("http://localhost:8000", "http://[::1]:8000", "http://127.0.0.1"):
        assert _post(app, base, content=BODY, headers={"Content-Type": "application/json"}).status_code == 400


def test_a_route_opened_off_loopback_can_demand_a_bearer_token() -> None:
    """Found by review (old M4): `allow_public_host` opened the route with no credential at all."""
    app, seen = _guarded_app(RouteGuard(loopback_hosts_only=False, token=TOKEN))
    json_type = {"Content-Type": "application/json"}
    assert _post(app, "http://10.0.0.5:8000", content=BODY, headers=json_type).status_code == 401
    wrong = {**json_type, "Authorization": "Bearer not-the-token-at-all-xx"}
    assert _post(app, "http://10.0.0.5:8000", content=BODY, headers=wrong).status_code == 401
    assert seen == []
    right = {**json_type, "Authorization": f"Bearer {TOKEN}"}
    assert _post(app, "http://10.0.0.5:8000", content=BODY, headers=right).status_code == 400 and len(seen) == 1


def test_the_route_token_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert route_token(None) is None
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert route_token(str(secret)) == TOKEN
    monkeypatch.setenv(TOKEN_ENV, TOKEN[::-1])
    assert route_token(None) == TOKEN[::-1]
    secret.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        route_token(str(secret))
    with pytest.raises(ValueError, match="cannot read"):
        route_token(str(tmp_path / "missing"))
