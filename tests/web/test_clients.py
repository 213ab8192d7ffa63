"""The web app's own PolicyServer: started once, off the request path, never taken from a game in play."""

from __future__ import annotations

import contextlib
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diprl.web import start_web
from diprl.web.clients import LocalPolicyClients, ServerStarting
from diprl.web.play import PlayError, PlayRoom, PlaySetup
from tests.web.conftest import POWERS, FakePolicyClients, RunTree

HUMAN = "FRANCE"


class FakeServers:
    """Stands in for `diprl.evaluate.local_policy_client`: records which stores were served and closed, and
    holds every start at `gate` until the test opens it (a real start takes a minute and a half here)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.opened: list[Path] = []
        self.closed: list[Path] = []
        self.failures = 0  # starts that fail before this many have been tried

    @contextlib.contextmanager
    def __call__(self, config: Any) -> Iterator[Any]:
        root = Path(config.adapters)
        self.opened.append(root)
        assert self.gate.wait(120), "the test never opened the gate"
        if len(self.opened) <= self.failures:
            raise RuntimeError("vLLM could not start (test)")
        try:
            yield FakePolicyClients()(root)
        finally:
            self.closed.append(root)


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> FakeServers:
    import diprl.evaluate

    fake = FakeServers()
    monkeypatch.setattr(diprl.evaluate, "local_policy_client", fake)
    return fake


def _setup(adapters: Path | None, run: str | None = None) -> PlaySetup:
    seats = {p: ("base" if p == "ENGLAND" else "bot:random") for p in POWERS if p != HUMAN}
    return PlaySetup(HUMAN, {**seats, HUMAN: "human"}, 1901, run, adapters)


def _wait_ready(clients: LocalPolicyClients, adapters: Path | None) -> None:
    for _ in range(600):
        with contextlib.suppress(Exception):
            clients(adapters)
            return
        threading.Event().wait(0.05)
    raise AssertionError("the PolicyServer never became ready")


def test_a_game_on_another_runs_adapters_never_takes_the_server_of_a_game_in_play(
    tmp_path: Path, servers: FakeServers
) -> None:
    """Found by review (N9): a game on run B's versions tore down the PolicyServer a game on run A was
    playing on (one server at a time). While A's game is in play, B's is refused, saying why."""
    run_a, run_b = tmp_path / "a" / "adapters", tmp_path / "b" / "adapters"
    clients = LocalPolicyClients(tmp_path / "empty")
    now = [0.0]
    room = PlayRoom(tmp_path / "runs", clients, idle_s=600.0, clock=lambda: now[0])
    try:
        first = room.start(_setup(run_a, "a"))
        _wait_ready(clients, run_a)
        with pytest.raises(PlayError, match=rf"serves run a's .*{first.game_id}") as refused:
            room.start(_setup(run_b, "b"))
        assert refused.value.status == 409
        assert servers.closed == [] and servers.opened == [run_a.resolve()]
        assert clients(run_a) is not None  # A's game goes on with its server
        now[0] += 601.0  # A's game left idle past idle_s: evicted, its server may go
        room.start(_setup(run_b, "b"))
        _wait_ready(clients, run_b)
        assert servers.closed == [run_a.resolve()] and servers.opened[-1] == run_b.resolve()
    finally:
        clients.close()


def test_games_in_play_are_bounded_per_server_and_idle_ones_evicted(tmp_path: Path, servers: FakeServers) -> None:
    """Found by review (N7): play sessions were never evicted and nothing bounded them."""
    clients = LocalPolicyClients(tmp_path / "empty")
    now = [0.0]
    room = PlayRoom(tmp_path / "runs", clients, max_llm_sessions=2, idle_s=60.0, clock=lambda: now[0])
    try:
        games = [room.start(_setup(None)) for _ in range(2)]
        with pytest.raises(PlayError, match="2 games with LLM seats") as refused:
            room.start(_setup(None))
        assert refused.value.status == 429
        now[0] += 30.0
        room.get(games[1].game_id)  # touched: stays
        now[0] += 31.0
        room.start(_setup(None))  # the first game idled past 60 s and left
        with pytest.raises(PlayError, match="no game"):
            room.get(games[0].game_id)
        assert room.get(games[1].game_id) is games[1]
    finally:
        clients.close()


def test_a_failed_start_is_reported_once_and_the_next_request_starts_it_again(
    tmp_path: Path, servers: FakeServers
) -> None:
    """N7: each waiting request used to retry a failed start in turn, holding the lock. Now one start runs at
    a time, its failure is told to the next caller, and the call after that starts the server again."""
    servers.failures = 1
    servers.gate.clear()  # the first start is held until both prepares ran: it fails only after them
    clients = LocalPolicyClients(tmp_path / "empty")
    try:
        clients.prepare(None)
        clients.prepare(None)  # already starting: not a second start
        servers.gate.set()
        messages = []
        for _ in range(600):
            try:
                clients(None)
                break
            except ServerStarting as exc:
                messages.append(str(exc))
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the PolicyServer never became ready")
        assert sum("failed to start (RuntimeError: vLLM could not start (test))" in m for m in messages) == 1
        assert len(servers.opened) == 2
    finally:
        clients.close()


def _post(url: str, form: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), method="POST")

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    try:
        with urllib.request.build_opener(NoRedirect()).open(request, timeout=180) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return -1


def test_the_runs_api_answers_while_the_policy_server_starts(run_tree: RunTree, servers: FakeServers) -> None:
    """Found by review (N7): 40 games waiting for a PolicyServer made `GET /api/runs` take 27 s: each start
    held one of Starlette's worker threads while the factory's lock was held for the whole vLLM start. The
    start now runs once, on a thread of its own; a new game is created at once and pages stay free."""
    servers.gate.clear()
    clients = LocalPolicyClients(run_tree.runs_dir / "empty")
    web = start_web(run_tree.runs_dir, port=0, client_factory=clients)
    form = {"human": HUMAN, "max_year": "1901", "run": ""} | {
        f"seat:{p}": ("base" if p == "ENGLAND" else "bot:random") for p in POWERS if p != HUMAN
    }
    statuses: list[int] = []
    posts = [threading.Thread(target=lambda: statuses.append(_post(web.url + "play", form))) for _ in range(45)]
    try:
        for post in posts:
            post.start()
        with urllib.request.urlopen(web.url + "api/runs", timeout=30) as response:  # raises if it hangs
            assert response.status == 200
        for post in posts:
            post.join(60)
        assert len(statuses) == 45 and set(statuses) <= {303, 429}, statuses
        assert len(servers.opened) == 1  # one start, however many games asked for it
    finally:
        servers.gate.set()
        for post in posts:
            post.join(60)
        web.stop()
        clients.close()
