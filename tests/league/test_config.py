"""The league presets load, validate, and the `pfsp` file states exactly the dataclass defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.league.config import LeagueConfig, load_league_config, register_configs


def test_presets_load() -> None:
    assert load_league_config("pfsp") == LeagueConfig()  # the file documents the defaults: keep them equal
    assert load_league_config("league").roles == ["main", "main_exploiter", "league_exploiter"]
    selfplay = load_league_config("selfplay")
    assert selfplay.main.self_play == 1.0 and selfplay.main.anchors == 0.0
    assert load_league_config("dumbbot").anchors == ["bot:dumbbot"]
    register_configs()


def test_bad_files_name_themselves(tmp_path: Path) -> None:
    (tmp_path / "league").mkdir()
    (tmp_path / "league" / "typo.yaml").write_text("decay: 0.99\nsnapshot_step: 3\n")
    with pytest.raises(ValueError, match=r"typo\.yaml"):
        load_league_config("typo", tmp_path)
    (tmp_path / "league" / "range.yaml").write_text("main:\n  anchors: 1.5\n")
    with pytest.raises(ValueError, match="anchors"):
        load_league_config("range", tmp_path)
    with pytest.raises(KeyError, match="known"):
        load_league_config("nope")


def test_match_weights_name_trained_roles_and_are_positive() -> None:
    league = load_league_config("league")
    assert league.match_weights == {"main": 1.0, "main_exploiter": 3.0, "league_exploiter": 3.0}
    assert LeagueConfig().match_weights == {}  # none named: every role weighs 1 (tests/test_match_scheduler.py)
    with pytest.raises(ValueError, match=r"names \['main_exploiter'\], which are not in league.roles"):
        LeagueConfig(match_weights={"main_exploiter": 2.0})
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="match_weights must be positive finite numbers"):
            LeagueConfig(match_weights={"main": bad})
