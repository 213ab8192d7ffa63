"""Episode without Ray or an engine: which seats and turns become groups of TrainingRecords, and how."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from diprl.game import PowerOrders
from diprl.messages import Generation, GenerationRequest, Match, TrainingRecord, parse_seats
from diprl.policy.constraint import OrderConstraint
from diprl.policy.models import load_preset, logits_width, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table
from diprl.rollout.clients import UniformConstrainedClient
from diprl.rollout.credit import CreditAssigner, CreditConfig
from diprl.rollout.episode import Episode, EpisodeConfig, EpisodeOutput
from diprl.rollout.rewards import Rubric, load_reward_config
from diprl.rollout.start_states import StartStateRecipe, load_or_build
from tests.rollout.play import play_matches

POWERS = ["AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY"]


@cache
def _table() -> tuple[Any, TokenTable]:
    preset = load_preset("tiny")
    tokenizer = load_tokenizer(resolve_model_path(preset))
    return tokenizer, token_table(tokenizer, logits_width(preset))


def _client(seed: int = 3) -> UniformConstrainedClient:
    tokenizer, table = _table()
    return UniformConstrainedClient(table, seed=seed, tokenizer=tokenizer)


def _episode(train_turns: str = "fork", group_size: int = 3, **episode: Any) -> Episode:
    _, table = _table()
    credit = CreditAssigner(CreditConfig(train_turns=train_turns))
    options: dict[str, Any] = {"warmup_max_phases": 0, "horizon_years": 1, "trace_fraction": 0.0} | episode
    return Episode(
        EpisodeConfig(group_size=group_size, **options), Rubric(load_reward_config("default")), credit, table
    )


def _run(episode: Episode, match: Match, client: Any = None) -> EpisodeOutput:
    [out], _ = play_matches(episode, [match], client or _client())
    return out


def _match(seed: int, hero: str = "FRANCE", main_seats: Sequence[str] = ("FRANCE",), trained: bool = True) -> Match:
    seats = {p: "bot:random" for p in POWERS} | {p: "main@v2" for p in main_seats}
    return Match(f"t{seed}", parse_seats(seats), hero=hero, seed=seed, train=tuple(main_seats) if trained else ())


def _check_records(records: list[TrainingRecord]) -> None:
    _, table = _table()
    for record in records:
        n = len(record.completion_ids)
        assert n > 0 and len(record.behaviour_logprobs) == n == len(record.advantages)
        legal = PowerOrders.from_dict(record.legal)
        assert legal.phase == record.phase, "each record carries the legal orders of its own phase"
        OrderConstraint(legal, table).masks_for(record.completion_ids)  # raises if off-grammar


def test_fork_turns_train_only_the_forked_decision() -> None:
    out = _run(_episode("fork"), _match(0))
    [group] = out.groups
    assert len(group.records) == 3 and group.power == "FRANCE" and group.hero
    assert {r.phase for r in group.records} == {group.phase} and group.group_id == f"t0/{group.phase}/FRANCE"
    _check_records(group.records)


def test_all_turns_train_every_hero_turn_of_each_fork_with_its_group_advantage() -> None:
    # Seed 28: a match whose forks' returns differ (a group), found by search like the seeds below; the
    # uniform client's draws depend on the constraint's masks, so a change of the grammar can move them.
    [fork_group] = _run(_episode("fork"), _match(28)).groups
    [all_group] = _run(_episode("all"), _match(28)).groups
    records = all_group.records
    # Spring decision + autumn + (maybe retreats) + winter adjustments: more than one turn per fork.
    assert len(records) > 3
    phases = [r.phase for r in records]
    assert phases.count(all_group.phase) == 3 and len(set(phases)) > 1
    _check_records(records)
    # Same seeds, same play: the forked decision's records are identical under both settings.
    first = [r for r in records if r.phase == all_group.phase]
    assert [r.completion_ids for r in first] == [r.completion_ids for r in fork_group.records]
    # Later turns carry their fork's group advantage alone (no per-order term): one value per completion.
    for r in records:
        if r.phase != all_group.phase:
            assert len(set(r.advantages)) == 1 and r.order_rewards == {}


def test_every_trained_seat_yields_its_own_group_of_the_same_state() -> None:
    """A self-play-like match: main holds three seats, all trained; each seat is compared on its own returns."""
    seats = ("FRANCE", "GERMANY", "ITALY")
    out = _run(_episode("fork", group_size=4), _match(4, main_seats=seats))
    assert sorted(g.power for g in out.groups) == sorted(seats)
    phases = {g.phase for g in out.groups}
    assert len(phases) == 1, "every group forks the same decision state"
    for group in out.groups:
        assert group.hero == (group.power == "FRANCE") and len(group.records) == 4
        assert {r.power for r in group.records} == {group.power}
        assert [r.reward for r in group.records] == group.returns
        _check_records(group.records)
    # Each seat's own returns, not the hero's: the groups' returns differ from each other.
    assert len({tuple(g.returns) for g in out.groups}) == 3
    # The hero's returns are reported whatever is trained; results: one per fork, each weighing 1/G.
    assert out.hero_returns == next(g.returns for g in out.groups if g.hero)
    assert [r.forks for r in out.results] == [4] * 4


def test_seats_not_in_train_are_played_never_trained() -> None:
    """main in three seats but only the hero listed (rollout.train_seats=hero): one group."""
    match = replace(_match(8, main_seats=("FRANCE", "GERMANY", "ITALY")), train=("FRANCE",))
    assert [g.power for g in _run(_episode(), match).groups] == ["FRANCE"]
    nothing = _run(_episode(), _match(4, trained=False))
    assert nothing.groups == [] and len(nothing.results) == 3  # played and measured, not trained


class _FailsOneFork:
    """The uniform client, except that the second fork's forked decision comes back as an engine error."""

    def __init__(self, inner: UniformConstrainedClient) -> None:
        self.inner = inner
        self.calls = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        answers = self.inner.generate(requests)
        self.calls += 1
        if self.calls == 1:  # warmup 0 at S1901M: the first call is the forked decision of every fork
            answers[1] = Generation.failed(answers[1].policy, "EngineDead: replica restarting")
        return answers


