"""Playing through HTTP: seats checked up front, orders only from the legal set, bad input changes nothing."""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from diprl.game import PhaseKind
from diprl.rollout.search import SearchConfig
from diprl.web.app import WebConfig, create_app
from diprl.web.clients import RunServerClients
from diprl.web.play import PlayError, PlaySession, check_orders
from tests.game.positions import position
from tests.web.conftest import POWERS, RUN, FakePolicyClients, RunTree

LOCAL = "http://127.0.0.1:8080"


@pytest.fixture
def clients() -> FakePolicyClients:
    return FakePolicyClients()


@pytest.fixture
def http(run_tree: RunTree, clients: FakePolicyClients) -> Iterator[TestClient]:
    app = create_app(WebConfig(runs_dir=run_tree.runs_dir), clients)
    with TestClient(app, base_url=LOCAL, follow_redirects=False) as client:
        yield client


def _form(human: str, max_year: int, run: str, **seats: str) -> dict[str, str]:
    form = {"human": human, "max_year": str(max_year), "run": run}
    return form | {f"seat:{p}": seats.get(p, "bot:random") for p in POWERS if p != human}


def _new_game(http: TestClient, human: str = "FRANCE", max_year: int = 1901, run: str = "", **seats: str) -> str:
    response = http.post("/play", data=_form(human, max_year, run, **seats))
    assert response.status_code == 303, response.text
    return str(response.headers["location"]).rsplit("/", 1)[1]


def _text(response: object) -> str:
    return html.unescape(response.text)  # type: ignore[attr-defined]


def _session(http: TestClient, game_id: str) -> PlaySession:
    return http.app.state.room.get(game_id)  # type: ignore[attr-defined]


def _moves(session: PlaySession) -> dict[str, str]:
    """A non-hold legal order for every unit (the first move each unit has)."""
    legal = session.legal()
    return {loc: next((o for o in orders if " - " in o), orders[0]) for loc, orders in legal.by_loc.items()}


def _submit(http: TestClient, game_id: str, phase: str, chosen: dict[str, str]) -> object:
    return http.post(f"/play/{game_id}/orders", data={"phase": phase} | {f"order:{k}": v for k, v in chosen.items()})


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"human": "NARNIA"}, "unknown power 'NARNIA'"),
        ({"seat:ENGLAND": "bot:genius"}, "unknown bot 'bot:genius'"),
        ({"seat:ENGLAND": "main@v01"}, "unknown PolicyRef"),
        ({"seat:ENGLAND": "main@v99", "run": RUN}, "main@v99 is not a published version of run"),
        ({"seat:ENGLAND": "main@v1"}, "choose the run whose adapters hold it"),
        ({"seat:ENGLAND": ""}, "no PolicyRef for ENGLAND"),
        ({"seat:NARNIA": "bot:random"}, "unknown power 'NARNIA' among the seats"),
        ({"max_year": "1800"}, "between 1901 and 1935"),
        ({"max_year": "soon"}, "must be a number"),
        ({"run": "nope"}, "unknown run 'nope'"),
        ({"seat:ENGLAND": "zoo:nothing"}, "unknown zoo entry 'zoo:nothing'"),
        ({"seat:ENGLAND": "zoo:best", "seat:GERMANY": "base"}, "play on different servers"),
        ({"search": "many"}, "search must be a number of candidates"),
        ({"search": "99"}, "search takes 0 to 32 candidates"),
    ],
)
def test_a_bad_seat_power_year_or_run_starts_nothing(
    http: TestClient, form: dict[str, str], message: str, run_tree: RunTree
) -> None:
    base = {"human": "FRANCE", "max_year": "1901", "run": ""} | {
        f"seat:{p}": "bot:random" for p in POWERS if p != "FRANCE"
    }
    saved = sorted((run_tree.runs_dir / "play").glob("*"))
    response = http.post("/play", data=base | form)
    assert response.status_code in (400, 404), response.text
    assert message in _text(response) and "Nothing was changed" in _text(response)
    assert not http.app.state.room.sessions  # type: ignore[attr-defined]
    assert sorted((run_tree.runs_dir / "play").glob("*")) == saved


