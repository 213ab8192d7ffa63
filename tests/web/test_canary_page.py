"""The league page says when a replica refused a version by its canary (issue 38), and which version plays
instead: from the live state as from the summary a finished run leaves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from diprl.league.persist import load_state, save_state
from diprl.web.league_view import league_view
from tests.web.conftest import RUN, FakePolicyClients, RunTree

WHY = "CanaryMismatch: main@v3: the engine's canary completions differ from the published weights'"


def _refused_run(run_tree: RunTree, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / RUN
    shutil.copytree(run_tree.run_dir, run_dir)
    state = load_state(run_dir / "league")
    assert state is not None and state["roles"]["main"]["current"] == "main@v3"
    registered = {"main": ["main@v1", "main@v2", "main@v3"]}
    state["canary"] = {"refused": {"main@v3": WHY}, "registered": registered, "proven": ["main@v2"]}
    save_state(run_dir / "league", state)
    return run_dir


def test_the_league_view_names_the_refused_version_and_what_plays_instead(run_tree: RunTree, tmp_path: Path) -> None:
    run_dir = _refused_run(run_tree, tmp_path)
    view = league_view(run_dir)
    assert view["canary_refused"] == {"main@v3": WHY} and view["serving"] == {"main": "main@v2"}
    clean = league_view(run_tree.run_dir)
    assert clean["canary_refused"] == {} and clean["serving"] == {"main": "main@v3"}


def test_the_league_page_says_a_version_was_refused(run_tree: RunTree, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from diprl.web.app import WebConfig, create_app

    run_dir = _refused_run(run_tree, tmp_path)
    app = create_app(WebConfig(runs_dir=run_dir.parent), FakePolicyClients())
    with TestClient(app, base_url="http://127.0.0.1") as http:
        page = http.get(f"/league?run={RUN}").text
        clean = create_app(WebConfig(runs_dir=run_tree.runs_dir), FakePolicyClients())
    assert 'id="canary-refused"' in page and "<b" in page and "main@v3" in page
    assert "Rollouts and evaluations play <b>main@v2</b> for main" in page
    with TestClient(clean, base_url="http://127.0.0.1") as http:
        assert 'id="canary-refused"' not in http.get(f"/league?run={RUN}").text
    summary = json.loads((run_dir / "league_summary.json").read_text())
    assert "pool" in summary  # the finished run's summary is read when no state is (the manager writes both keys)