def test_a_fork_whose_decision_failed_is_left_out_of_the_baseline() -> None:
    episode = _episode("fork", group_size=4)
    out = _run(episode, _match(8), _FailsOneFork(_client()))
    [group] = out.groups
    assert len(out.results) == 4, "the failed fork still played (holds) and reports"
    kept = [r for i, r in enumerate(out.hero_returns) if i != 1]
    assert group.returns == kept and len(group.records) == 3
    expected, _ = CreditAssigner(episode.credit.cfg).group_advantages(kept)
    assert expected is not None
    _, table = _table()
    for record, advantage in zip(group.records, expected, strict=True):
        orders = list(record.order_rewards)
        rebuilt = episode.credit.token_advantages(
            advantage, record.completion_ids, table.texts, orders, record.order_rewards
        )
        assert record.advantages == pytest.approx(rebuilt)
    assert out.counts.untrainable_completions == 1
    # Counted for the driver, which ends a run whose every request fails, with the server's words.
    assert (out.counts.failed_requests, out.counts.first_error) == (1, "EngineDead: replica restarting")


def _forked_kind(share: float) -> str:
    """The phase kind of the forked decision of a match whose warmup (7 phases, seed 327) ends at an
    adjustment where France builds: found by search, fixed by the seeds (and the tokenizer, through the
    uniform client's draws)."""
    episode = _episode("fork", group_size=2, warmup_min_phases=7, warmup_max_phases=7, adjustment_fork_share=share)
    [group] = _run(episode, _match(327)).groups
    return f"{group.phase[-1]} {PowerOrders.from_dict(group.records[0].legal).kind.value}"


def test_builds_and_disbands_are_forked_at_the_configured_share() -> None:
    assert _forked_kind(1.0) == "A build"
    assert _forked_kind(0.0).endswith(" movement")  # played on to the next movement decision
    with pytest.raises(ValueError, match="adjustment_fork_share"):
        EpisodeConfig(adjustment_fork_share=1.5)


def test_the_trace_shows_every_seat_of_every_fork_with_returns_and_advantages() -> None:
    out = _run(_episode(trace_fraction=1.0, group_size=2), _match(8, main_seats=("FRANCE", "ITALY")))
    trace = out.trace
    assert trace is not None and trace["match"]["train"] == ["FRANCE", "ITALY"]
    groups = {g.power: g for g in out.groups}
    for k, fork in enumerate(trace["forks"]):
        assert fork["return"] == out.hero_returns[k] and fork["replay"]["phases"]
        assert set(fork["seats"]) == {"FRANCE", "ITALY"}  # the LLM seats at the forked phase
        for power, seat in fork["seats"].items():
            assert seat["trained"] and seat["return"] == groups[power].returns[k]
            assert seat["advantage"] is not None