def test_bad_orders_and_a_stale_phase_change_nothing(http: TestClient) -> None:
    game_id = _new_game(http)
    session = _session(http, game_id)
    legal = session.legal()

    def board() -> dict[str, object]:
        return {k: v for k, v in session.game.state().items() if k != "timestamp"}

    state = board()
    chosen = _moves(session)
    loc = legal.locs[0]
    cases = [
        ("F1901M", chosen, 409, "stale phase: these orders were for 'F1901M' but the game is at S1901M"),
        ("S1901M", chosen | {loc: f"{legal.by_loc[loc][0][:5]} - MOS"}, 400, "is not a legal order for"),
        ("S1901M", chosen | {"LON": "F LON - NTH"}, 400, "'LON' is not one of the units or sites"),
        ("S1901M", {k: v for k, v in chosen.items() if k != loc}, 400, f"no order for {loc}"),
    ]
    for phase, orders, status, message in cases:
        response = _submit(http, game_id, phase, orders)
        assert response.status_code == status, response.text  # type: ignore[attr-defined]
        assert message in _text(response)
        assert board() == state and not session.game.history
    response = _submit(http, game_id, "S1901M", chosen)
    assert response.status_code == 303  # type: ignore[attr-defined]
    assert session.game.phase == "F1901M"
    assert session.game.history[0].orders["FRANCE"] == tuple(sorted(chosen.values()))
    response = _submit(http, game_id, "S1901M", chosen)  # the same form sent again: stale
    assert response.status_code == 409 and len(session.game.history) == 1  # type: ignore[attr-defined]


def test_builds_and_disbands_take_only_what_the_phase_allows() -> None:
    builds = position({"FRANCE": ["A BUR"]}, phase="W1901A").legal_orders("FRANCE")
    assert builds.kind is PhaseKind.BUILD and builds.n_required == 2
    sites = {loc: orders[0] for loc, orders in builds.by_loc.items()}
    assert check_orders(builds, {loc: "" for loc in sites}) == []  # all waived
    two = dict(list(sites.items())[:2])
    assert check_orders(builds, two) == sorted(two.values())
    with pytest.raises(PlayError, match="allows 2 build"):
        check_orders(builds, sites)
    disbands = position(
        {"FRANCE": ["A PAR", "A MAR", "F BRE"]}, centres={"FRANCE": ["PAR"]}, phase="W1901A"
    ).legal_orders("FRANCE")
    assert disbands.kind is PhaseKind.DISBAND and disbands.n_required == 2
    one = {disbands.locs[0]: disbands.by_loc[disbands.locs[0]][0]}
    with pytest.raises(PlayError, match="must disband 2 unit"):
        check_orders(disbands, one)


def test_llm_seats_are_answered_through_the_client_with_the_runs_adapters(
    http: TestClient, clients: FakePolicyClients, run_tree: RunTree
) -> None:
    game_id = _new_game(http, run=RUN, ENGLAND="main@v2", GERMANY="base")
    session = _session(http, game_id)
    assert _submit(http, game_id, "S1901M", _moves(session)).status_code == 303  # type: ignore[attr-defined]
    [(adapters, requests, answers)] = clients.calls
    assert adapters == run_tree.run_dir / "adapters"
    assert sorted((r.policy, r.legal["power"]) for r in requests) == [("base", "GERMANY"), ("main@v2", "ENGLAND")]
    assert all(r.legal["phase"] == "S1901M" and "ENGLAND" in str(r.prompt) + "GERMANY" for r in requests)
    for request, answer in zip(requests, answers, strict=True):
        power = request.legal["power"]
        assert session.game.history[0].orders[power] == tuple(sorted(answer.orders)), power


