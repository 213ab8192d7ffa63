"""Who may call the PolicyServer's HTTP routes: the web app's rules, applied to `/v1/*`.

The route listens on 127.0.0.1 by default, which keeps other machines out but not other web pages
open in a browser on this one: a page elsewhere can POST `text/plain` to `http://127.0.0.1:8000/...`
without a CORS preflight, and a DNS name rebound to 127.0.0.1 makes the route same-origin with that
page. So, as `diprl.web.auth` does for the web app:

- a completion must be `application/json` (415 otherwise): a browser sends that type cross-site only
  after a preflight, which this server never grants;
- a request whose `Origin` names another host than its `Host` is refused (403);
- on loopback, a `Host` that is not a loopback name is refused (403: a rebound name);
- with a token, every request must carry it (`Authorization: Bearer <token>`, 401 otherwise), compared
  in constant time. A route opened off loopback (`allow_public_host`) should have one: it is read from
  the file `http_token_file` names, else from `$DIPRL_POLICY_TOKEN`, in each replica, so it never
  travels in the deployment's config (which the Ray dashboard shows).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse

from diprl.ports import is_loopback

TOKEN_ENV = "DIPRL_POLICY_TOKEN"
MIN_TOKEN_CHARS = 16
_MAX_TOKEN_BYTES = 4096


def route_token(token_file: str | None) -> str | None:
    """The token the route demands: the first line of `token_file`, else `$DIPRL_POLICY_TOKEN`, else None.

    `ValueError` for a file that cannot be read or a token under 16 characters (it would protect nothing).
    """
    if token_file:
        try:
            with open(Path(token_file).expanduser(), "rb") as fh:
                raw = fh.read(_MAX_TOKEN_BYTES)
        except OSError as exc:
            raise ValueError(f"cannot read the HTTP route's token file {token_file}: {exc.strerror}") from None
        token: str | None = raw.decode("utf-8", "replace").strip().split("\n", 1)[0].strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        where = token_file or f"${TOKEN_ENV}"
        raise ValueError(
            f"the HTTP route's token ({where}) must be at least {MIN_TOKEN_CHARS} characters "
            f"(e.g. {secrets.token_urlsafe(24)})"
        )
    return token


def refusal(status: int, message: str, kind: str, **headers: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}}, headers=headers)


@dataclass(frozen=True)
class RouteGuard:
    """The checks every request to the route passes before anything reads its body."""

    loopback_hosts_only: bool = True
    token: str | None = None

    def check(self, request: Request) -> JSONResponse | None:
        """None when `request` may go on; else the OpenAI-shaped refusal to send."""
        host = request.headers.get("host", "")
        if self.loopback_hosts_only and not is_loopback(urlsplit(f"//{host}").hostname or ""):
            return refusal(
                403,
                f"this server answers only on a loopback address, not {host[:80]!r} (a rebound DNS name?)",
                "permission_error",
            )
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != host:
            return refusal(403, f"a page from {origin[:80]!r} may not call this server", "permission_error")
        if self.token is not None:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return refusal(
                    401,
                    "this server needs its token: send 'Authorization: Bearer <token>' (the server's "
                    f"http_token_file or ${TOKEN_ENV})",
                    "authentication_error",
                    **{"WWW-Authenticate": "Bearer"},
                )
        return None

    def check_json(self, request: Request) -> JSONResponse | None:
        """`check`, and the body must be declared JSON (a cross-site form or `text/plain` post is not)."""
        refused = self.check(request)
        if refused is not None:
            return refused
        return require_json(request)


def require_json(request: Request) -> JSONResponse | None:
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        return refusal(
            415,
            f"the body must be sent as Content-Type: application/json, not {kind[:60] or 'none'!r}",
            "invalid_request_error",
        )
    return None