def test_a_share_of_matches_starts_from_stored_mid_game_states(tmp_path: Any) -> None:
    store = load_or_build(StartStateRecipe(games=1, mixes=(("dumbbot",) * 7,)), root=tmp_path)
    assert store.years[0] == 1901 and store.years[-1] > 1910
    assert all(kind in ("M", "A") for kinds in store.by_year.values() for kind in kinds)  # no retreat starts
    _, table = _table()
    config = EpisodeConfig(group_size=2, warmup_max_phases=0, trace_fraction=0.0)
    rubric, credit = Rubric(load_reward_config("default")), CreditAssigner(CreditConfig())
    episode = Episode(config, rubric, credit, table, store, start_share=1.0)
    years = {
        int(g.phase[1:5])
        for out in play_matches(episode, [_match(s) for s in range(6)], _client())[0]
        for g in out.groups
    }
    assert max(years) > 1905, f"starts from later years: {sorted(years)}"
    with pytest.raises(ValueError, match="start-state store"):
        Episode(config, rubric, credit, table, start_share=0.5)
    # A corrupt cache file is rebuilt, not trusted.
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")
    assert load_or_build(StartStateRecipe(games=1, mixes=(("dumbbot",) * 7,)), root=tmp_path).years == store.years


class _FailsEveryFork(_FailsOneFork):
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        answers = self.inner.generate(requests)
        self.calls += 1
        if self.calls == 1:
            answers = [Generation.failed(a.policy, "EngineDead: replica restarting") for a in answers]
        return answers


def test_a_decision_that_failed_in_every_fork_yields_no_group_and_no_error() -> None:
    """Found by the web app's tests: no trainable fork raised out of the episode (an empty comparison)."""
    out = _run(_episode("fork", group_size=2), _match(5), _FailsEveryFork(_client()))
    assert out.groups == [] and len(out.results) == 2 and out.counts.untrainable_completions == 2


def _opponents_at_the_fork(common: bool) -> list[dict[str, list[str]]]:
    """Each fork's orders of the six Random seats at the forked phase (S1901M: warmup 0)."""
    episode = _episode(trace_fraction=1.0, group_size=3, common_random_numbers=common)
    trace = _run(episode, _match(6)).trace
    assert trace is not None and trace["decision_phase"] == "S1901M"
    return [
        {p: o for p, o in fork["replay"]["phases"][0]["orders"].items() if p != "FRANCE"} for fork in trace["forks"]
    ]


def test_common_random_numbers_give_every_fork_the_same_opponents_at_the_forked_phase() -> None:
    shared = _opponents_at_the_fork(common=True)
    assert len(shared[0]) == 6 and all(orders == shared[0] for orders in shared)
    free = _opponents_at_the_fork(common=False)  # one bot stream drawn fork after fork
    assert any(orders != free[0] for orders in free[1:])


class _Recording:
    """The uniform client, keeping each request's (power, phase, sample_seed)."""

    def __init__(self, inner: UniformConstrainedClient) -> None:
        self.inner = inner
        self.seen: list[tuple[str, str, int | None]] = []
        self.temperatures: list[tuple[str, str, float]] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.seen += [(r.legal["power"], r.legal["phase"], r.sample_seed) for r in requests]
        self.temperatures += [(r.legal["power"], r.legal["phase"], r.temperature) for r in requests]
        return self.inner.generate(requests)


@pytest.mark.parametrize("train_turns", ["fork", "all"])
def test_common_random_numbers_never_seed_a_decision_that_is_compared_or_trained(train_turns: str) -> None:
    """A seeded answer has no behaviour logprobs: the forked decision and every trained turn sample freely;
    the hero's untrained later turns share one seed per phase across the forks."""
    client = _Recording(_client())
    [group] = _run(_episode(train_turns, group_size=3), _match(28), client).groups
    forked = [seed for power, phase, seed in client.seen if phase == group.phase]
    later: dict[str, set[int | None]] = {}
    for _, phase, seed in client.seen:
        if phase != group.phase:
            later.setdefault(phase, set()).add(seed)
    assert len(forked) == 3 and forked == [None] * 3
    assert later  # F1901M at least
    if train_turns == "all":
        assert all(seeds == {None} for seeds in later.values())
    else:
        assert all(len(seeds) == 1 and None not in seeds for seeds in later.values())
    assert len({tuple(r.completion_ids) for r in group.records}) > 1  # the compared decisions still differ