def test_a_runs_best_version_is_offered_and_played_as_the_version_it_names(
    http: TestClient, clients: FakePolicyClients, run_tree: RunTree
) -> None:
    from diprl.inference.adapters import AdapterStore

    store = AdapterStore(run_tree.run_dir / "adapters")
    refused = http.post("/play", data=_form("FRANCE", 1901, RUN, ENGLAND="main@best"))  # nothing marked yet
    assert refused.status_code != 303 and "no version of 'main' is marked 'best'" in _text(refused)
    assert "main@best" not in _text(http.get("/play", params={"run": RUN}))
    store.set_alias("main", "best", "main@v2")
    try:
        assert '<option value="main@best"' in _text(http.get("/play", params={"run": RUN}))
        game_id = _new_game(http, run=RUN, ENGLAND="main@best")
        session = _session(http, game_id)
        assert _submit(http, game_id, "S1901M", _moves(session)).status_code == 303  # type: ignore[attr-defined]
        [request] = [r for _, requests, _ in clients.calls for r in requests if r.legal["power"] == "ENGLAND"]
        assert request.policy == "main@v2"  # the version the mark named when the game started
    finally:
        (run_tree.run_dir / "adapters" / "main" / "best.json").unlink()


def test_zoo_seats_are_answered_on_their_own_model(http: TestClient, clients: FakePolicyClients) -> None:
    from diprl.policy.zoo import load_entry

    game_id = _new_game(http, ENGLAND="zoo:best", GERMANY="zoo:best")
    session = _session(http, game_id)
    assert session.setup.model == load_entry("zoo:best").model
    assert _submit(http, game_id, "S1901M", _moves(session)).status_code == 303  # type: ignore[attr-defined]
    [(adapters, requests, _)] = clients.calls
    assert adapters is None and {r.policy for r in requests} == {"zoo:best"}
    assert set(clients.models) == {session.setup.model}
    assert "zoo:best" in http.get("/play").text


def test_searching_seats_send_their_whole_search_and_the_game_says_so(
    http: TestClient, clients: FakePolicyClients
) -> None:
    response = http.post("/play", data=_form("FRANCE", 1901, "", ENGLAND="zoo:best") | {"search": "8"})
    assert response.status_code == 303, response.text
    game_id = str(response.headers["location"]).rsplit("/", 1)[1]
    session = _session(http, game_id)
    assert session.setup.search == 8 and session.meta()["search"] == 8
    assert session.setup.search_config == SearchConfig.strongest(8)  # the bench's strongest, improvement included
    assert session.setup.search_config.improve_rounds > 0
    assert _submit(http, game_id, "S1901M", _moves(session)).status_code == 303  # type: ignore[attr-defined]
    [(_, requests, _)] = clients.calls
    # England's search: its own answer, 8 candidates, 4 samples of each of the six others, all from zoo:best.
    assert len(requests) == 1 + 8 + 6 * 4 and {r.policy for r in requests} == {"zoo:best"}
    assert session.game.history[0].orders["ENGLAND"]  # it played one of its candidates
    page = _text(http.get(f"/play/{game_id}"))
    assert "LLM seats search their moves: 8 candidates each" in page
    assert 'name="search"' in _text(http.get("/play"))


def test_a_server_that_cannot_answer_is_a_clear_error_and_the_phase_is_not_played(
    http: TestClient, clients: FakePolicyClients
) -> None:
    game_id = _new_game(http, ENGLAND="base")
    session = _session(http, game_id)
    clients.fail = True
    response = _submit(http, game_id, "S1901M", _moves(session))
    assert response.status_code == 400  # type: ignore[attr-defined]
    assert "could not answer the LLM seats (ENGLAND)" in _text(response) and "nothing was changed" in _text(response)
    assert session.game.phase == "S1901M" and not session.game.history
    clients.fail = False
    assert _submit(http, game_id, "S1901M", _moves(session)).status_code == 303  # type: ignore[attr-defined]


def test_a_finished_game_is_saved_as_a_replay_and_shown_on_the_games_page(http: TestClient, run_tree: RunTree) -> None:
    from diplomacy.utils.export import from_saved_game_format

    game_id = _new_game(http, max_year=1901)
    session = _session(http, game_id)
    while not session.finished:
        legal = session.legal()
        chosen = {loc: orders[0] for loc, orders in legal.by_loc.items()}
        if legal.kind in (PhaseKind.BUILD, PhaseKind.DISBAND):
            chosen = dict(list(chosen.items())[: legal.n_required])
        assert _submit(http, game_id, session.game.phase, chosen).status_code == 303  # type: ignore[attr-defined]
    assert session.status() == "finished: year cap 1901"
    game_dir = run_tree.runs_dir / "play" / game_id
    meta = json.loads((game_dir / "game.json").read_text())
    assert meta["status"] == "finished: year cap 1901" and meta["human"] == "FRANCE"
    saved = json.loads((game_dir / "replay.json").read_text())
    assert [p["name"] for p in saved["phases"]][-1] == session.game.phase
    assert from_saved_game_format(saved).get_current_phase() == session.game.phase
    assert _submit(http, game_id, session.game.phase, {}).status_code == 400  # type: ignore[attr-defined]
    listing = http.get("/games", params={"run": RUN})
    assert f"played {game_id} (FRANCE)" in _text(listing)
    view = http.get("/games/view", params={"run": RUN, "id": f"play/{game_id}"})
    assert view.status_code == 200 and '"FRANCE": "human"' in _text(view)


