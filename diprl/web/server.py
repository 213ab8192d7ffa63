"""Running the app: `start_web` (a background thread, for the training entry point and tests) and `serve`
(the foreground command, `python -m diprl.web`).

The listening socket is bound here, before uvicorn starts, so a port in use or a refused address is an
`OSError` at once (not a log line in a thread) and port 0 gives a free port whose number is known. The
token rule (`diprl.web.auth.resolve_token`) is applied before anything is bound. Given a certificate and
its key (`certfile`, `keyfile`), the app speaks HTTPS itself; otherwise put a TLS proxy in front of an
address other machines reach (docs/security.md).
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from diprl.rollout.clients import PolicyClient
from diprl.web.auth import is_loopback, resolve_token, token_source

if TYPE_CHECKING:
    import uvicorn

ClientFactory = Callable[[Path | None, str], PolicyClient]
"""`adapters -> PolicyClient`: answers LLM seats of games whose versions live in that adapter store
(None: `base` only). Beside a training run: the run's own PolicyServer client."""


@dataclass(frozen=True)
class Tls:
    """A certificate chain and its private key (PEM files) for serving HTTPS."""

    certfile: Path
    keyfile: Path


@dataclass
class WebHandle:
    """A running app. `url` is its address; `login_url` adds the token (what to open the first time)."""

    url: str
    login_url: str
    thread: threading.Thread
    server: uvicorn.Server
    on_stop: Callable[[], None] | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to finish its requests and exit; then tear down what it started (a PolicyServer)."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.on_stop is not None:
            self.on_stop()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"the web app cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _address(host: str, sock: socket.socket, token: str | None, tls: Tls | None = None) -> tuple[str, str]:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls else 'http'}://{shown}:{port}/"
    return url, (f"{url}?token={token}" if token else url)


def _server(
    runs_dir: Path,
    host: str,
    token: str | None,
    client_for: ClientFactory,
    poll_s: float = 5.0,
    tls: Tls | None = None,
) -> uvicorn.Server:
    import uvicorn

    from diprl.web.app import WebConfig, create_app

    config = WebConfig(runs_dir=Path(runs_dir), token=token, poll_s=poll_s, exposed=not is_loopback(host))
    app = create_app(config, client_for)
    return uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=str(tls.certfile) if tls else None,
            ssl_keyfile=str(tls.keyfile) if tls else None,
        )
    )


def _default_clients(runs_dir: Path) -> tuple[ClientFactory, Callable[[], None]]:
    from diprl.cache import cache_root
    from diprl.web.clients import LocalPolicyClients

    clients = LocalPolicyClients(cache_root() / "web" / "no-adapters")
    return clients, clients.close


def start_web(
    runs_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    client_factory: ClientFactory | None = None,
    poll_s: float = 5.0,
) -> WebHandle:
    """Start the app in a daemon thread beside the caller (a training run) and return its handle.

    `client_factory` answers LLM seats of games played in the browser: beside a run, `RunServerClients`
    over the run's own PolicyServer; without one, the first LLM seat starts a local Ray + PolicyServer
    (`diprl.web.clients.LocalPolicyClients`, stopped by `.stop()`). Raises
    `TokenRequired` for a non-loopback host without a token and `OSError` when the port is taken.
    `poll_s`: how often the runs page asks for new metrics while a run goes.
    """
    token = resolve_token(host, token)
    on_stop = None
    if client_factory is None:
        client_factory, on_stop = _default_clients(Path(runs_dir))
    sock = bind(host, port)
    server = _server(Path(runs_dir), host, token, client_factory, poll_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="diprl-web", daemon=True)
    thread.start()
    url, login = _address(host, sock, token)
    return WebHandle(url=url, login_url=login, thread=thread, server=server, on_stop=on_stop)


def serve(
    runs_dir: Path,
    host: str,
    port: int,
    token_file: Path | None,
    announce: Callable[[str, str | None], None],
    tls: Tls | None = None,
) -> None:
    """Run the app in the foreground until Ctrl-C or SIGTERM, then stop what it started (a PolicyServer).

    The token comes from `token_file` or `$DIPRL_WEB_TOKEN`, never from the command line (`ps` shows every
    account the command line); `announce(url, where)` is told the address and where the token is (None:
    no token), never the token itself.

    uvicorn finishes the requests in flight and then raises the signal again; both signals become a
    KeyboardInterrupt here (SIGTERM's default would end the process before the PolicyServer is stopped).
    """
    token = resolve_token(host, None, token_file)
    if tls is not None:
        for path in (tls.certfile, tls.keyfile):
            if not path.is_file():
                raise OSError(errno.ENOENT, f"no TLS file {path}")
    client_factory, on_stop = _default_clients(runs_dir)
    sock = bind(host, port)
    server = _server(runs_dir, host, token, client_factory, tls=tls)
    url, _ = _address(host, sock, token, tls)
    announce(url, token_source(token_file) if token else None)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        on_stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
