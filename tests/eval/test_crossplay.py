"""Crossplay: payoff by hand, Nash weights on a dominance and a rock-paper-scissors fixture, the CLI matrix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diprl import evaluate
from diprl.eval.config import GamesConfig
from diprl.eval.crossplay import crossplay_configs, outrank_share, summarize_crossplay
from diprl.eval.suite import SuiteConfig
from diprl.game.scoring import ranks as ranks_of

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def test_outrank_share_by_hand() -> None:
    centres = dict(zip(POWERS, [6, 6, 3, 8, 0, 5, 6], strict=True))
    # AUSTRIA (6) beats FRANCE, ITALY, RUSSIA (3), ties ENGLAND and TURKEY (2 x 0.5), loses to GERMANY: 4/6.
    others = [p for p in POWERS if p != "AUSTRIA"]
    assert outrank_share(centres, "AUSTRIA", others) == pytest.approx(4 / 6)


def game(hero: str, hero_ref: str, other_ref: str, hero_centres: int) -> dict[str, Any]:
    """A finished game where the hero has `hero_centres` and every other seat 4."""
    centres = {p: (hero_centres if p == hero else 4) for p in POWERS}
    return {"hero_power": hero, "seats": {p: hero_ref if p == hero else other_ref for p in POWERS},
            "centres": centres, "ranks": ranks_of(centres)}  # fmt: skip


def pair(a: str, b: str, hero_centres: int) -> dict[str, Any]:
    return {"policy": a, "opponents": [b], "label": f"{a} vs {b}", "hero_solo_rate": 0.0, "hero_mean_sc": 0.0,
            "per_game": [game(p, a, b, hero_centres) for p in POWERS]}  # fmt: skip


def test_a_dominant_policy_takes_all_nash_weight() -> None:
    # strong outranks every weak seat as hero (payoff 1), weak outranks no strong seat (payoff 0).
    summary = summarize_crossplay(
        ["strong@v1", "weak@v1"], [pair("strong@v1", "weak@v1", 9), pair("weak@v1", "strong@v1", 1)]
    )
    assert summary["payoff"] == [[None, 1.0], [0.0, None]]
    assert summary["games"] == [[0, 7], [7, 0]]
    assert summary["nash"]["strong@v1"] == pytest.approx(1.0, abs=1e-6)
    assert summary["ratings"]["strong@v1"]["mu"] > summary["ratings"]["weak@v1"]["mu"]


def test_rock_paper_scissors_gives_uniform_nash() -> None:
    refs = ["rock@v1", "paper@v1", "scissors@v1"]
    beats = {("paper@v1", "rock@v1"), ("scissors@v1", "paper@v1"), ("rock@v1", "scissors@v1")}
    reports = [pair(a, b, 9 if (a, b) in beats else 1) for a in refs for b in refs if a != b]
    summary = summarize_crossplay(refs, reports)
    for ref in refs:
        assert summary["nash"][ref] == pytest.approx(1 / 3, abs=1e-4)
        assert summary["nash_payoff"][ref] == pytest.approx(0.0, abs=1e-6)


def test_configs_cover_every_ordered_pair_once() -> None:
    template = SuiteConfig(play=GamesConfig(games=7, replays=2), replay_dir="replays")
    configs = crossplay_configs(["bot:random", "bot:hold", "base"], template)
    assert sorted((c.policy, c.opponents[0]) for c in configs) == sorted(
        (a, b) for a in ("bot:random", "bot:hold", "base") for b in ("bot:random", "bot:hold", "base") if a != b
    )
    assert all(c.play.games == 7 and c.play.replays == 0 and c.replay_dir is None for c in configs)
    with pytest.raises(ValueError, match="distinct"):
        crossplay_configs(["bot:random", "bot:random"], SuiteConfig())


def test_cli_crossplay_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["policy=bot:dumbbot", "opponents=bot:hold", "games=7", "max_year=1902", f"out={tmp_path}",
            "crossplay=[bot:dumbbot,bot:hold]", "crossplay_replays=1", "critical_supports=false",
            "progress=false"]  # fmt: skip
    assert evaluate.main(argv) == 0
    printed = capsys.readouterr().out
    # Each pair's first game is a replay of its own, printed for the browser; the main suite keeps none.
    pairs = sorted(p.name for p in (tmp_path / "crossplay_replays").iterdir())
    assert pairs == ["bot_dumbbot_vs_bot_hold", "bot_hold_vs_bot_dumbbot"]
    for pair in pairs:
        assert sorted(p.name for p in (tmp_path / "crossplay_replays" / pair).iterdir()) == ["game0000"]
        assert str(tmp_path / "crossplay_replays" / pair / "game0000" / "index.html") in printed
    assert not (tmp_path / "replays").exists()
    report = json.loads((tmp_path / "report.json").read_text())
    cross = report["crossplay"]
    assert cross["policies"] == ["bot:dumbbot", "bot:hold"]
    # DumbBot grows while HoldBot never moves: DumbBot outranks holders, holders never outrank DumbBot.
    assert cross["payoff"][0][1] > 0.5 > cross["payoff"][1][0]
    assert cross["nash"]["bot:dumbbot"] > 0.99
    assert (tmp_path / "crossplay.png").is_file()
    assert "crossplay payoff" in printed