def test_beside_a_training_run_llm_seats_go_to_its_server_and_other_runs_are_refused(
    run_tree: RunTree, tmp_path: Path
) -> None:
    other = tmp_path / "runs" / "other"
    shutil.copytree(run_tree.run_dir, other)
    shutil.copytree(run_tree.run_dir, tmp_path / "runs" / RUN, ignore=shutil.ignore_patterns("play"))
    made: list[FakePolicyClients] = []

    def make_client() -> object:
        made.append(FakePolicyClients())
        return made[-1](other / "adapters")

    app = create_app(WebConfig(runs_dir=tmp_path / "runs"), RunServerClients(other / "adapters", make_client))
    with TestClient(app, base_url=LOCAL, follow_redirects=False) as http:
        refused = http.post("/play", data=_form("FRANCE", 1901, RUN, ENGLAND="main@v2"))
        assert refused.status_code == 400 and not made
        assert "this app runs beside the training run whose PolicyServer serves" in _text(refused)
        for _ in range(2):
            assert http.post("/play", data=_form("FRANCE", 1901, "other", ENGLAND="main@v2")).status_code == 303
        assert http.post("/play", data=_form("FRANCE", 1901, "", ENGLAND="base")).status_code == 303
        assert len(made) == 1  # one client, made for the first LLM seat


def test_forms_from_other_sites_and_rebound_host_names_are_refused(http: TestClient, run_tree: RunTree) -> None:
    form = _form("FRANCE", 1901, "")
    refused = http.post("/play", data=form, headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403 and "may not act on this server" in refused.text
    assert not http.app.state.room.sessions  # type: ignore[attr-defined]
    assert http.get("/", headers={"Host": "evil.example:8080"}).status_code == 403
    assert http.get("/", headers={"Host": "localhost:8080"}).status_code == 200
    assert http.post("/play", data=form, headers={"Origin": LOCAL}).status_code == 303
    exposed = create_app(WebConfig(runs_dir=run_tree.runs_dir, token="x" * 20, exposed=True), FakePolicyClients())
    with TestClient(exposed, base_url="http://diprl.lan:8080") as client:
        assert client.get("/", headers={"X-Diprl-Token": "x" * 20}).status_code == 200


def test_unknown_runs_games_and_phases_are_404s(http: TestClient) -> None:
    for path, params in [
        ("/", {"run": "nope"}),
        ("/league", {"run": "nope"}),
        ("/games", {"run": "../etc"}),
        ("/games/view", {"run": RUN, "id": "trace/../../passwd"}),
        ("/games/svg", {"run": RUN, "id": "trace/main-7", "phase": "99"}),
        ("/play/nope", {}),
        ("/play/nope/board.svg", {}),
        ("/api/curves", {"run": "nope"}),
    ]:
        response = http.get(path, params=params)
        assert response.status_code == 404, (path, response.text)
    assert http.get("/api/league", params={"run": "nope"}).json()["error"].startswith("unknown run 'nope'")


def test_every_page_says_so_when_there_is_no_run_yet(tmp_path: Path) -> None:
    app = create_app(WebConfig(runs_dir=tmp_path / "runs"), FakePolicyClients())
    with TestClient(app, base_url=LOCAL) as client:
        for path in ("/", "/league", "/games"):
            response = client.get(path)
            assert response.status_code == 200 and "No run yet under" in response.text, path
        response = client.get("/play")
        assert response.status_code == 200 and "No run yet under" in response.text
        assert '<option value="bot:random"' in response.text and '<option value="main@v' not in response.text
