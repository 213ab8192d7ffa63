"""Frozen adapters from elsewhere (`train.frozen_adapters`): another run's policy is published once into a run's
store as `<name>@v1`, a league may name it as an anchor, and every misuse is named before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.inference.adapters import AdapterStore
from diprl.league.config import LeagueConfig
from diprl.league.manager import LeagueManager
from diprl.league.matchmaking import ANCHORS
from diprl.policy.models import save_random_lora
from diprl.run.config import ConfigError, compose_config
from diprl.run.frozen import frozen_problems, publish_frozen
from tests.league.helpers import hero_wins


def test_a_frozen_adapter_is_published_once_byte_for_byte(tmp_path: Path) -> None:
    source = save_random_lora(tmp_path / "elsewhere" / "v7", seed=3)
    root = tmp_path / "run" / "adapters"
    assert publish_frozen({"target": str(source)}, root) == {"target": "target@v1"}
    assert publish_frozen({"target": str(source)}, root) == {"target": "target@v1"}  # a resume: already there
    store = AdapterStore(root)
    assert [str(r) for r in store.versions("target")] == ["target@v1"]
    published = store.resolve("target@v1").path
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (published / name).read_bytes() == (source / name).read_bytes()
    with pytest.raises(ConfigError, match="not a directory"):
        publish_frozen({"other": str(tmp_path / "missing")}, root)
    with pytest.raises(ConfigError, match=r"frozen_adapters\.junk"):
        publish_frozen({"junk": str(tmp_path / "elsewhere")}, root)  # a directory, but no adapter in it


def test_misused_frozen_adapters_are_named_before_anything_starts() -> None:
    assert frozen_problems({"target": "/x"}, ["main"], ["target@v1", "bot:dumbbot"]) == []
    assert "trained role" in frozen_problems({"main": "/x"}, ["main"], [])[0]
    (missing,) = frozen_problems({}, ["main"], ["target@v1"])
    assert "+train.frozen_adapters.target=" in missing
    (wrong_version,) = frozen_problems({"target": "/x"}, ["main"], ["target@v2"])
    assert "name it target@v1" in wrong_version
    config, _ = compose_config(
        ["+experiment=dumbbot", "league.anchors=[target@v1]", "+train.frozen_adapters.target=/some/where"]
    )
    assert config.train.frozen_adapters == {"target": "/some/where"} and config.league.anchors == ["target@v1"]
    with pytest.raises(ConfigError, match="not in this run's store"):
        compose_config(["+experiment=dumbbot", "league.anchors=[target@v1]"])
    with pytest.raises(ValueError, match="version of a trained role"):
        LeagueConfig(anchors=["main@v3"])


def test_an_exploiter_plays_a_frozen_anchor_in_all_six_seats(tmp_path: Path) -> None:
    """The bench's exploiter: main against the frozen anchor alone; the anchor is played, never trained."""
    config = LeagueConfig(roles=["main"], anchors=["target@v1"])
    config.main.anchors = 1.0
    league = LeagueManager(config, run_dir=tmp_path)
    league.register_version("main", "main@v1", 0)
    match = league.next_match("main")
    assert sorted({str(ref) for power, ref in match.seats.items() if power != match.hero}) == ["target@v1"]
    assert str(match.seats[match.hero]) == "main@v1" and list(match.train) == [match.hero]
    assert league.counts["main"][ANCHORS] == 1
    league.report(hero_wins(match))
    assert league.payoff.win_rate("main", "target@v1") == 1.0
