"""The league page links a payoff cell filled by scheduled crossplay, and the crossplay round, to the replays
the round kept (issue 36); a cell without kept games has no link.

The run is written by the run's own pieces, through Ray stand-ins: a `LeagueManager` whose main has played
three bot anchors (no trace kept), and one crossplay round scheduled by `EvalSchedule` after an evaluation,
played for real by the evaluator (bots, games to 1901) into the payoff and `metrics.jsonl`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from diprl.eval.config import GamesConfig
from diprl.eval.evaluator import Evaluator, EvaluatorConfig
from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.health import HealthConfig
from diprl.messages import EvaluationResult, OpponentResult
from tests.league.helpers import hero_loses, hero_wins
from tests.ray_stand_in import Actor
from tests.web.conftest import FakePolicyClients

RUN = "league-20261203-090000"
ANCHORS = ["bot:random", "bot:dumbbot", "bot:hold"]


class PlayingEvaluator(Evaluator):
    """Crossplay for real; `evaluate` answers a fixed result without playing (it only makes a round due)."""

    def evaluate(self, policy_ref: str, tag: str) -> EvaluationResult:
        return EvaluationResult(
            tag, policy_ref, "missing.json", (OpponentResult("bot:random", 2, 5.0, (4.0, 6.0), 0.0),)
        )


def build_run(runs_dir: Path) -> tuple[Path, list[str]]:
    """The run directory and the crossplayed pair [hero, opponent]."""
    import ray

    from diprl.run.config import EvalScheduleConfig, compose_config
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters
    from diprl.tracking import Tracker

    run_dir = runs_dir / RUN
    run_dir.mkdir(parents=True)
    _, resolved = compose_config(["+experiment=smoke"])
    (run_dir / "config.yaml").write_text(resolved)
    main = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)
    health = HealthConfig(crossplay_pairs=1, crossplay_games=2, crossplay_replays=1)
    league = LeagueManager(LeagueConfig(anchors=ANCHORS, main=main, decay=1.0, health=health), run_dir)
    league.register_version("main", "main@v1", 0)
    for _ in range(30):
        match = league.next_match("main")
        opponent = next(str(ref) for p, ref in match.seats.items() if p != match.hero)
        league.report(hero_wins(match) if opponent == "bot:random" else hero_loses(match))
    (pair,) = league.crossplay_plan()["pairs"]
    tracker = Tracker(run_dir, {}, use_wandb=False)
    evaluator = PlayingEvaluator(
        EvaluatorConfig(pool=["bot:random"], plots=False, play=GamesConfig(games=2, max_year=1901)), run_dir
    )
    evals = EvalSchedule(
        Actor(evaluator), EvalScheduleConfig(), Journal(run_dir, tracker, RunStats()), Counters(), league=Actor(league)
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "get", lambda ref: ref.value)
        evals.start("main@v1", 0)
        for _ in range(2):  # the evaluation, then the crossplay round it made due
            evals.fill(stopping=False)
            (ref,) = evals.refs()
            evals.handle(ref)
    tracker.close()
    return run_dir, pair


@pytest.fixture(scope="module")
def crossplay_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return build_run(tmp_path_factory.mktemp("crossplay-links") / "runs")


@pytest.fixture(scope="module")
def http(crossplay_run: tuple[Path, list[str]]) -> Iterator[object]:
    from starlette.testclient import TestClient

    from diprl.web.app import WebConfig, create_app

    runs_dir = crossplay_run[0].parent
    with TestClient(
        create_app(WebConfig(runs_dir=runs_dir), FakePolicyClients()), base_url="http://127.0.0.1"
    ) as client:
        yield client


def _get(http: object, url: str) -> str:
    response = http.get(url)  # type: ignore[attr-defined]
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:300]}"
    return str(response.text)


def _payoff_cells(page: str) -> dict[tuple[str, str], str | None]:
    """(row, column) -> the cell's link (None: no link) of every played cell of the payoff heatmap."""
    table = page.split('id="payoff"')[1].split("</table>")[0]
    cells = {}
    for title, body in re.findall(r'<td style="[^"]*" title="([^"]+)">(.*?)</td>', table):
        a, b = html.unescape(title).split(": ", 1)[0].split(" vs ")  # "a vs b: 0.50 over 2.00 games ..."
        link = re.search(r'<a href="([^"]+)"', body)
        cells[(a, b)] = html.unescape(link.group(1)) if link else None
    return cells


def test_a_crossplayed_payoff_cell_links_to_the_rounds_replay_and_it_opens(
    crossplay_run: tuple[Path, list[str]], http: object
) -> None:
    run_dir, (hero, opponent) = crossplay_run
    page = _get(http, f"/league?run={RUN}")
    cells = _payoff_cells(page)
    for a, b in ((hero, opponent), (opponent, hero)):  # the payoff holds the games both ways
        link = cells[(a, b)]
        assert link is not None, f"the crossplayed cell {a} vs {b} has no link"
        games = _get(http, link)
        ids = re.findall(r'href="/games/view\?([^"]+)"', games)
        assert len(ids) == 1 and "crossplay%2Fcrossplay-step0%2F" in ids[0]
        viewed = _get(http, "/games/view?" + html.unescape(ids[0]))
        assert hero in viewed and opponent in viewed
    replay = run_dir / "eval" / "crossplay" / "rounds" / "crossplay-step0"
    assert [p.name for p in replay.iterdir()] == [f"{hero}_vs_{opponent}".replace(":", "_")]
    rounds = page.split('id="crossplay-rounds"')[1].split("</table>")[0]
    (round_link,) = re.findall(r'<a class="replay" href="([^"]+)"', rounds)
    _get(http, html.unescape(round_link))


def test_a_cell_without_kept_games_has_no_link(crossplay_run: tuple[Path, list[str]], http: object) -> None:
    _, pair = crossplay_run
    cells = _payoff_cells(_get(http, f"/league?run={RUN}"))
    assert cells[("main", "bot:random")] is None  # played in training, no trace kept
    assert {k for k, v in cells.items() if v} == {tuple(pair), tuple(reversed(pair))}
    unplayed = [(a, b) for a in ANCHORS for b in ANCHORS if a != b and {a, b} != set(pair)]
    assert unplayed and not any(k in cells for k in unplayed)  # "-": never played, no link
