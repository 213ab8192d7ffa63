"""What the pages read: run status from the lock and files, curves from metrics, the league, games."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import pytest

from diprl.web import games, runs
from diprl.web.league_view import NoLeague, crossplay_reports, league_view, summary_from_state
from tests.web.conftest import RUN, RunTree


def _copy(run_tree: RunTree, tmp_path: Path) -> Path:
    target = tmp_path / "runs" / RUN
    shutil.copytree(run_tree.run_dir, target)
    return target


def test_runs_are_the_directories_with_a_config_and_unknown_names_are_refused(run_tree: RunTree) -> None:
    (run_tree.runs_dir / "play").mkdir(exist_ok=True)  # games played in the browser: never a run
    assert runs.run_names(run_tree.runs_dir) == [RUN]
    assert runs.resolve_run(run_tree.runs_dir, RUN) == run_tree.run_dir
    for bad in ("nope", "../" + RUN, "play", ".", ""):
        with pytest.raises(runs.UnknownRun, match="unknown run"):
            runs.resolve_run(run_tree.runs_dir, bad)
    assert runs.run_names(run_tree.runs_dir / "missing") == []


def test_status_running_while_the_lock_is_held_then_finished_or_stopped(run_tree: RunTree, tmp_path: Path) -> None:
    run_dir = _copy(run_tree, tmp_path)
    assert runs.run_status(run_dir) == "finished"  # summary written after the last metrics record
    with (run_dir / ".lock").open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the driver holds for the run's life
        assert runs.lock_held(run_dir / ".lock")
        assert runs.run_status(run_dir) == "running"
    assert not runs.lock_held(run_dir / ".lock")
    (run_dir / "league_summary.json").unlink()  # killed before its end: no summary
    assert runs.run_status(run_dir) == "stopped"


def yaml_bomb(levels: int) -> str:
    """A "billion laughs" config.yaml: each level's list holds the previous one nine times (9**levels strings)."""
    lines = ["experiment: smoke", "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        yaml_bomb(5),  # the review's was 334 bytes of 9 levels: 127 s; 5 levels keep the unfixed code's run short
        "experiment: smoke\n" + "".join(f"s{i}: ${{s{i - 1}}}${{s{i - 1}}}\n" for i in range(1, 30)) + "s0: lol\n",
        "experiment: smoke\nx: " + "[" * 5000 + "]" * 5000 + "\n",
        "experiment: smoke\n# " + "x" * (2 << 20) + "\n",
    ],
    ids=["aliases", "interpolations", "nesting", "size"],
)
def test_a_config_yaml_that_would_take_minutes_to_load_is_refused_at_once(
    run_tree: RunTree, tmp_path: Path, text: str
) -> None:
    """Found by review (N8): a 334-byte `config.yaml` with nested aliases took 127 s to load in the runs page.
    A run's config is resolved YAML: an alias, an interpolation, deep nesting or megabytes are refused
    before OmegaConf builds anything; the page shows the text (cut to the limit) and no summary."""
    import time

    run_dir = _copy(run_tree, tmp_path)
    (run_dir / "config.yaml").write_text(text)
    start = time.monotonic()
    info = runs.run_info(run_dir.parent, run_dir)
    assert time.monotonic() - start < 2.0
    assert info.config == {} and info.experiment == "?"
    assert info.config_text.startswith("experiment: smoke") and len(info.config_text) <= (1 << 20) + 200


def test_learning_curves_follow_the_metrics_file_and_skip_a_torn_line(run_tree: RunTree, tmp_path: Path) -> None:
    run_dir = _copy(run_tree, tmp_path)
    payload = runs.curves_payload(run_dir.parent, run_dir)
    charts = {c["title"]: c["series"] for c in payload["charts"]}
    [returns] = charts["mean hero return (rollouts)"]
    assert [p[0] for p in returns["points"]] == [1, 2, 3, 4, 5, 6]
    [evaluation] = charts["evaluation: hero mean centres (95% interval)"]
    assert evaluation["label"] == "main vs bot:random" and evaluation["points"][0] == [0, 3.2, 2.8, 3.9]
    assert payload["steps"] == 6 and payload["max_steps"] == 6
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": 1e10, "kind": "rollout", "policy": "main", "learner/step": 7,
                             "rollout/mean_reward": 0.9}) + "\n" + '{"time": 1e10, "kind": "roll')  # fmt: skip
    [returns] = {c["title"]: c["series"] for c in runs.curves_payload(run_dir.parent, run_dir)["charts"]}[
        "mean hero return (rollouts)"
    ]
    assert returns["points"][-1] == [7, 0.9]


def test_league_view_of_the_state_matches_the_managers_own_summary(run_tree: RunTree) -> None:
    """The page reads state.json (live); what it shows must be what LeagueManager.summary() says."""
    view = league_view(run_tree.run_dir)
    summary = json.loads((run_tree.run_dir / "league_summary.json").read_text())
    assert view["source"] == "league/state.json"
    solved = summary["health"]["nash"]  # the solve over measured members; the top-level nash gives others 0
    assert solved["left_out"] and view["nash_left_out"] == solved["left_out"]
    assert view["nash"] == pytest.approx(solved["weights"])
    assert [m | {"nash": solved["weights"].get(m["member"])} for m in summary["pool"]] == view["pool"]
    assert view["payoff"] == summary["payoff"]
    assert view["current"] == {"main": "main@v3"}
    assert [(t["version"], t["snapshot"], t["step"]) for t in view["timeline"]] == [
        ("main@v1", False, None),
        ("main@v2", True, 2),
        ("main@v3", True, 4),
    ]


