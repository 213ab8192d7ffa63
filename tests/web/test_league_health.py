"""The league page shows the league's health (issue 36) from what a league run writes, and links each figure
to the games behind it.

The run is written by the run's own pieces, through Ray stand-ins: a `LeagueManager` with main, a main
exploiter and three anchors (main never plays `base`, so the Nash leaves it out); the driver's health
records (`Driver._log_league`); evaluations through `EvalSchedule` (pins into the frozen pool, a planted
collapse whose guard fires and decides a rollback, a scheduled crossplay round); the rollback carried out
(`LearnerLoop._rolled_back`); a version refused by a canary (`MatchScheduler.refuse`); training traces of the
exploiter against main and of main against its pinned past.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from diprl.eval.evaluator import Evaluator, EvaluatorConfig
from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.health import HealthConfig
from diprl.messages import EvaluationResult, OpponentResult
from diprl.web import WebHandle, start_web
from diprl.web.league_view import league_view
from tests.league.helpers import hero_loses, hero_wins
from tests.ray_stand_in import Actor
from tests.web.conftest import FakePolicyClients, screenshot_dir

RUN = "league-20261202-101500"
ONLY_ANCHORS = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)
REFUSAL = "CanaryMismatch: main_exploiter@v2: the engine's canary completions differ from the published weights'"


class PlantedEvaluator(Evaluator):
    """The real evaluator's pool and pins; `evaluate` answers planted results (a collapse at `collapse_at`)
    with a report whose summary holds the guards' inputs, and crossplay answers without playing."""

    SCORES: ClassVar[dict[int, float]] = {0: 4.0, 2: 5.0, 4: 3.0}
    COLLAPSE_AT = 4

    def evaluate(self, policy_ref: str, tag: str) -> EvaluationResult:
        step = int(tag.removeprefix("step"))
        score = self.SCORES[step]
        hold = 1.0 if step == self.COLLAPSE_AT else 0.3
        summary = {"eval/bot:random/hold_rate": hold, "eval/bot:random/support_rate": 0.1}
        report = self.root / tag / "report.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"summary": summary}))
        opponents = [OpponentResult(o, 14, score if o == "bot:random" else 3.5, (score - 0.4, score + 0.4), 0.0)
                     for o in self.pool()]  # fmt: skip
        return EvaluationResult(tag, policy_ref, str(report), tuple(opponents))

    def crossplay(
        self, pairs: Sequence[Sequence[str]], games: int, tag: str, replays: int = 0, keep_rounds: int = 10
    ) -> list[dict[str, Any]]:
        return [{"hero": a, "opponent": b, "games": games, "outcomes": [1.0] * games} for a, b in pairs]


def _trace(run_dir: Path, source: dict[str, Any], match_id: str, seats: dict[str, str], hero: str) -> None:
    """A copy of a real training trace with other seats (what the listing and the links read)."""
    trace = json.loads(json.dumps(source))
    trace["match"] |= {"match_id": match_id, "seats": seats, "hero": hero}
    (run_dir / "traces" / f"{match_id}.json").write_text(json.dumps(trace))


