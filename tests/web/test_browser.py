"""Every page in a real headless Chromium, and a short game played by choosing orders in the selects.

Screenshots go to `$DIPRL_WEB_SCREENSHOTS` (default `.cache/web-screenshots/`) for a person to look at.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from diprl.web import WebHandle, start_web
from tests.web.conftest import RUN, FakePolicyClients, RunTree, screenshot_dir

WAIT_S = 30


def _wait(browser: Any, check: Callable[[Any], Any], what: str) -> Any:
    """Poll `check` until it holds. A form submit replaces the page while a check may hold an element of
    the old one: a stale element means "not yet", like a missing one (which WebDriverWait already ignores)."""
    wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=[StaleElementReferenceException])
    return wait.until(check, message=f"waiting for {what}")


def _text(browser: Any, css: str) -> str:
    return str(browser.find_element(By.CSS_SELECTOR, css).text)


def _shot(browser: Any, name: str) -> Path:
    path = screenshot_dir() / f"{name}.png"
    browser.save_screenshot(str(path))
    return path


def _image_loaded(browser: Any, element_id: str) -> bool:
    return bool(
        browser.execute_script(
            f"const i = document.getElementById('{element_id}'); return i.complete && i.naturalWidth > 0;"
        )
    )


def test_runs_page_lists_runs_and_draws_the_learning_curves(browser: Any, web: WebHandle) -> None:
    browser.get(web.url)
    rows = browser.find_elements(By.CSS_SELECTOR, "#runs tr")
    assert len(rows) == 2 and RUN in rows[1].text and "finished" in rows[1].text
    assert "6 / 6" in rows[1].text
    _wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#charts .chart polyline")) >= 6, "the charts")
    titles = [e.get_attribute("data-title") for e in browser.find_elements(By.CSS_SELECTOR, "#charts .chart")]
    assert "mean hero return (rollouts)" in titles and "evaluation: hero mean centres (95% interval)" in titles
    browser.find_element(By.CSS_SELECTOR, "details summary").click()
    assert "experiment: smoke" in _text(browser, "pre.config")
    _shot(browser, "runs")


def test_the_runs_page_follows_a_run_while_it_goes(browser: Any, run_tree: RunTree, tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    run_dir = runs_dir / RUN
    shutil.copytree(run_tree.run_dir, run_dir)
    web = start_web(runs_dir, port=0, client_factory=FakePolicyClients(), poll_s=0.3)
    lock = (run_dir / ".lock").open("a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a training driver holds
        browser.get(web.url)
        _wait(browser, lambda b: _text(b, "#run-status") == "running", "the running badge")
        _wait(browser, lambda b: b.find_element(By.ID, "charts").get_attribute("data-records"), "the first poll")
        before = int(browser.find_element(By.ID, "charts").get_attribute("data-records"))
        with (run_dir / "metrics.jsonl").open("a") as fh:
            record = {"time": time.time(), "kind": "learner", "policy": "main", "step": 7, "loss": -0.5}
            fh.write(json.dumps(record) + "\n")
        _wait(browser, lambda b: int(b.find_element(By.ID, "charts").get_attribute("data-records")) == before + 1,
              "the new record")  # fmt: skip
        assert _text(browser, "#run-steps") == "7"
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)  # the driver is gone (its summary is older: stopped)
        _wait(browser, lambda b: _text(b, "#run-status") == "stopped", "the stopped badge")
    finally:
        lock.close()
        web.stop()


def test_league_page_shows_members_payoff_nash_and_snapshots(browser: Any, web: WebHandle, run_tree: RunTree) -> None:
    summary = json.loads((run_tree.run_dir / "league_summary.json").read_text())
    browser.get(f"{web.url}league?run={RUN}")
    members = browser.find_elements(By.CSS_SELECTOR, "#members tr")[1:]
    assert len(members) == len(summary["pool"]) == 6
    by_member = {row.text.split()[0]: row.text for row in members}
    assert "learner main@v3" in by_member["main"] and "snapshot main@v2" in by_member["main@v2"]
    best = max(summary["pool"], key=lambda m: m["rating"])
    assert members[0].text.startswith(best["member"]) and f"{best['rating']:.2f}" in members[0].text
    played = [
        c
        for c in browser.find_elements(By.CSS_SELECTOR, "#payoff td")
        if "background" in (c.get_attribute("style") or "")
    ]
    assert len(played) == sum(1 for row in summary["payoff"]["games"] for g in row if g > 0)
    bars = browser.find_elements(By.CSS_SELECTOR, "#nash .bar")
    weights = {
        b.find_element(By.CSS_SELECTOR, ".label").text: b.find_element(By.CSS_SELECTOR, ".num").text for b in bars
    }
    solved = summary["health"]["nash"]  # members left out of the solve say so, never 0.00
    assert weights == {k: f"{v:.2f}" for k, v in solved["weights"].items()} | dict.fromkeys(
        solved["left_out"], "left out"
    )
    timeline = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#timeline tr")[1:]]
    assert [("main@v" + str(i + 1)) in t for i, t in enumerate(timeline)] == [True] * 3
    assert "snapshot main@v2" in timeline[1]
    crossplay = json.loads((run_tree.run_dir / "eval" / "crossplay" / "report.json").read_text())["crossplay"]
    cells = browser.find_elements(By.CSS_SELECTOR, "#crossplay-crossplay td")
    assert [c.text for c in cells] == [f"{v:.2f}" if v is not None else "-" for row in crossplay["payoff"] for v in row]
    weights = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#crossplay-crossplay .nash .num")]
    assert weights == [f"{crossplay['nash'][p]:.2f}" for p in crossplay["policies"]]
    _shot(browser, "league")


def test_games_page_steps_through_a_trace_and_an_evaluation_replay(
    browser: Any, web: WebHandle, run_tree: RunTree
) -> None:
    trace = json.loads((run_tree.run_dir / "traces" / f"{run_tree.trace}.json").read_text())
    browser.get(f"{web.url}games?run={RUN}")
    links = {a.text: a for a in browser.find_elements(By.CSS_SELECTOR, "#games a")}
    assert f"training trace {run_tree.trace}" in links and "evaluation step3: bot_random/game0000" in links
    links[f"training trace {run_tree.trace}"].click()
    _wait(browser, lambda b: _text(b, "#phase") == trace["decision_phase"], "the decision phase")
    _wait(browser, lambda b: _image_loaded(b, "map"), "the board")
    rewards = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#orders .reward")]
    assert len(rewards) == len(trace["forks"][0]["order_rewards"])
    assert f"return {trace['forks'][0]['return']:.3f}" in _text(browser, "#forkinfo")
    assert "FRANCE" in _text(browser, "#centres .hero") and "main@v2 (hero)" in _text(browser, "#centres .hero")
    _shot(browser, "trace")
    src = browser.find_element(By.ID, "map").get_attribute("src")
    browser.find_element(By.ID, "next").click()
    _wait(browser, lambda b: b.find_element(By.ID, "map").get_attribute("src") != src, "the next board")
    assert _text(browser, "#phase") == trace["forks"][0]["replay"]["phases"][1]["name"]
    Select(browser.find_element(By.ID, "fork")).select_by_index(1)
    _wait(browser, lambda b: f"return {trace['forks'][1]['return']:.3f}" in _text(b, "#forkinfo"), "fork 1")
    assert "&fork=1&" in browser.find_element(By.ID, "map").get_attribute("src")

    browser.get(f"{web.url}games?run={RUN}")
    browser.find_element(By.LINK_TEXT, "evaluation step3: bot_random/game0000").click()
    _wait(browser, lambda b: _image_loaded(b, "map"), "the replay's first frame")
    assert "bot:dumbbot (hero)" in _text(browser, "#centres .hero")
    browser.find_element(By.ID, "last").click()
    _wait(browser, lambda b: "(end)" in _text(b, "#phase"), "the final board")


def _start_game(browser: Any, web: WebHandle, human: str, everyone: str, max_year: int) -> None:
    browser.get(f"{web.url}play")
    Select(browser.find_element(By.ID, "human")).select_by_value(human)
    Select(browser.find_element(By.ID, "everyone")).select_by_value(everyone)
    year = browser.find_element(By.ID, "max_year")
    year.clear()
    year.send_keys(str(max_year))
    browser.find_element(By.ID, "start").click()
    _wait(browser, lambda b: b.find_elements(By.ID, "orders"), "the order form")


def test_play_a_short_game_against_random_bots(browser: Any, web: WebHandle, run_tree: RunTree) -> None:
    _start_game(browser, web, "FRANCE", "bot:random", 1901)
    assert _text(browser, "#phase") == "S1901M"
    assert "bot:random" in _text(browser, "#seats") and "human" in _text(browser, "#seats .hero")
    selects = browser.find_elements(By.CSS_SELECTOR, "#orders select")
    assert sorted(s.get_attribute("data-loc") for s in selects) == ["BRE", "MAR", "PAR"]
    chosen = []
    for element in selects:
        select = Select(element)
        assert select.first_selected_option.text.endswith(" H")  # hold preselected
        move = next(o.get_attribute("value") for o in select.options if " - " in o.get_attribute("value"))
        select.select_by_value(move)
        chosen.append(move)
    browser.find_element(By.ID, "submit").click()
    _wait(browser, lambda b: _text(b, "#phase") == "F1901M", "the next phase")
    last = _text(browser, "#last-orders")
    for order in chosen:
        assert order in last
    for power in ("AUSTRIA", "ENGLAND", "GERMANY", "ITALY", "RUSSIA", "TURKEY"):
        assert power in last  # every opponent's orders of spring are shown
    browser.find_element(By.ID, "show-last").click()
    _wait(browser, lambda b: "phase=S1901M" in b.find_element(By.ID, "board").get_attribute("src"), "spring's board")
    _wait(browser, lambda b: _image_loaded(b, "board"), "the board with spring's orders")
    _shot(browser, "play")
    browser.find_element(By.ID, "show-last").click()
    while not browser.find_elements(By.ID, "result"):
        phase = _text(browser, "#phase")
        form = browser.find_elements(By.ID, "orders")
        if form and "disband" in _text(browser, "#orders h3"):
            need = int(_text(browser, "#orders h3").rsplit(" ", 1)[1].strip(")"))
            for element in browser.find_elements(By.CSS_SELECTOR, "#orders select")[:need]:
                Select(element).select_by_index(1)
        browser.find_element(By.ID, "submit" if form else "continue").click()
        _wait(browser, lambda b, p=phase: _text(b, "#phase") != p or b.find_elements(By.ID, "result"), "a phase")
    assert "finished: year cap 1901" in _text(browser, "#result")
    game_id = browser.current_url.rstrip("/").rsplit("/", 1)[1]
    assert (run_tree.runs_dir / "play" / game_id / "replay.json").is_file()
    _shot(browser, "play_finished")
    browser.find_element(By.LINK_TEXT, "watch it").click()
    _wait(browser, lambda b: _image_loaded(b, "map"), "the saved game's board")
    assert "human (hero)" in _text(browser, "#centres .hero")


def test_an_order_outside_the_legal_set_is_refused_in_the_browser(browser: Any, web: WebHandle) -> None:
    _start_game(browser, web, "ENGLAND", "bot:dumbbot", 1902)
    browser.execute_script(
        "const s = document.querySelector('#orders select'); const o = new Option('F LON - MOS', 'F LON - MOS');"
        "s.add(o); s.value = 'F LON - MOS';"
    )
    browser.find_element(By.ID, "submit").click()
    _wait(browser, lambda b: b.find_elements(By.ID, "error"), "the error")
    assert "'F LON - MOS' is not a legal order for" in _text(browser, "#error")
    assert _text(browser, "#phase") == "S1901M" and "Orders in" not in browser.page_source
    _shot(browser, "play_refused")


def test_every_page_says_so_without_a_run_and_a_token_server_sets_its_cookie(browser: Any, tmp_path: Path) -> None:
    web = start_web(tmp_path / "runs", port=0, client_factory=FakePolicyClients(), token="browser-token-0123456789")
    try:
        browser.get(web.url)
        assert "401" in browser.find_element(By.TAG_NAME, "body").text
        browser.get(web.login_url)
        _wait(browser, lambda b: b.current_url == web.url, "the redirect without the token")
        for page in ("", "league", "games"):
            browser.get(web.url + page)
            assert "No run yet under" in _text(browser, "#empty"), page
        browser.get(web.url + "play")
        assert "No run yet under" in _text(browser, "#norun-note")
        _shot(browser, "no_run")
    finally:
        web.stop()


def test_the_pages_work_under_their_content_security_policy(browser: Any, run_tree: RunTree, tmp_path: Path) -> None:
    """Found by review (N6): the pages could be framed by another site. They now send a content security
    policy that allows only this origin's scripts: the run picker and the error page's Back link (inline
    handlers before) work from app.js, the heatmap's style attributes still apply, and Chromium reports no
    violation of the policy on any page."""
    runs_dir = tmp_path / "runs"
    shutil.copytree(run_tree.run_dir, runs_dir / RUN)
    shutil.copytree(run_tree.run_dir, runs_dir / "other-run")
    web = start_web(runs_dir, port=0, client_factory=FakePolicyClients())
    try:
        browser.get_log("browser")  # what earlier tests left
        browser.get(f"{web.url}league?run={RUN}")
        cell = browser.find_element(By.CSS_SELECTOR, "#payoff td[style]")
        assert cell.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
        Select(browser.find_element(By.CSS_SELECTOR, "select[name=run]")).select_by_visible_text("other-run")
        _wait(browser, lambda b: b.current_url.endswith("?run=other-run"), "the run picker's submit")
        for page in ("", f"?run={RUN}", f"games?run={RUN}", f"play?run={RUN}"):
            browser.get(web.url + page)
        browser.get(f"{web.url}games/view?run={RUN}&id=nope")
        browser.find_element(By.ID, "back").click()
        _wait(browser, lambda b: b.current_url == f"{web.url}play?run={RUN}", "the Back link")
        refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
        assert refused == []
    finally:
        web.stop()
