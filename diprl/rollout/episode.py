"""`Episode`: warmup, fork one exact decision state into GRPO groups, play every fork to the horizon.

1. Start: spring 1901, or (a configurable share of matches, `rollout.start_states`) a stored mid-game
   state (`diprl.rollout.start_states`), so the policy also trains where games are won.
2. Warmup: a seeded random number of phases, every seat played by its own policy.
3. Advance to the next phase where the hero has a decision to fork: every movement phase, and a
   share (`adjustment_fork_share`) of its retreat, build and disband phases.
4. Fork that state G times and play every fork to the horizon (`horizon_years` later, or the end).
   With `fork_points` > 1, go on from one fork right after the forked phase to the hero's next decision
   and fork again.
5. Score and group: every seat in `Match.train` (the hero, and with `rollout.train_seats=learners`
   every seat the league filled with a learner's current version) that had a decision at the forked
   phase yields one `TrajectoryGroup` for its policy's learner: its G completions of the same state,
   its own returns and per-order rewards, the same credit rules. Every fork yields a `MatchResult`.

An episode is a lockstep job (`diprl.rollout.lockstep`): it yields the games to advance by one phase
and gets their outcomes back, so a rollout worker plays the phases of many matches (and of all their
forks and seats) in one policy call. A bad completion never ends an episode: the game layer replaces
what is not legal and reports it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diprl.bots import make_agent
from diprl.bots.base import Agent
from diprl.game import DiplomacyGame, PhaseKind
from diprl.game.replay import to_saved_game
from diprl.game.scoring import ranks
from diprl.messages import (
    Match,
    MatchResult,
    PlayCounts,
    PolicyRef,
    TrainingRecord,
    TrajectoryGroup,
    group_id,
    seat_texts,
)
from diprl.policy.vocab import TokenTable
from diprl.rollout.credit import CreditAssigner
from diprl.rollout.lockstep import PhaseOutcome, SeedFn, Table, TemperatureFn, Turn, request_seed
from diprl.rollout.rewards import Rubric, RubricScore
from diprl.rollout.start_states import StartStates

Phase = Generator[Sequence[Table], Sequence[PhaseOutcome], Any]


@dataclass
class EpisodeConfig:
    group_size: int = 4
    warmup_min_phases: int = 0
    warmup_max_phases: int = 12
    horizon_years: int = 1
    max_year: int = 1935
    temperature: float = 1.0
    # The temperature of every LLM decision that is not trained: the warmup, the forked phase's other LLM
    # seats, and each fork's turns after the forked decision (None: `temperature`). At 0 they are played
    # greedily: a group then compares its sampled decisions each followed by the greedy policy, on states
    # the greedy policy reaches, which is what a greedy evaluation measures; and the hero's own later
    # draws no longer add noise to the group's returns. Trained decisions always sample at `temperature`.
    untrained_temperature: float | None = None
    max_tokens: int = 384
    trace_fraction: float = 0.1
    max_advance_phases: int = 12  # phases to look for a hero decision to fork after the warmup
    # Share of the hero's retreat, build and disband decisions met after the warmup that are forked
    # (the rest are played on to the next movement decision). Without it those phase kinds never get
    # a gradient: waived builds and careless disbands would never be trained away.
    adjustment_fork_share: float = 0.5
    # Common random numbers: every fork of a group replays the same draws wherever the forks are not
    # being compared. Each fork gets its own copy of the rule bots, their random streams in the same state,
    # and every LLM decision but the compared ones (the trained seats at the forked phase, and their later
    # turns with train_turns=all) is sampled with a seed shared by all forks. Opponents then give the
    # forked phase the same orders in every fork, and later phases as nearly the same as the diverging
    # boards allow, so a group's returns differ by the compared decisions rather than by the dice.
    common_random_numbers: bool = True
    # Decision states forked per match. The match goes on from one of a group's forks (drawn from the match's
    # seed) as it stood right after the forked phase, to the hero's next decision, and forks that: a group
    # after the first costs no start and no warmup (docs/rollouts.md). The results are the last group's.
    fork_points: int = 1

    @property
    def played_temperature(self) -> float:
        """The temperature of the decisions that are not trained (`untrained_temperature`, else `temperature`)."""
        return self.temperature if self.untrained_temperature is None else self.untrained_temperature

    def __post_init__(self) -> None:
        for name in ("adjustment_fork_share", "trace_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"episode.{name} must be in [0, 1], got {value}")
        if self.horizon_years < 1:
            raise ValueError(f"episode.horizon_years must be >= 1, got {self.horizon_years}")
        if self.group_size < 1:
            raise ValueError(f"episode.group_size must be >= 1, got {self.group_size}")
        if self.fork_points < 1:
            raise ValueError(f"episode.fork_points must be >= 1, got {self.fork_points}")
        if self.untrained_temperature is not None and not 0.0 <= self.untrained_temperature < float("inf"):
            raise ValueError(
                "episode.untrained_temperature must be finite and >= 0 (0: greedy) or null, "
                f"got {self.untrained_temperature}"
            )
        if not 0 <= self.warmup_min_phases <= self.warmup_max_phases:
            raise ValueError(
                f"episode.warmup_min_phases ({self.warmup_min_phases}) must be in [0, warmup_max_phases "
                f"({self.warmup_max_phases})]"
            )


@dataclass
class EpisodeOutput:
    groups: list[TrajectoryGroup] = field(default_factory=list)
    results: list[MatchResult] = field(default_factory=list)
    trace: dict[str, Any] | None = None
    counts: PlayCounts = field(default_factory=PlayCounts)
    hero_returns: list[float] = field(default_factory=list)  # the hero's fork returns, trained on or not


@dataclass(eq=False)
class Episode:
    """Plays one `Match` as a lockstep job; holds the rubric, credit rules and (optional) start states.

    `start_share` of matches (drawn from each match's seed) start from a state of `start_states`.
    """

    config: EpisodeConfig
    rubric: Rubric
    credit: CreditAssigner
    table: TokenTable
    start_states: StartStates | None = None
    start_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_share <= 1.0:
            raise ValueError(f"rollout.start_states must be a share in [0, 1], got {self.start_share}")
        if self.start_share > 0 and self.start_states is None:
            raise ValueError("rollout.start_states > 0 needs a start-state store")

    def play(self, match: Match) -> Phase:
        """The job: yields tables to step, returns the `EpisodeOutput`. Deterministic given the match's
        seed and the policy's answers."""
        cfg = self.config
        rng = random.Random(match.seed)
        out = EpisodeOutput()
        game = self._start(rng)
        table = self._played(game, match, bots_for(match, rng))
        for _ in range(rng.randint(cfg.warmup_min_phases, cfg.warmup_max_phases)):
            if game.is_done:
                break
            self._count((yield [table]), match, out)
        next_table: Table | None = table
        for point in range(cfg.fork_points):
            if next_table is None or not (yield from self._advance_to_decision(next_table, match, rng, out)):
                break  # no decision left for the hero (eliminated, or the game ended): nothing more to train
            next_table = yield from self._fork_point(next_table, match, point, rng, out)
        return out

    def _fork_point(
        self, table: Table, match: Match, point: int, rng: random.Random, out: EpisodeOutput
    ) -> Generator[Sequence[Table], Sequence[PhaseOutcome], Table | None]:
        """Fork `table`'s game into a group, play the forks to the horizon, score them and add the groups,
        the hero's returns and the match's results (the last fork point's stand) to `out`.

        Returns where the match goes on when a fork point follows (None when none does): one of the
        forks (drawn from the match's seed) as it stood right after the forked phase, with its own bots.
        """
        cfg = self.config
        game = table.game
        forks = self._forks(game, match, table.bots, rng)
        keep = rng.randrange(len(forks)) if point + 1 < cfg.fork_points else None
        turns: list[dict[str, list[Turn]]] = [{} for _ in forks]
        first, kept = yield from self._play_to_horizon(forks, game.year + cfg.horizon_years, turns, match, out, keep)
        # `game` is never stepped after forking: it is every fork's pre-state for the per-order scores.
        scored = dict.fromkeys((match.hero, *match.train))
        scores = {power: [self.rubric.score(game, f.game, power) for f in forks] for power in scored}
        out.hero_returns += [s.total for s in scores[match.hero]]
        out.results = [_match_result(match, i, f.game, len(forks)) for i, f in enumerate(forks)]
        advantages: dict[str, list[float | None]] = {}
        for power in match.train:
            group, adv = self._group(match, power, game.phase, point, turns, scores[power], first, out)
            advantages[power] = adv
            if group is not None:
                out.groups.append(group)
        if rng.random() < cfg.trace_fraction and out.trace is None:
            out.trace = _trace(match, game.phase, forks, turns, scores, advantages)
        return kept

    # ---------------------------------------------------------------- stages
    def _played(self, game: DiplomacyGame, match: Match, bots: Mapping[str, Agent]) -> Table:
        """A table whose decisions are all played, none compared: the warmup's, and a match's way to its
        next fork point."""
        return Table(game, match.seats, bots, self.config.played_temperature, self.config.max_tokens)

    def _start(self, rng: random.Random) -> DiplomacyGame:
        cfg = self.config
        if self.start_states is not None and self.start_share > 0 and rng.random() < self.start_share:
            return DiplomacyGame.from_state(self.start_states.sample(rng), max_year=cfg.max_year)
        return DiplomacyGame(max_year=cfg.max_year)

    def _forks(self, game: DiplomacyGame, match: Match, bots: Mapping[str, Agent], rng: random.Random) -> list[Table]:
        """The group's G tables on copies of `game`; with common random numbers, each with its own copy of
        the bots (same stream state) and the shared sampling seeds of `fork_seeds`."""
        cfg = self.config
        is_compared = compared_decisions(game.phase, (match.hero, *match.train), self.credit.cfg.train_turns == "all")
        seeds = fork_seeds(rng.randrange(2**31), is_compared) if cfg.common_random_numbers else None
        temperature_of = None
        if cfg.untrained_temperature is not None:
            temperature_of = fork_temperatures(is_compared, cfg.temperature, cfg.untrained_temperature)
        return [
            Table(
                game.fork(),
                match.seats,
                bots if seeds is None else copy.deepcopy(bots),
                cfg.temperature,
                cfg.max_tokens,
                seeds,
                temperature_of,
            )
            for _ in range(cfg.group_size)
        ]

    def _advance_to_decision(
        self, table: Table, match: Match, rng: random.Random, out: EpisodeOutput
    ) -> Generator[Sequence[Table], Sequence[PhaseOutcome], bool]:
        """Play on to the hero's next forked decision; False when none comes within `max_advance_phases`."""
        cfg = self.config
        for advanced in range(cfg.max_advance_phases + 1):
            if table.game.is_done:
                return False
            kind = table.game.legal_orders(match.hero).kind
            if kind is PhaseKind.MOVEMENT or (kind is not PhaseKind.NONE and rng.random() < cfg.adjustment_fork_share):
                return True
            if advanced == cfg.max_advance_phases:
                return False
            self._count((yield [table]), match, out)
        return False

    def _play_to_horizon(
        self,
        forks: Sequence[Table],
        horizon_year: int,
        turns: list[dict[str, list[Turn]]],
        match: Match,
        out: EpisodeOutput,
        keep: int | None = None,
    ) -> Generator[Sequence[Table], Sequence[PhaseOutcome], tuple[list[dict[str, Turn]], Table | None]]:
        """Every fork played to `horizon_year` (or its end); each seat's turns collected per fork.

        Returns the turns of the forked phase itself (fork -> power -> turn): the decisions compared; and,
        for `keep`, a copy of that fork's table right after the forked phase, played as the warmup is.
        """
        first: list[dict[str, Turn]] = []
        kept: Table | None = None
        while True:
            playing = [k for k, f in enumerate(forks) if not f.game.is_done and f.game.year < horizon_year]
            if not playing:
                return first, kept
            outcomes = yield [forks[k] for k in playing]
            self._count(outcomes, match, out)
            for k, outcome in zip(playing, outcomes, strict=True):
                for power, turn in outcome.turns.items():
                    turns[k].setdefault(power, []).append(turn)
            if not first:
                first = [dict(o.turns) for o in outcomes]
                if keep is not None:
                    kept = self._played(forks[keep].game.fork(), match, copy.deepcopy(forks[keep].bots))

    def _count(self, outcomes: Sequence[PhaseOutcome], match: Match, out: EpisodeOutput) -> None:
        counts = out.counts
        counts.phases += len(outcomes)
        for outcome in outcomes:
            for power, turn in outcome.turns.items():
                counts.completions += 1
                counts.hero_completions += power == match.hero
                counts.bad_completions += turn.answer.bad
                if turn.answer.error is not None:
                    counts.failed_requests += 1
                    counts.first_error = counts.first_error or turn.answer.error

    def _group(
        self,
        match: Match,
        power: str,
        phase: str,
        point: int,
        turns: Sequence[Mapping[str, list[Turn]]],
        scores: Sequence[RubricScore],
        first: Sequence[Mapping[str, Turn]],
        out: EpisodeOutput,
    ) -> tuple[TrajectoryGroup | None, list[float | None]]:
        """`power`'s group: its forked completions compared by its own returns; and each fork's advantage.

        A fork whose forked decision failed (an engine error, a malformed answer: the game layer played
        holds) is not trained, so it is not part of the baseline either: its return would shift the
        mean and std of the forks that are. A seat with nothing to order at the forked phase has no group.
        """
        deciding = [k for k in range(len(first)) if power in first[k]]
        if not deciding:
            return None, [None] * len(first)
        compared = [k for k in deciding if first[k][power].answer.trainable]
        out.counts.untrainable_completions += len(deciding) - len(compared)
        per_fork: list[float | None] = [None] * len(first)
        if not compared:  # every forked decision failed: nothing to compare, nothing to train
            return None, per_fork
        returns = [scores[k].total for k in compared]
        advantages, std = self.credit.group_advantages(returns)
        if advantages is None:
            out.counts.skipped_zero_variance += 1
            return None, per_fork
        version = match.seats[power]
        records: list[TrainingRecord] = []
        all_turns = self.credit.cfg.train_turns == "all"
        for k, advantage in zip(compared, advantages, strict=True):
            per_fork[k] = advantage
            score = scores[k]
            for index, turn in enumerate(turns[k][power] if all_turns else [first[k][power]]):
                if not turn.answer.trainable:
                    out.counts.untrainable_completions += 1  # counted, never trained on, never fatal
                    continue
                # Per-order rewards are scored for the forked decision only; later turns carry the
                # fork's group advantage alone.
                order_rewards = score.order_rewards if index == 0 else {}
                records.append(self._record(turn, advantage, order_rewards, version, power, score))
        if not records:
            return None, per_fork
        group = TrajectoryGroup(
            group_id=group_id(match.match_id, phase, power, point),
            match_id=match.match_id,
            power=power,
            phase=phase,
            policy_version=version,
            records=records,
            returns=returns,
            advantage_std=std,
            hero=power == match.hero,
        )
        return group, per_fork

    def _record(
        self,
        turn: Turn,
        advantage: float,
        order_rewards: Mapping[str, float],
        version: PolicyRef,
        power: str,
        score: RubricScore,
    ) -> TrainingRecord:
        answer = turn.answer
        return TrainingRecord(
            prompt_ids=list(answer.prompt_ids),
            completion_ids=list(answer.token_ids),
            behaviour_logprobs=list(answer.logprobs),
            legal=turn.legal,
            advantages=self.credit.token_advantages(
                advantage, answer.token_ids, self.table.texts, answer.orders, order_rewards
            ),
            policy_version=version,
            temperature=self.config.temperature,
            power=power,
            phase=turn.phase,
            reward=score.total,
            reward_components=dict(score.components),
            order_rewards=dict(order_rewards),
        )


def compared_decisions(
    forked_phase: str, compared: Sequence[str], train_later_turns: bool
) -> Callable[[str, str], bool]:
    """(power, phase) -> whether that decision of a group's forks is one being compared (and trained): the
    `compared` seats (the hero and the trained seats) at the forked phase, and at every phase when later
    turns are trained too."""
    seats = frozenset(compared)

    def is_compared(power: str, phase: str) -> bool:
        return power in seats and (train_later_turns or phase == forked_phase)

    return is_compared


def fork_seeds(noise: int, is_compared: Callable[[str, str], bool]) -> SeedFn:
    """The sampling seed of each LLM decision in a group's forks: shared by all forks (`noise`, power,
    phase), except for the decisions being compared (`compared_decisions`), which sample freely (None). A
    seeded answer carries no behaviour log-probabilities (`diprl.policy.sampling`), so a trained turn is
    never seeded."""

    def seed(power: str, phase: str) -> int | None:
        return None if is_compared(power, phase) else request_seed(noise, power, phase)

    return seed


def fork_temperatures(is_compared: Callable[[str, str], bool], compared: float, untrained: float) -> TemperatureFn:
    """The temperature of each LLM decision in a group's forks: `compared` for the decisions being compared,
    `untrained` for every other."""

    def temperature(power: str, phase: str) -> float:
        return compared if is_compared(power, phase) else untrained

    return temperature


def bots_for(match: Match, rng: random.Random) -> dict[str, Agent]:
    """The rule agents of a match's bot seats, seeded from `rng` in sorted power order."""
    return {
        power: make_agent(match.ref(power).name, seed=rng.randrange(2**31))
        for power in sorted(match.seats)
        if match.ref(power).is_bot
    }


def _match_result(match: Match, fork: int, game: DiplomacyGame, forks: int) -> MatchResult:
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
        forks=forks,
    )


