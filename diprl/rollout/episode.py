"""`Episode`: warmup, fork one exact decision state into a GRPO group, play every fork to the horizon.

1. Warmup: a seeded random number of phases, every seat played by its own policy.
2. Advance to the next movement phase where the hero has units: the decision state.
3. Fork it G times. At that phase the hero samples G completions (one per fork); every other LLM seat
   samples per fork too; rule bots decide locally. All LLM requests of all forks go to the policy in
   ONE batched call per phase, then every fork steps.
4. Play all forks to the horizon (`horizon_years` later, or the end of the game), batched the same way.
5. Score each fork the same way (outcome at the horizon, shaping along the way, per-order rewards of
   the hero's decision from a counterfactual re-adjudication), turn returns into group advantages and
   per-token advantages, and emit one `TrajectoryGroup` plus a `MatchResult` per fork.

A bad completion never ends an episode: the game layer replaces what is not legal and reports it.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diprl.bots import make_agent
from diprl.bots.base import Agent
from diprl.game import DiplomacyGame, PhaseKind, PhaseRecord
from diprl.game.replay import to_saved_game
from diprl.game.scoring import ranks
from diprl.policy.prompt import build_prompt
from diprl.policy.vocab import TokenTable
from diprl.rollout.clients import PolicyClient
from diprl.rollout.credit import CreditAssigner
from diprl.rollout.rewards import Rubric
from diprl.rollout.types import Match, MatchResult, TrainingRecord, TrajectoryGroup, bot_name, is_bot


@dataclass
class EpisodeConfig:
    group_size: int = 4
    warmup_min_phases: int = 0
    warmup_max_phases: int = 12
    horizon_years: int = 1
    max_year: int = 1935
    temperature: float = 1.0
    max_tokens: int = 384
    trace_fraction: float = 0.1
    max_advance_phases: int = 12  # phases to look for a hero decision to fork after the warmup
    # Share of the hero's retreat, build and disband decisions met after the warmup that are forked
    # (the rest are played on to the next movement decision). Without it those phase kinds never get
    # a gradient: waived builds and careless disbands would never be trained away.
    adjustment_fork_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.adjustment_fork_share <= 1.0:
            raise ValueError(f"episode.adjustment_fork_share must be in [0, 1], got {self.adjustment_fork_share}")


@dataclass
class EpisodeOutput:
    group: TrajectoryGroup | None
    results: list[MatchResult]
    trace: dict[str, Any] | None
    skipped_zero_variance: bool
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage: engine, inference, rewards
    phases: int = 0  # fork-phases stepped (each fork's phase counts once)
    completions: int = 0
    bad_completions: int = 0
    untrainable_completions: int = 0  # hero completions with an error or no tokens: left out of the group
    returns: list[float] = field(default_factory=list)  # the forks' returns, trained on or not


@dataclass(frozen=True)
class HeroTurn:
    """One LLM seat's turn: the phase, the legal orders it was constrained by, and the server's answer."""

    phase: str
    legal: dict[str, Any]
    answer: dict[str, Any]


class Episode:
    def __init__(
        self, config: EpisodeConfig, rubric: Rubric, credit: CreditAssigner, client: PolicyClient, table: TokenTable
    ) -> None:
        self.config = config
        self.rubric = rubric
        self.credit = credit
        self.client = client
        self.table = table

    # ---------------------------------------------------------------- play
    def _play_phase(
        self,
        games: Sequence[DiplomacyGame],
        match: Match,
        bots: dict[str, Agent],
        out: EpisodeOutput,
        active: Sequence[bool] | None = None,
    ) -> tuple[list[PhaseRecord | None], dict[tuple[int, str], HeroTurn]]:
        """One phase of every active, unfinished game; all LLM requests of all games in one batched call.

        Returns each game's phase record and, per (game index, power) LLM seat, the turn it played.
        """
        playing = [not g.is_done and (active is None or active[i]) for i, g in enumerate(games)]
        orders: list[dict[str, list[str]]] = [{} for _ in games]
        requests: list[dict[str, Any]] = []
        where: list[tuple[int, str]] = []
        for i, game in enumerate(games):
            if not playing[i]:
                continue
            for power in game.orderable_powers():
                ref = match.seats[power]
                if is_bot(ref):
                    orders[i][power] = bots[power].orders(game, power)
                else:
                    requests.append(
                        {
                            "policy": ref,
                            "prompt": build_prompt(game, power).text,
                            "legal": game.legal_orders(power).to_dict(),
                            "temperature": self.config.temperature,
                            "max_tokens": self.config.max_tokens,
                        }
                    )
                    where.append((i, power))
        start = time.perf_counter()
        answers = self.client.generate(requests) if requests else []
        out.timings["inference"] += time.perf_counter() - start
        by_seat: dict[tuple[int, str], HeroTurn] = {}
        for (i, power), request, answer in zip(where, requests, answers, strict=True):
            by_seat[(i, power)] = HeroTurn(phase=games[i].phase, legal=request["legal"], answer=answer)
            out.completions += 1
            if answer.get("error") or not answer.get("complete", False):
                out.bad_completions += 1
            orders[i][power] = list(answer.get("orders") or [])  # the game layer fills defaults and reports
        start = time.perf_counter()
        records = [game.step(orders[i]) if playing[i] else None for i, game in enumerate(games)]
        out.timings["engine"] += time.perf_counter() - start
        out.phases += sum(r is not None for r in records)
        return records, by_seat

    def run(self, match: Match) -> EpisodeOutput:
        cfg = self.config
        rng = random.Random(match.seed)
        out = EpisodeOutput(group=None, results=[], trace=None, skipped_zero_variance=False)
        out.timings = defaultdict(float)
        game = DiplomacyGame(max_year=cfg.max_year)
        bots = {
            power: make_agent(bot_name(ref), seed=rng.randrange(2**31))
            for power, ref in sorted(match.seats.items())
            if is_bot(ref)
        }
        for _ in range(rng.randint(cfg.warmup_min_phases, cfg.warmup_max_phases)):
            if game.is_done:
                break
            self._play_phase([game], match, bots, out)
        forked = False
        for advanced in range(cfg.max_advance_phases + 1):
            if game.is_done:
                break
            kind = game.legal_orders(match.hero).kind
            if kind is PhaseKind.MOVEMENT or (kind is not PhaseKind.NONE and rng.random() < cfg.adjustment_fork_share):
                forked = True
                break
            if advanced == cfg.max_advance_phases:
                break
            self._play_phase([game], match, bots, out)
        if not forked:
            return out  # no decision left for the hero (eliminated, or the game ended): nothing to train

        root_phase, root_year = game.phase, game.year
        forks = [game.fork() for _ in range(cfg.group_size)]
        _, first_turns = self._play_phase(forks, match, bots, out)
        hero_turns: list[list[HeroTurn]] = [
            [first_turns[(i, match.hero)]] if (i, match.hero) in first_turns else [] for i in range(len(forks))
        ]
        hero_answers = [turns[0].answer if turns else {} for turns in hero_turns]

        def before_horizon() -> list[bool]:
            return [not f.is_done and f.year < root_year + cfg.horizon_years for f in forks]

        while any(before_horizon()):
            _, later = self._play_phase(forks, match, bots, out, before_horizon())
            for i in range(len(forks)):
                if (i, match.hero) in later:
                    hero_turns[i].append(later[(i, match.hero)])

        start = time.perf_counter()
        scores = []
        for fork in forks:
            # `game` is never stepped after forking: it is every fork's pre-state for the support check.
            scores.append(self.rubric.score(game, fork, match.hero))
        returns = [s.total for s in scores]
        out.returns = list(returns)
        out.results = [_match_result(match, i, f) for i, f in enumerate(forks)]
        # A fork whose forked decision failed (an engine error, a malformed answer: the game layer
        # played holds) is not trained, so it is not part of the baseline either: its return would
        # shift the mean and std of the forks that are.
        compared = [i for i, turns in enumerate(hero_turns) if turns and _trainable(turns[0].answer)]
        out.untrainable_completions += len(forks) - len(compared)
        advantages, std = self.credit.group_advantages([returns[i] for i in compared])
        if advantages is None:
            out.skipped_zero_variance = True
        elif match.trains:
            all_turns = self.credit.cfg.train_turns == "all"
            records = []
            for i, advantage in zip(compared, advantages, strict=True):
                turns, score = hero_turns[i], scores[i]
                for turn_index, turn in enumerate(turns if all_turns else turns[:1]):
                    answer = turn.answer
                    if not _trainable(answer):
                        out.untrainable_completions += 1  # counted, never trained on, never fatal
                        continue
                    # Per-order rewards are scored for the forked decision only; later turns carry the
                    # fork's group advantage alone.
                    order_rewards = score.order_rewards if turn_index == 0 else {}
                    token_adv = self.credit.token_advantages(
                        advantage, answer["token_ids"], self.table.texts, answer.get("orders") or [], order_rewards
                    )
                    records.append(
                        TrainingRecord(
                            prompt_ids=list(answer["prompt_ids"]),
                            completion_ids=list(answer["token_ids"]),
                            behaviour_logprobs=list(answer["logprobs"]),
                            legal=turn.legal,
                            advantages=token_adv,
                            policy_version=match.seats[match.hero],
                            temperature=cfg.temperature,
                            power=match.hero,
                            phase=turn.phase,
                            reward=score.total,
                            reward_components=dict(score.components),
                            order_rewards=dict(order_rewards),
                        )
                    )
            out.group = (
                None
                if not records
                else TrajectoryGroup(
                    group_id=f"{match.match_id}/{root_phase}",
                    match_id=match.match_id,
                    hero=match.hero,
                    phase=root_phase,
                    policy_version=match.seats[match.hero],
                    records=records,
                    returns=[returns[i] for i in compared],
                    advantage_std=std,
                )
            )
        out.timings["rewards"] += time.perf_counter() - start
        if rng.random() < cfg.trace_fraction:
            out.trace = _trace(match, root_phase, forks, hero_answers, scores, returns)
        out.timings = dict(out.timings)
        return out


def _trainable(answer: Mapping[str, Any]) -> bool:
    """A completion the learner can use: no error, and the ids it needs to recompute logprobs."""
    return not answer.get("error") and bool(answer.get("token_ids")) and bool(answer.get("prompt_ids"))


def _match_result(match: Match, fork: int, game: DiplomacyGame) -> MatchResult:
    centres = game.centre_counts()
    return MatchResult(
        match_id=match.match_id,
        fork=fork,
        seats=dict(match.seats),
        hero=match.hero,
        centres=centres,
        ranks=ranks(centres),
        final_phase=game.phase,
        solo=game.solo_winner(),
    )


def _trace(
    match: Match,
    root_phase: str,
    forks: Sequence[DiplomacyGame],
    answers: Sequence[dict[str, Any]],
    scores: Sequence[Any],
    returns: Sequence[float],
) -> dict[str, Any]:
    """What a person needs to read an episode: replay, the hero's completions and every reward."""
    return {
        "match": {"match_id": match.match_id, "seats": match.seats, "hero": match.hero, "seed": match.seed},
        "decision_phase": root_phase,
        "forks": [
            {
                "completion": answer.get("text"),
                "orders": answer.get("orders"),
                "complete": answer.get("complete"),
                "return": ret,
                "components": dict(score.components),
                "order_rewards": dict(score.order_rewards),
                "replay": to_saved_game(fork, game_id=f"{match.match_id}-fork{i}"),
            }
            for i, (fork, answer, score, ret) in enumerate(zip(forks, answers, scores, returns, strict=True))
        ],
    }
