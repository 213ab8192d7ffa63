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
