"""The "league" actor on a real local Ray cluster: killed, restarted by Ray, pool and payoff intact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from diprl.league import LeagueConfig, league_actor
from diprl.raysession import connect

from .helpers import hero_wins

ray = pytest.importorskip("ray")


def test_killed_league_actor_restarts_with_its_state(tmp_path: Path) -> None:
    connect(address="local", num_cpus=1)
    try:
        config = LeagueConfig(roles=["main"], snapshot_steps=1)
        league = league_actor(config, tmp_path)
        ray.get(league.register_version.remote("main", "main@v1", 0))
        for _ in range(4):
            match = ray.get(league.next_match.remote("main"))
            ray.get(league.report.remote(hero_wins(match)))
        assert ray.get(league.register_version.remote("main", "main@v2", 3)).snapshot
        before = ray.get(league.summary.remote())
        pid = ray.get(league.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(league, no_restart=False)
        deadline = time.monotonic() + 60
        while True:  # calls during the restart are retried by Ray (max_task_retries=-1)
            after = ray.get(league.summary.remote(), timeout=60)
            if ray.get(league.__ray_call__.remote(lambda self: os.getpid())) != pid or time.monotonic() > deadline:
                break
        assert ray.get(league.__ray_call__.remote(lambda self: os.getpid())) != pid
        assert after["pool"] == before["pool"] and after["payoff"] == before["payoff"]
        assert [m["member"] for m in after["pool"]] == ["bot:random", "bot:dumbbot", "base", "main", "main@v2"]
        assert ray.get(league.current.remote("main")) == "main@v2"
        # get_if_exists: a restarted driver gets the running actor back, not a second league
        again = league_actor(config, tmp_path)
        assert again._actor_id == league._actor_id
        assert ray.get(again.__ray_call__.remote(lambda self: os.getpid())) == ray.get(
            league.__ray_call__.remote(lambda self: os.getpid())
        )
        assert ray.get(again.current.remote("main")) == "main@v2"
    finally:
        ray.shutdown()