def _trace(
    match: Match,
    phase: str,
    forks: Sequence[Table],
    turns: Sequence[Mapping[str, list[Turn]]],
    scores: Mapping[str, Sequence[RubricScore]],
    advantages: Mapping[str, Sequence[float | None]],
) -> dict[str, Any]:
    """What a person needs to read an episode: each fork's replay, every LLM seat's completion at the
    forked phase, every scored seat's return, and the trained seats' per-order rewards and advantages."""
    hero = match.hero
    out_forks = []
    for k, fork in enumerate(forks):
        at_fork = {power: seat[0] for power, seat in turns[k].items() if seat and seat[0].phase == phase}
        hero_turn = at_fork.get(hero)
        out_forks.append(
            {
                "completion": hero_turn.answer.text if hero_turn else None,
                "orders": hero_turn.answer.orders if hero_turn else None,
                "complete": hero_turn.answer.complete if hero_turn else None,
                "return": scores[hero][k].total,
                "components": dict(scores[hero][k].components),
                "order_rewards": dict(scores[hero][k].order_rewards),
                "advantage": advantages.get(hero, [None] * len(forks))[k],
                "seats": {
                    power: {
                        "completion": turn.answer.text,
                        "orders": turn.answer.orders,
                        "return": scores[power][k].total if power in scores else None,
                        "order_rewards": dict(scores[power][k].order_rewards) if power in scores else {},
                        "advantage": advantages[power][k] if power in advantages else None,
                        "trained": power in advantages,
                    }
                    for power, turn in sorted(at_fork.items())
                },
                "replay": to_saved_game(fork.game, game_id=f"{match.match_id}-fork{k}"),
            }
        )
    return {
        "match": {
            "match_id": match.match_id,
            "seats": seat_texts(match.seats),
            "hero": hero,
            "seed": match.seed,
            "train": list(match.train),
        },
        "decision_phase": phase,
        "forks": out_forks,
    }
