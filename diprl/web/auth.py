"""Who may talk to the web app: loopback by default; any other address only with a token.

The app shows a run's configuration and games and starts games that spend the machine's time, so it
listens on 127.0.0.1 unless told otherwise, and binding any other address (0.0.0.0, a LAN address, a
host name) refuses to start without a token (a file named by `--token-file`, or `DIPRL_WEB_TOKEN`: never a
command-line word, which every account sees in `ps`). With a token, on any
address, every request must carry it: an `Authorization: Bearer <token>` or `X-Diprl-Token` header, or
the `diprl_token` cookie. A first visit to `...?token=<token>` sets that cookie (HttpOnly, SameSite=Strict)
and redirects to the same address without the token, so it stays out of the history and of links.
Tokens are compared in constant time.

Two more checks keep other web pages out of a server on loopback: a form posted from another origin
(its `Origin` header names another host than the request's `Host`) is refused, so a page elsewhere cannot
start games here; and without a token, a request whose `Host` is not a loopback name is refused, so a DNS
name rebound to 127.0.0.1 cannot read the pages either.

Every response also says that no other site may frame it (`X-Frame-Options: DENY` and the content
security policy's `frame-ancestors 'none'`: a framed play form could be clicked through a decoy) and
that the pages run only this origin's scripts (`SecurityHeaders`, `CONTENT_SECURITY_POLICY`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diprl.ports import is_loopback

TOKEN_ENV = "DIPRL_WEB_TOKEN"
COOKIE = "diprl_token"
HEADER = "x-diprl-token"
MIN_TOKEN_CHARS = 16


CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",  # /static/app.js only: the templates hold no inline script or handler
        "style-src 'self' 'unsafe-inline'",  # style attributes (heatmap cells, chart legends) and the boards' SVG
        "img-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),  # browsers without frame-ancestors
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """ASGI middleware: `SECURITY_HEADERS` on every HTTP response, refusals and static files included
    (the outermost layer, so responses of the token and origin guards carry them too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in SECURITY_HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class TokenRequired(ValueError):
    """The address needs a token and none was given, or the token is too short to protect anything."""


def read_token_file(path: Path) -> str:
    """The first line of `path` (the web token); `TokenRequired` naming the file when it cannot be read."""
    try:
        with open(path.expanduser(), "rb") as fh:
            raw = fh.read(4096)
    except OSError as exc:
        raise TokenRequired(f"cannot read the token file {path}: {exc.strerror}") from None
    return raw.decode("utf-8", "replace").strip().split("\n", 1)[0].strip()


def token_source(token_file: Path | None) -> str:
    """Where the token came from, for the start-up line (never the token itself)."""
    return f"token in {token_file}" if token_file is not None else f"token in ${TOKEN_ENV}"


def resolve_token(host: str, token: str | None, token_file: Path | None = None) -> str | None:
    """The token the server will demand (`token`, else the first line of `token_file`, else
    `$DIPRL_WEB_TOKEN`); `TokenRequired` off loopback without one."""
    if token is None and token_file is not None:
        token = read_token_file(token_file)
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise TokenRequired(
            f"the web token must be at least {MIN_TOKEN_CHARS} characters (e.g. {secrets.token_urlsafe(24)})"
        )
    if token is None and not is_loopback(host):
        raise TokenRequired(
            f"refusing to listen on {host} without a token: anyone who reaches that address could use the app. "
            f"Give one in a file (--token-file, mode 0600) or {TOKEN_ENV} (e.g. {secrets.token_urlsafe(24)}), or "
            "listen on 127.0.0.1"
        )
    return token


def _presented(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get(HEADER) or request.cookies.get(COOKIE)


Dispatch = Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]


def token_guard(token: str) -> Dispatch:
    """An HTTP middleware's dispatch (`BaseHTTPMiddleware`): refuse every request without `token`."""
    expected = token.encode()

    def ok(value: str | None) -> bool:
        return value is not None and secrets.compare_digest(value.encode(), expected)

    async def dispatch(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if ok(_presented(request)):
            return await call_next(request)
        if ok(request.query_params.get("token")):
            if request.method in ("GET", "HEAD"):
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                response: Response = RedirectResponse(request.url.path + (f"?{urlencode(rest)}" if rest else ""), 303)
            else:
                response = await call_next(request)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
            return response
        return PlainTextResponse(
            "401: this diprl web server needs its token. Open its address once with ?token=<the token> added, or "
            "send an 'Authorization: Bearer <token>' header. The token is in the file given as --token-file or in "
            f"{TOKEN_ENV}.",
            status_code=401,
        )

    return dispatch


def origin_guard(loopback_hosts_only: bool) -> Dispatch:
    """Refuse cross-origin form posts, and (`loopback_hosts_only`) any `Host` that is not a loopback name."""

    async def dispatch(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        host = request.headers.get("host", "")
        if loopback_hosts_only and not is_loopback(urlsplit(f"//{host}").hostname or ""):
            return PlainTextResponse(
                f"403: this server answers only on a loopback address, not {host[:80]!r} (a rebound DNS name?)",
                status_code=403,
            )
        origin = request.headers.get("origin")
        if request.method not in ("GET", "HEAD", "OPTIONS") and origin and urlsplit(origin).netloc != host:
            return PlainTextResponse(f"403: a form from {origin[:80]!r} may not act on this server", status_code=403)
        return await call_next(request)

    return dispatch
