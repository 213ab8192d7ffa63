"""Loopback by default; any other address needs a token, and then every request must carry it."""

from __future__ import annotations

import http.cookiejar
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from diprl.web import start_web
from diprl.web.__main__ import main
from diprl.web.auth import COOKIE, TOKEN_ENV, TokenRequired, is_loopback, resolve_token
from tests.web.conftest import FakePolicyClients, RunTree

TOKEN = "test-token-0123456789abcdef"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _headers(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {}, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.build_opener(_NoRedirect()).open(request, timeout=30) as response:
            return int(response.status), response.headers
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.headers


def _get(url: str, headers: dict[str, str] | None = None, opener: urllib.request.OpenerDirector | None = None) -> int:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.4", "10.0.0.1", "example.org", "localhost.example.org"):
        assert not is_loopback(host), host


def test_an_exposed_address_needs_a_token_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token("127.0.0.1", None) is None
    with pytest.raises(TokenRequired, match=r"refusing to listen on 0\.0\.0\.0 without a token"):
        resolve_token("0.0.0.0", None)
    assert resolve_token("0.0.0.0", TOKEN) == TOKEN
    with pytest.raises(TokenRequired, match="at least 16 characters"):
        resolve_token("0.0.0.0", "short")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert resolve_token("0.0.0.0", None) == TOKEN
    assert resolve_token("127.0.0.1", None) == TOKEN  # given a token, loopback demands it too


def test_start_and_the_command_refuse_an_exposed_address_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(TokenRequired):
        start_web(tmp_path, host="0.0.0.0", port=0, client_factory=FakePolicyClients())
    assert main(["--runs", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to listen on 0.0.0.0 without a token" in capsys.readouterr().err


def test_a_token_server_refuses_requests_without_it_and_serves_those_with_it(run_tree: RunTree) -> None:
    web = start_web(run_tree.runs_dir, port=0, token=TOKEN, client_factory=FakePolicyClients())
    try:
        assert web.login_url == f"{web.url}?token={TOKEN}"
        for path in ("", "league", "games", "play", "api/runs", "static/app.js"):
            assert _get(web.url + path) == 401, path
            assert _get(web.url + path, {"X-Diprl-Token": "wrong-token-0123456789"}) == 401, path
            assert _get(web.url + path, {"Authorization": f"Bearer {TOKEN}"}) == 200, path
            assert _get(web.url + path, {"X-Diprl-Token": TOKEN}) == 200, path
        # A first visit with ?token= sets the cookie and sends the browser to the address without it.
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar), _NoRedirect())
        assert _get(f"{web.url}league?token={TOKEN}", opener=opener) == 303
        assert [c.name for c in jar] == [COOKIE]
        assert _get(f"{web.url}league", opener=opener) == 200
        assert _get(f"{web.url}league?token=wrong-token-0123456789") == 401
    finally:
        web.stop()


def test_a_taken_port_is_a_clear_error(run_tree: RunTree) -> None:
    first = start_web(run_tree.runs_dir, port=0, client_factory=FakePolicyClients())
    try:
        port = int(first.url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            start_web(run_tree.runs_dir, port=port, client_factory=FakePolicyClients())
    finally:
        first.stop()


def test_the_command_serves_on_loopback_until_sigterm(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "diprl.web", "--runs", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("diprl web: http://127.0.0.1:"), line
        url = line.split()[2]
        assert _get(url) == 200 and _get(url + "play") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def _frame_policy(headers: Any) -> tuple[str | None, dict[str, str]]:
    csp = headers.get("Content-Security-Policy") or ""
    pairs = (part.strip().partition(" ") for part in csp.split(";") if part.strip())
    directives = {name: value for name, _, value in pairs}
    return headers.get("X-Frame-Options"), directives


def test_every_response_forbids_framing_and_foreign_scripts(run_tree: RunTree) -> None:
    """Found by review (N6): another site could frame the pages (clickjacking the play form). Every response,
    pages, JSON, static files, images, redirects and refusals alike, says no frame and only this origin's
    scripts (the pages have no inline script: see `test_the_templates_hold_no_inline_script`)."""
    open_web = start_web(run_tree.runs_dir, port=0, client_factory=FakePolicyClients())
    token_web = start_web(run_tree.runs_dir, port=0, token=TOKEN, client_factory=FakePolicyClients())
    try:
        answers = {
            path: _headers(open_web.url + path)
            for path in ("", "league", "games", "play", "api/runs", "static/app.js", "static/app.css", "nope")
        }
        answers["bad host"] = _headers(open_web.url, {"Host": "evil.example"})
        answers["cross-site post"] = _headers(open_web.url + "play", {"Origin": "http://evil.example"}, "POST")
        answers["no token"] = _headers(token_web.url)
        answers["login"] = _headers(f"{token_web.url}league?token={TOKEN}")
        statuses = {name: status for name, (status, _) in answers.items()}
        assert statuses == {
            **dict.fromkeys(("", "league", "games", "play", "api/runs", "static/app.js", "static/app.css"), 200),
            "nope": 404,
            "bad host": 403,
            "cross-site post": 403,
            "no token": 401,
            "login": 303,
        }
        for name, (_, headers) in answers.items():
            frame_options, csp = _frame_policy(headers)
            assert frame_options == "DENY", name
            assert csp.get("frame-ancestors") == "'none'", name
            assert csp.get("default-src") == "'self'" and csp.get("script-src") == "'self'", name
            assert csp.get("object-src") == "'none'" and csp.get("base-uri") == "'none'", name
            assert headers.get("X-Content-Type-Options") == "nosniff", name
    finally:
        open_web.stop()
        token_web.stop()


def test_a_server_error_carries_the_security_headers_too(run_tree: RunTree) -> None:
    """Found by review: Starlette answers an unhandled exception (500) from outside every middleware the app
    adds, so that one response went without the framing and script policy."""
    from starlette.testclient import TestClient

    from diprl.web.app import WebConfig, create_app

    app = create_app(WebConfig(runs_dir=run_tree.runs_dir), FakePolicyClients())

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
        response = http.get("/boom")
    assert response.status_code == 500
    frame_options, csp = _frame_policy(response.headers)
    assert frame_options == "DENY" and csp.get("frame-ancestors") == "'none'"
    assert response.headers.get("X-Content-Type-Options") == "nosniff"


def test_the_templates_hold_no_inline_script() -> None:
    """The pages' policy allows only scripts from /static: an inline handler or `javascript:` link would be
    blocked by the browser, so none may creep back in (a JSON data block is not a script)."""
    import re

    templates = Path(__file__).resolve().parents[2] / "diprl" / "web" / "templates"
    for page in sorted(templates.glob("*.html")):
        text = page.read_text()
        assert not re.search(r"\son[a-z]+\s*=", text), f"{page.name}: an inline event handler"
        assert "javascript:" not in text, f"{page.name}: a javascript: link"
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag or 'type="application/json"' in tag, f"{page.name}: inline script {tag}"


def _start_command(*args: str) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "diprl.web", "--port", "0", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def test_the_command_reads_its_token_from_a_file_and_prints_where_not_what(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (N13): `--token` put the token in every `ps` listing and the printed login URL put it
    in the terminal's scrollback. The command reads it from a file (or the environment) and says where."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    secret = tmp_path / "web-token"
    secret.write_text(TOKEN + "\n")
    proc, line = _start_command("--runs", str(tmp_path), "--token-file", str(secret))
    try:
        assert line.startswith("diprl web: http://127.0.0.1:"), line
        assert TOKEN not in line and str(secret) in line
        assert TOKEN not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        url = line.split()[2]
        assert _get(url) == 401
        assert _get(url, {"Authorization": f"Bearer {TOKEN}"}) == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert main(["--runs", str(tmp_path), "--port", "0", "--token", TOKEN]) == 2  # refused, with the reason


def test_the_command_serves_tls_with_a_given_certificate(tmp_path: Path) -> None:
    """N13: off loopback the token travels in every request; with a certificate the app speaks HTTPS itself."""
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    proc, line = _start_command("--runs", str(tmp_path), "--certfile", str(cert), "--keyfile", str(key))
    try:
        assert line.startswith("diprl web: https://127.0.0.1:"), line
        url = line.split()[2]
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(url, timeout=30, context=context) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