@pytest.mark.parametrize("train_turns", ["fork", "all"])
def test_untrained_decisions_are_played_at_their_own_temperature_and_trained_ones_sampled(train_turns: str) -> None:
    """untrained_temperature=0: the warmup, the untrained LLM seat (GERMANY) and the hero's untrained later
    turns ask for greedy answers; every decision that is compared and trained samples at `temperature`."""
    client = _Recording(_client())
    episode = _episode(
        train_turns, group_size=3, temperature=0.7, untrained_temperature=0.0, warmup_min_phases=2, warmup_max_phases=2
    )
    match = replace(_match(1, main_seats=("FRANCE", "GERMANY")), train=("FRANCE",))
    [group] = _run(episode, match, client).groups
    phases = [phase for _, phase, _ in client.temperatures]
    forked_at = phases.index(group.phase)
    assert phases[:forked_at], "the warmup played LLM decisions"
    assert all(t == 0.0 for _, _, t in client.temperatures[:forked_at])
    later_hero = {phase for power, phase, _ in client.temperatures[forked_at:] if power == "FRANCE"} - {group.phase}
    assert later_hero, "the forks played on past the forked phase"
    for power, phase, temperature in client.temperatures[forked_at:]:
        trained = power == "FRANCE" and (phase == group.phase or train_turns == "all")
        assert temperature == (0.7 if trained else 0.0), (power, phase)
    assert {r.temperature for r in group.records} == {0.7}
    trained_phases = {r.phase for r in group.records}
    assert trained_phases == ({group.phase} if train_turns == "fork" else {group.phase, *later_hero})

    default = _Recording(_client())  # unset: every decision at `temperature`, as before
    _run(_episode(train_turns, group_size=3, temperature=0.7, warmup_min_phases=2, warmup_max_phases=2), match, default)
    assert {t for _, _, t in default.temperatures} == {0.7}
    with pytest.raises(ValueError, match="untrained_temperature"):
        EpisodeConfig(untrained_temperature=-0.5)


def test_a_workers_reports_time_every_stage_and_count_each_second_of_its_loop_once() -> None:
    """The report carries the match's own times and its worker's lockstep seconds since the previous report:
    summed over reports they are the loop's seconds, so a run's per-match means count nothing twice."""
    from diprl.messages import MATCH_STAGES
    from diprl.rollout.worker import RolloutWorker, WorkerConfig

    config = WorkerConfig(episode=EpisodeConfig(group_size=2, warmup_max_phases=1, horizon_years=1), client="uniform")
    worker = RolloutWorker(config, ledger_name=None)
    reports = [worker.play(_match(seed)) for seed in (1, 2)]
    assert all(set(r.timings) == set(MATCH_STAGES) and r.timings["play"] > 0 for r in reports)
    for stage in ("inference", "engine", "bots"):
        assert sum(r.timings[stage] for r in reports) == pytest.approx(worker.stats.seconds[stage])


def test_each_fork_point_after_the_first_forks_the_next_decision_of_one_of_the_previous_forks() -> None:
    """`fork_points=3`: after each group the match goes on from one of its forks as it stood right after the
    forked phase, to the hero's next decision, and forks that. The first group is the one a single fork point
    gives; the results are the last group's."""
    from diprl.game.legal import PowerOrders
    from diprl.messages import group_seat

    seats = ("FRANCE", "GERMANY", "ITALY")
    one = _run(_episode("fork", group_size=3), _match(4, main_seats=seats))
    out = _run(_episode("fork", group_size=3, fork_points=3, trace_fraction=1.0), _match(4, main_seats=seats))
    points: dict[int, list[Any]] = {}
    for group in out.groups:
        points.setdefault(group_seat(group.group_id).point, []).append(group)
    assert sorted(points) == [0, 1, 2]
    assert [(g.group_id, [r.completion_ids for r in g.records]) for g in points[0]] == [
        (g.group_id, [r.completion_ids for r in g.records]) for g in one.groups
    ]
    # Warmup 0: spring 1901 is forked, then the autumn that one fork reached, then the spring after it (the
    # winter's builds were not drawn); at the last point only Italy's forks differed.
    assert [[g.group_id for g in points[k]] for k in (1, 2)] == [
        ["t4/F1901M/FRANCE#1", "t4/F1901M/GERMANY#1", "t4/F1901M/ITALY#1"],
        ["t4/S1902M/ITALY#2"],
    ]
    # The autumn forked is where one of the spring's forks stood: every seat's units as in that fork.
    assert out.trace is not None and out.trace["decision_phase"] == "S1901M"
    autumns = [
        next(p["state"]["units"] for p in fork["replay"]["phases"] if p["name"] == "F1901M")
        for fork in out.trace["forks"]
    ]
    forked = {g.power: sorted(PowerOrders.from_dict(g.records[0].legal).locs) for g in points[1]}
    matching = [
        units for units in autumns if all(sorted(u[2:] for u in units[p]) == locs for p, locs in forked.items())
    ]
    assert matching and len(matching) < len(autumns), "one fork's autumn, not every fork's"
    for group in out.groups:
        _check_records(group.records)
    assert len(out.hero_returns) == 9 and out.hero_returns[:3] == one.hero_returns
    assert len(out.results) == 3 and {r.final_phase for r in out.results} == {"S1903M"}
    assert {r.final_phase for r in one.results} == {"S1902M"}
    with pytest.raises(ValueError, match="fork_points"):
        EpisodeConfig(fork_points=0)
