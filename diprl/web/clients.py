"""Where LLM seats get their orders when the web app runs on its own: a local PolicyServer, started lazily.

`python -m diprl.web` starts nothing heavy: most games are against bots, and a page must never wait for
vLLM. The first LLM seat of a game starts a local Ray (loopback) and the PolicyServer through
`diprl.evaluate.local_policy_client`, the same set-up `python -m diprl.evaluate` uses, serving the
adapter store of the run the game names (an empty store for `base` alone), on the model of the game's zoo
entries when it seats some. A game on another run's adapters or another model replaces it (one server at a
time: a PolicyServer serves one store and one model). `close` tears it down.
Ray is started and shut down on one thread of its own: a Ray started on one thread and shut down from
another lost its GCS connection here and aborted the process a minute later. Ray's C++ failure-signal
handler is left out (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER`): it takes SIGTERM from the app's own handler
and aborts, where the app should stop the PolicyServer and exit.

Started beside a training run, the app takes the caller's factory instead: `RunServerClients`, the run's
own PolicyServer (no second Ray), which serves that run's adapters and the base model and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diprl.rollout.clients import PolicyClient


class LocalPolicyClients:
    """A callable `adapters -> PolicyClient` that owns at most one local Ray + PolicyServer at a time."""

    def __init__(self, empty_store: Path, server: str = "local") -> None:
        self.empty_store = empty_store  # served when a game's LLM seats are all `base`
        self.server = server  # conf/inference/<name>.yaml
        self._lock = threading.Lock()
        self._ray_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diprl-web-ray")
        self._stack: contextlib.ExitStack | None = None
        self._root: Path | None = None
        self._model = ""  # the served preset ("": the server file's own), a zoo entry's for zoo seats
        self._client: PolicyClient | None = None

    def __call__(self, adapters: Path | None, model: str = "") -> PolicyClient:
        root = (adapters or self.empty_store).resolve()
        with self._lock:
            if self._client is not None and self._root == root and self._model == model:
                return self._client
            return self._ray_thread.submit(self._open, root, model).result()

    def _open(self, root: Path, model: str) -> PolicyClient:
        from diprl.eval.config import EvaluateConfig
        from diprl.evaluate import local_policy_client

        self._close()
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        root.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        try:
            client = stack.enter_context(
                local_policy_client(
                    EvaluateConfig(adapters=str(root), server=self.server, served_model=model, progress=False)
                )
            )
        except BaseException:
            stack.close()
            raise
        self._stack, self._root, self._model, self._client = stack, root, model, client
        return client

    def _close(self) -> None:
        stack, self._stack, self._root, self._client = self._stack, None, None, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        with self._lock:
            self._ray_thread.submit(self._close).result()
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