def build_league_run(runs_dir: Path) -> Path:
    from diprl.run.config import EvalScheduleConfig, compose_config
    from diprl.run.driver import Driver
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.learning import LearnerLoop
    from diprl.run.matches import MatchScheduler
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters
    from diprl.tracking import Tracker
    from tests.web.conftest import _trace as real_trace

    run_dir = runs_dir / RUN
    run_dir.mkdir(parents=True)
    _, resolved = compose_config(["+experiment=smoke", "train.max_steps=6"])
    (run_dir / "config.yaml").write_text(resolved)
    health = HealthConfig(rollback=True, pin_every=1, pin_max=2, crossplay_pairs=1, crossplay_games=2)
    anchors = ["bot:random", "bot:dumbbot", "base"]
    roles = ["main", "main_exploiter"]
    config = LeagueConfig(roles=roles, anchors=anchors, main=ONLY_ANCHORS, snapshot_steps=1, health=health)
    league = LeagueManager(config, run_dir)
    journal = Journal(run_dir, Tracker(run_dir, {}, use_wandb=False), RunStats())
    handle = Actor(league)
    evaluator = PlantedEvaluator(EvaluatorConfig(pool=["bot:random"], plots=False), run_dir)
    evals = EvalSchedule(Actor(evaluator), EvalScheduleConfig(), journal, Counters(), league=handle)
    driver: Any = SimpleNamespace(
        actors=SimpleNamespace(league=handle), journal=journal, rating=None, main_step=0, run_dir=run_dir
    )

    def publish(policy: str, version: str, step: int) -> None:
        decision = league.register_version(policy, version, step)
        journal.log("league", {"version": version, **decision.to_dict()}, policy)

    def play(step: int) -> None:
        for _ in range(6):  # main meets Random and DumbBot; its games against base are never reported
            match = league.next_match("main")
            opponent = next(str(r) for p, r in match.seats.items() if p != match.hero)
            if opponent != "base":
                league.report(hero_wins(match) if opponent == "bot:random" else hero_loses(match))
        for _ in range(4):  # the exploiter always outranks main
            league.report(hero_wins(league.next_match("main_exploiter")))
        driver.main_step = step
        if step in (1, 3, 6):
            driver.rating = league.rating(league.current("main"))
            Driver._log_league(driver)

    def evaluate(step: int) -> None:
        ref = evals._submit(league.current("main"), step, 0)
        evals.handle(ref)
        evals.fill(stopping=False)  # the crossplay round the evaluation made due
        for crossplay in list(evals.crossplaying):
            evals.handle(crossplay)

    import ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "get", lambda ref: ref.value)
        publish("main", "main@v1", 0)
        publish("main_exploiter", "main_exploiter@v1", 0)
        evaluate(0)
        for step in range(1, 7):
            publish("main", f"main@v{step + 1}", step)
            if step == 2:
                publish("main_exploiter", "main_exploiter@v2", step)
                MatchScheduler.refuse(SimpleNamespace(league=handle, refused=set(), serving={}, journal=journal),
                                      "main_exploiter@v2", REFUSAL)  # fmt: skip
            play(step)
            if step in (2, 4):
                evaluate(step)
            if step == 5:
                pending = league.pending_rollback("main")
                assert pending is not None, "the planted collapse decided no rollback"
                publish("main", "main@v7", step)
                LearnerLoop._rolled_back(
                    SimpleNamespace(league=handle, journal=journal), "main", pending, "main@v7", step
                )
    journal.tracker.close()
    source = run_dir / "traces"
    real_trace(run_dir)  # traces/main-7.json, written by a real Episode: the template of the two below
    trace = json.loads((source / "main-7.json").read_text())
    (source / "main-7.json").unlink()
    powers = sorted(trace["match"]["seats"])
    exploit = {p: "main@v7" for p in powers} | {"ENGLAND": "main_exploiter@v1"}  # main after the rollback
    _trace(run_dir, trace, "main_exploiter-3", exploit, "ENGLAND")
    pinned = league.eval_pins()[0]
    _trace(run_dir, trace, "main-9", {p: pinned for p in powers} | {"GERMANY": "main@v5"}, "GERMANY")
    return run_dir


@pytest.fixture(scope="module")
def league_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_league_run(tmp_path_factory.mktemp("league-health") / "runs")


def test_the_view_reads_the_leagues_health_from_what_the_run_wrote(league_run: Path) -> None:
    view = league_view(league_run)
    h = view["health"]
    assert h["step"] == 6 and h["records"] == 3
    # base never played: left out of the Nash, on the page as such, never as weight 0
    assert "base" in view["nash_left_out"] and "base" not in view["nash"]
    assert {m["member"]: m["nash"] for m in view["pool"]}["base"] is None
    assert "base" in h["nash"]["left_out"] and "base" not in h["nash"]["weights"]
    [row, *_] = h["exploitability"]
    assert row["exploiter"] == "main_exploiter#0" and row["lower_bound"] > 0.0
    assert row["low"] <= row["rate"] <= row["high"] and row["low"] > 0.5  # the exploiter always wins
    f = h["figures"]
    assert f["exploitability_lb_max"] > 0.0 and f["rollbacks"] == 1 and f["rollbacks_done"] == 1
    assert f["best_version"] == "main@v3" and h["rollback_pending"] is None
    assert [e["event"] for e in h["events"]] == [
        "refused",
        "guard fired",
        "guard fired",
        "rollback decided",
        "rolled back",
    ]
    assert "main@v3's weights published as main@v7" in h["events"][-1]["text"]
    assert [p["version"] for p in h["pins"]] == h["pinned"] and len(h["pinned"]) == 2
    assert [len(r["pairs"]) for r in h["crossplay"]] == [1, 1, 1]
    assert h["entries"] and all(e["role"] in ("main", "main_exploiter") for e in h["entries"])
    charts = {c["key"]: c for c in h["charts"]}
    assert set(charts) == {"exploitability", "exploiters", "nash", "nash_main", "rpp", "ratings", "pinned", "best"}
    ratings = {s["label"] for s in charts["ratings"]["series"]}
    assert {"main", "main_exploiter", "bot:random", "bot:dumbbot", "base"} <= ratings
    assert [len(s["points"]) for s in charts["exploitability"]["series"]] == [3, 3]
    assert all(len(p) == 4 for s in charts["pinned"]["series"] for p in s["points"])  # with intervals
    links = view["games"]
    assert links["exploits"][row["target"]]["count"] == 1  # the exploiter's trace against main
    assert links["pins"][h["pinned"][0]]["count"] == 1


