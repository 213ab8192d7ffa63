"""Where LLM seats get their orders when the web app runs on its own: a local PolicyServer, started lazily.

`python -m diprl.web` starts nothing heavy: most games are against bots, and a page must never wait for
vLLM. The first game with LLM seats starts a local Ray (loopback) and the PolicyServer through
`diprl.evaluate.local_policy_client`, the same set-up `python -m diprl.evaluate` uses, serving the
adapter store of the run the game names (an empty store for `base` alone), on the model of the game's zoo
entries when it seats some. One server at a time (a PolicyServer serves one store and one model, and two
vLLM engines do not fit a small machine), so:

- the start runs once, on a thread of its own (`prepare`), never on a request's: the game is created at
  once, and its LLM seats are answered once the server is up (`__call__` says it is still starting until
  then, and nothing of the game moves). The lock is held only to read and change the state, never while
  Ray or vLLM start, so pages keep answering; a failed start is reported once, and the next game or move
  that needs the server starts it again (one start at a time, never one per waiting request);
- a game on another store or model is refused (`ServerInUse`, naming the games) while a game in play
  uses the running server (`in_use`, from the `PlayRoom`), instead of tearing that game's server down.

Ray is started and shut down on that one thread: a Ray started on one thread and shut down from another
lost its GCS connection here and aborted the process a minute later. Ray's C++ failure-signal handler is
left out (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER`): it takes SIGTERM from the app's own handler and aborts,
where the app should stop the PolicyServer and exit. `close` tears it down.

Started beside a training run, the app takes the caller's factory instead: `RunServerClients`, the run's
own PolicyServer (no second Ray), which serves that run's adapters and the base model and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diprl.rollout.clients import PolicyClient
from diprl.web.play import ServerInUse

Served = tuple[Path, str]
"""What a PolicyServer serves: an adapter store (resolved) and a model preset ("": the server file's)."""


class ServerStarting(RuntimeError):
    """The PolicyServer for these seats is starting (or failed to and will be started again): try shortly."""


class LocalPolicyClients:
    """A callable `adapters -> PolicyClient` that owns at most one local Ray + PolicyServer at a time."""

    def __init__(self, empty_store: Path, server: str = "local") -> None:
        self.empty_store = empty_store  # served when a game's LLM seats are all `base`
        self.server = server  # conf/inference/<name>.yaml
        self._lock = threading.Lock()  # guards the fields below; never held while a server starts or stops
        self._ray_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diprl-web-ray")
        self._stack: contextlib.ExitStack | None = None
        self._served: Served | None = None  # what runs, or is starting
        self._client: PolicyClient | None = None  # None while starting
        self._error: str | None = None  # why the last start failed

    def served(self, adapters: Path | None, model: str = "") -> Served:
        return (adapters or self.empty_store).resolve(), model

    def prepare(self, adapters: Path | None, model: str = "", in_use: Collection[Served] = ()) -> None:
        """Have the server for (`adapters`, `model`) running or starting, without waiting for it.

        `ServerInUse` when another store's or model's server is up and a game in play uses it (`in_use`).
        """
        wanted = self.served(adapters, model)
        with self._lock:
            if self._served == wanted and self._error is None:
                return
            serving_games = self._served in in_use and self._error is None  # a failed server holds nothing
            if self._served is not None and self._served != wanted and serving_games:
                root, served_model = self._served
                raise ServerInUse(
                    f"the PolicyServer is serving {root}{f' on {served_model}' if served_model else ''} for games "
                    "in play, and it serves one store and one model at a time"
                )
            self._served, self._client, self._error = wanted, None, None
            self._ray_thread.submit(self._open, wanted)

    def __call__(self, adapters: Path | None, model: str = "") -> PolicyClient:
        """The client for (`adapters`, `model`) once its server is up; `ServerStarting` until then."""
        wanted = self.served(adapters, model)
        with self._lock:
            if self._served == wanted and self._client is not None:
                return self._client
            if self._served == wanted and self._error is not None:
                error, self._served = self._error, None  # reported once; the next call starts it again
                raise ServerStarting(f"the PolicyServer failed to start ({error}); it will be started again")
            starting = self._served == wanted
        if not starting:
            self.prepare(adapters, model)
        raise ServerStarting(
            "the PolicyServer for these seats is starting (about a minute and a half on 2 cores); try again shortly"
        )

    def _open(self, served: Served) -> None:
        from diprl.eval.config import EvaluateConfig
        from diprl.evaluate import local_policy_client

        root, model = served
        with self._lock:
            if self._served != served:
                return  # superseded before it began
        self._close_stack()
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        stack = contextlib.ExitStack()
        try:
            root.mkdir(parents=True, exist_ok=True)
            client = stack.enter_context(
                local_policy_client(
                    EvaluateConfig(adapters=str(root), server=self.server, served_model=model, progress=False)
                )
            )
        except BaseException as exc:
            stack.close()
            with self._lock:
                if self._served == served:
                    self._error = f"{type(exc).__name__}: {exc}"[:500]
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            self._stack = stack
            if self._served == served:
                self._client = client

    def _close_stack(self) -> None:
        with self._lock:
            stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        with self._lock:
            self._served = None
        self._ray_thread.submit(self._close_stack).result()
        self._ray_thread.shutdown()


class RunServerClients:
    """`adapters -> PolicyClient` for an app beside a training run: every LLM seat goes to the run's server.

    `make_client` builds the client once, on the first LLM seat (in the training driver:
    `lambda: ServeClient(app_name=<the run's Serve app>)`). Versions of another run's store are refused
    with a message saying where to play them: this server cannot load them.
    """

    def __init__(self, adapters: Path, make_client: Callable[[], PolicyClient]) -> None:
        self.adapters = adapters.resolve()
        self.make_client = make_client
        self._lock = threading.Lock()
        self._client: PolicyClient | None = None

    def __call__(self, adapters: Path | None, model: str = "") -> PolicyClient:
        if model:
            raise ValueError(
                "zoo entries play on a model of their own: play them with `python -m diprl.web` on its own (it "
                "starts a PolicyServer for their model), not beside a training run"
            )
        if adapters is not None and adapters.resolve() != self.adapters:
            raise ValueError(
                f"this app runs beside the training run whose PolicyServer serves {self.adapters}; versions from "
                f"{adapters} need `python -m diprl.web` on its own (it starts a PolicyServer for them)"
            )
        with self._lock:
            if self._client is None:
                self._client = self.make_client()
            return self._client