def test_crossplay_evaluations_of_the_run_are_read_from_their_reports(run_tree: RunTree, tmp_path: Path) -> None:
    report = json.loads((run_tree.run_dir / "eval" / "crossplay" / "report.json").read_text())["crossplay"]
    [found] = crossplay_reports(run_tree.run_dir)
    assert found["tag"] == "crossplay" and found["policies"] == ["bot:random", "bot:dumbbot", "bot:hold"]
    assert found["payoff"] == report["payoff"] and found["nash"] == report["nash"]
    run_dir = _copy(run_tree, tmp_path)
    (run_dir / "eval" / "crossplay" / "report.json").write_text('{"crossplay": {"policies": ["a"], "payoff": []}}')
    (run_dir / "eval" / "step3" / "report.json").write_text("not json")
    assert crossplay_reports(run_dir) == []


def test_a_corrupt_league_falls_back_to_the_summary_then_says_so(run_tree: RunTree, tmp_path: Path) -> None:
    run_dir = _copy(run_tree, tmp_path)
    for name in ("state.json", "state.prev.json"):
        (run_dir / "league" / name).write_text("{ torn")
    view = league_view(run_dir)
    assert view["source"] == "league_summary.json"
    (run_dir / "league_summary.json").unlink()
    with pytest.raises(NoLeague, match="no readable league state"):
        league_view(run_dir)
    shutil.rmtree(run_dir / "league")
    with pytest.raises(NoLeague, match="has no league yet"):
        league_view(run_dir)
    with pytest.raises(NoLeague, match="not in the expected format"):
        summary_from_state({"members": "nonsense"})


def test_games_lists_replays_traces_and_reads_a_trace_written_by_the_episode(run_tree: RunTree) -> None:
    listing = games.list_games(run_tree.runs_dir, RUN, run_tree.run_dir)
    ids = [g.id for g in listing]
    assert "eval/step3/bot_random/game0000" in ids and f"trace/{run_tree.trace}" in ids
    view = games.load_game(games.find_game(listing, f"trace/{run_tree.trace}"))
    assert view.hero == "FRANCE" and view.seats["FRANCE"] == "main@v2"
    assert view.info["decision_phase"] == view.forks[0]["phases"][0]["name"]
    fork = view.forks[0]["info"]
    assert fork["order_rewards"] and set(fork["order_rewards"]) == set(fork["orders"])
    assert "outcome/total" in fork["components"] and isinstance(fork["return"], float)
    hero_orders = view.forks[0]["phases"][0]["orders"]["FRANCE"]
    assert sorted(hero_orders) == sorted(fork["orders"])
    replay = games.load_game(games.find_game(listing, "eval/step3/bot_random/game0000"))
    assert replay.hero == "ENGLAND" and replay.seats["ENGLAND"] == "bot:dumbbot"
    with pytest.raises(games.UnknownGame):
        games.find_game(listing, "trace/../../etc/passwd")


def test_a_trace_with_new_fields_shows_them_and_a_broken_one_names_its_problem(
    run_tree: RunTree, tmp_path: Path
) -> None:
    run_dir = _copy(run_tree, tmp_path)
    trace = json.loads((run_dir / "traces" / f"{run_tree.trace}.json").read_text())
    trace["forks"][0]["advantage"] = 0.71
    trace["forks"][0]["seats"] = {"FRANCE": {"advantage": 0.71}, "ENGLAND": {"advantage": -0.2}}
    trace["forks"][1]["replay"] = {"phases": "nope"}
    trace["groups"] = [{"power": "FRANCE", "advantages": [0.71, -0.71]}]
    (run_dir / "traces" / "grown.json").write_text(json.dumps(trace))
    (run_dir / "traces" / "torn.json").write_text('{"forks": [')
    (run_dir / "traces" / "other.json").write_text('{"not": "a trace"}')
    listing = games.list_games(run_dir.parent, RUN, run_dir)
    view = games.load_game(games.find_game(listing, "trace/grown"))
    assert [f["label"] for f in view.forks] == ["fork 0"]
    assert view.forks[0]["info"]["extra"] == {"advantage": 0.71, "seats": trace["forks"][0]["seats"]}
    assert view.info["extra"] == {"groups": trace["groups"]}
    assert "fork 1: not a saved game" in view.info["problems"][0]
    with pytest.raises(games.BadGameFile, match="unreadable JSON"):
        games.load_game(games.find_game(listing, "trace/torn"))
    with pytest.raises(games.BadGameFile, match="not a trace"):
        games.load_game(games.find_game(listing, "trace/other"))


def test_boards_are_the_engines_svg_of_each_phase(run_tree: RunTree) -> None:
    listing = games.list_games(run_tree.runs_dir, RUN, run_tree.run_dir)
    trace = games.find_game(listing, f"trace/{run_tree.trace}")
    svg = games.phase_svg(trace, 1, 0)
    assert "<svg" in svg
    phase = games.load_game(trace).forks[1]["phases"][0]
    assert svg != games.render_phase(phase, with_orders=False), "the phase's orders are drawn"
    with pytest.raises(games.UnknownGame, match="out of range"):
        games.phase_svg(trace, 0, 99)
    with pytest.raises(games.UnknownGame, match="fork 9"):
        games.phase_svg(trace, 9, 0)
    replay = games.find_game(listing, "eval/step3/bot_random/game0000")
    assert games.phase_svg(replay, 0, 0) == (replay.path.parent / "frames" / "000_S1901M.svg").read_text()
