"""The league: pool, payoff, PFSP, ratings, Nash, snapshot rules and the LeagueManager actor (no torch)."""

from diprl.league.config import LeagueConfig, load_league_config
from diprl.league.manager import LeagueManager, league_actor

__all__ = ["LeagueConfig", "LeagueManager", "league_actor", "load_league_config"]