def _page(runs_dir: Path, url: str) -> str:
    from starlette.testclient import TestClient

    from diprl.web.app import WebConfig, create_app

    with TestClient(create_app(WebConfig(runs_dir=runs_dir), FakePolicyClients()), base_url="http://127.0.0.1") as http:
        response = http.get(url)
        assert response.status_code == 200, response.text[:500]
        return response.text


def _plain(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_the_league_page_shows_the_health_and_links_each_figure_to_its_games(league_run: Path) -> None:
    page = _page(league_run.parent, f"/league?run={RUN}")
    nash = page.split('<div id="nash">')[1].split("</div>\n<p")[0]
    assert re.search(r'class="label">base</span>.*left out', nash)
    assert not re.search(r'class="label">base</span><span class="track"><span class="fill"', nash)
    text = _plain(page)
    assert "League health at main step 6" in text
    for title in ("exploitability lower bound of main", "main's Nash weight", "relative population performance"):
        assert title in text
    assert page.count('class="plot" data-chart=') == 8
    table = _plain(page.split('id="exploitability"')[1].split("</table>")[0])
    assert "main_exploiter#0" in table and "1 game" in table
    events = _plain(page.split('id="events"')[1].split("</table>")[0])
    assert "guard fired" in events and "rollback decided" in events and "rolled back" in events
    assert "refused main_exploiter@v2" in events
    assert 'id="pins"' in page and 'id="crossplay-rounds"' in page
    link = "/games?run=league-20261202-101500&amp;member=main_exploiter%230&amp;vs=main"
    assert link in page
    games = _page(league_run.parent, link.replace("&amp;", "&"))
    listed = re.findall(r"training trace ([\w-]+)", games)
    assert listed == ["main_exploiter-3"] and 'id="games-filter"' in games
    every = re.findall(r"training trace ([\w-]+)", _page(league_run.parent, f"/games?run={RUN}"))
    assert every == ["main-9", "main_exploiter-3"]


def test_a_finished_runs_summary_shows_left_out_members_as_such(league_run: Path, tmp_path: Path) -> None:
    """Without a readable state the page reads league_summary.json, whose top-level Nash gives 0 to
    left-out members: the page takes the summary's solve over the measured members instead."""
    run_dir = tmp_path / "runs" / RUN
    shutil.copytree(league_run, run_dir)
    manager = LeagueManager(LeagueConfig(anchors=["bot:random", "bot:dumbbot", "base"]), run_dir)
    (run_dir / "league_summary.json").write_text(json.dumps(manager.summary(), default=str))
    shutil.rmtree(run_dir / "league")
    view = league_view(run_dir)
    assert view["source"] == "league_summary.json"
    assert "base" in view["nash_left_out"] and "base" not in view["nash"]
    assert {m["member"]: m["nash"] for m in view["pool"]}["base"] is None


@pytest.fixture(scope="module")
def league_web(league_run: Path) -> Iterator[WebHandle]:
    handle = start_web(league_run.parent, port=0, client_factory=FakePolicyClients())
    yield handle
    handle.stop()


def test_the_health_charts_draw_in_a_browser(browser: Any, league_web: WebHandle) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.set_window_size(1400, 2600)
    browser.get(f"{league_web.url}league?run={RUN}")
    WebDriverWait(browser, 30).until(
        lambda b: len(b.find_elements(By.CSS_SELECTOR, "#health-charts .plot polyline")) >= 10, "the health charts"
    )
    ratings = browser.find_element(By.CSS_SELECTOR, "#chart-ratings .legend").text
    assert "main_exploiter" in ratings and "base" in ratings
    browser.save_screenshot(str(screenshot_dir() / "league-health.png"))
    browser.find_element(By.CSS_SELECTOR, "#chart-exploitability a.games").click()
    WebDriverWait(browser, 30).until(lambda b: "member=main_exploiter" in b.current_url, "the games behind it")
    assert "main_exploiter-3" in browser.find_element(By.ID, "games").text
    browser.set_window_size(1400, 1000)
