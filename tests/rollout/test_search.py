"""One-ply search at a seat: which requests it sends, how it scores a position, and that its choice follows
the opponents its own policy predicts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from diprl.bots import make_agent
from diprl.eval.config import GamesConfig
from diprl.eval.suite import SuiteConfig, run_suite
from diprl.game import DiplomacyGame
from diprl.messages import Generation, GenerationRequest
from diprl.rollout.lockstep import LockstepStats, Table, play_phase
from diprl.rollout.search import SearchConfig, centres_in_reach, plan_search, position_value
from tests.eval.conftest import RecordingClient

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def _answer(request: GenerationRequest, orders: Sequence[str]) -> Generation:
    return Generation(policy=request.policy, text="\n".join(orders), orders=list(orders), complete=True)


def _holds(request: GenerationRequest) -> list[str]:
    assert request.legal is not None
    return [next(o for o in orders if o.endswith(" H")) for orders in request.legal["by_loc"].values()]


class ScriptedClient:
    """France's requests answered from `france` in order (then holds), Italy's by `italy`, all else hold."""

    def __init__(self, france: Sequence[Sequence[str]], italy: Callable[[GenerationRequest], list[str]]) -> None:
        self.france = list(france)
        self.italy = italy
        self.calls: list[list[GenerationRequest]] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.calls.append(list(requests))
        answers, mine = [], iter(self.france)
        for request in requests:
            legal = request.legal or {"by_loc": {}}
            if "BRE" in legal["by_loc"]:
                answers.append(_answer(request, next(mine, None) or _holds(request)))
            elif "PIE" in legal["by_loc"]:
                answers.append(_answer(request, self.italy(request)))
            else:
                answers.append(_answer(request, _holds(request)))
        return answers


def _fall_1901() -> DiplomacyGame:
    """France's army in Spain, Italy's in Piedmont: Marseilles is empty and Italy can walk in."""
    game = DiplomacyGame(max_year=1905)
    game.step({"FRANCE": ["A MAR - SPA", "A PAR H", "F BRE H"], "ITALY": ["A VEN - PIE", "A ROM H", "F NAP H"]})
    assert game.phase == "F1901M"
    return game


HOLD_SPAIN = ["A SPA H", "A PAR H", "F BRE H"]  # the greedy answer
TAKE_PORTUGAL = ["A SPA - POR", "A PAR H", "F BRE H"]
GUARD_MARSEILLES = ["A SPA - MAR", "A PAR H", "F BRE H"]


def _request(game: DiplomacyGame, power: str, seed: int | None = 7) -> GenerationRequest:
    return GenerationRequest(
        policy="base", prompt=f"{power} {game.phase}", legal=game.legal_orders(power).to_dict(), temperature=0.0,
        sample_seed=seed,
    )  # fmt: skip


def _choose(
    france: Sequence[Sequence[str]], italy: Callable[[GenerationRequest], list[str]]
) -> tuple[list[str], bool, int]:
    game = _fall_1901()
    config = SearchConfig(candidates=len(france) - 1, opponent_samples=2)
    pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), config)
    assert pending is not None
    outcome = pending.choose(ScriptedClient(france, italy).generate(pending.requests))
    return list(outcome.answer.orders), outcome.changed, outcome.candidates


ATTACK_MARSEILLES = ["A PIE - MAR", "A ROM H", "F NAP H"]
SAME_CANDIDATES = [HOLD_SPAIN, TAKE_PORTUGAL, GUARD_MARSEILLES, HOLD_SPAIN]


def test_search_guards_the_centre_its_opponent_model_says_will_be_taken() -> None:
    """Italy predicted to march on Marseilles: the bounce that keeps it (and Spain) beats holding Spain or
    taking Portugal (3 centres each); predicted to hold, the greedy hold is as good as anything (4) and stays."""
    chosen, changed, distinct = _choose(SAME_CANDIDATES, lambda request: ATTACK_MARSEILLES)
    assert chosen == GUARD_MARSEILLES and changed
    assert distinct == 3  # the fourth candidate repeats the greedy one
    chosen, changed, _ = _choose(SAME_CANDIDATES, _holds)
    assert chosen == HOLD_SPAIN and not changed


def test_search_takes_the_free_centre_when_its_opponents_are_predicted_to_hold() -> None:
    chosen, changed, _ = _choose([GUARD_MARSEILLES, TAKE_PORTUGAL], _holds)
    assert chosen == TAKE_PORTUGAL and changed


def test_search_keeps_the_greedy_answer_on_a_tie() -> None:
    game = _fall_1901()
    pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), SearchConfig(candidates=1, opponent_samples=1))
    assert pending is not None
    other_hold = ["A SPA H", "A PAR - PIC", "F BRE H"]  # the same centres, the same units
    outcome = pending.choose(ScriptedClient([HOLD_SPAIN, other_hold], _holds).generate(pending.requests))
    assert list(outcome.answer.orders) == HOLD_SPAIN and not outcome.changed


def test_a_failed_candidate_is_never_played_and_a_short_answer_list_is_refused() -> None:
    game = _fall_1901()
    pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), SearchConfig(candidates=1, opponent_samples=1))
    assert pending is not None
    answers = ScriptedClient([HOLD_SPAIN, TAKE_PORTUGAL], _holds).generate(pending.requests)
    answers[1] = Generation(policy="base", error="the replica failed", orders=list(TAKE_PORTUGAL))
    outcome = pending.choose(answers)
    assert outcome.answer is answers[0] and outcome.candidates == 1 and not outcome.changed
    with pytest.raises(ValueError, match="needs"):
        pending.choose(answers[:-1])
    answers = ScriptedClient([HOLD_SPAIN, TAKE_PORTUGAL], _holds).generate(pending.requests)
    answers[0] = Generation(policy="base", error="the replica failed")
    outcome = pending.choose(answers)  # the greedy answer failed: the one valid candidate is played
    assert outcome.answer is answers[1] and outcome.candidates == 1 and outcome.changed


def test_the_requests_of_a_search_greedy_first_then_candidates_then_every_other_power() -> None:
    game = DiplomacyGame()
    greedy = _request(game, "FRANCE")
    config = SearchConfig(candidates=3, opponent_samples=2, temperature=0.8)
    pending = plan_search(game, "FRANCE", greedy, config)
    assert pending is not None
    requests = pending.requests
    assert len(requests) == 1 + 3 + 6 * 2 and requests[0] is greedy
    assert all(r.temperature == 0.8 for r in requests[1:])
    assert pending.others == tuple(p for p in POWERS if p != "FRANCE")
    for i, other in enumerate(pending.others):  # each modelled power's samples carry its own legal orders
        mine = requests[4 + 2 * i : 6 + 2 * i]
        assert all(r.legal == game.legal_orders(other).to_dict() and other in r.prompt for r in mine)
    seeds = [r.sample_seed for r in requests]
    assert len(set(seeds)) == len(seeds)  # every sample its own stream
    again = plan_search(game, "FRANCE", greedy, config)
    assert again is not None and [r.sample_seed for r in again.requests] == seeds  # reproducible
    unseeded = plan_search(game, "FRANCE", _request(game, "FRANCE", seed=None), config)
    assert unseeded is not None and all(r.sample_seed is None for r in unseeded.requests)


def test_no_search_outside_movement_phases_or_with_no_candidates() -> None:
    game = DiplomacyGame(max_year=1905)
    game.step({})
    game.step({"FRANCE": ["A MAR - SPA"]})
    assert game.phase == "W1901A"
    assert plan_search(game, "FRANCE", _request(game, "FRANCE"), SearchConfig(candidates=4)) is None
    start = DiplomacyGame()
    assert plan_search(start, "FRANCE", _request(start, "FRANCE"), SearchConfig(candidates=0)) is None


def test_position_value_counts_centres_held_taken_and_lost() -> None:
    game = _fall_1901()
    assert position_value(game, "FRANCE", 0.0) == 4  # BRE, MAR, PAR owned and unoccupied by others, SPA stood on
    game.step({"ITALY": ["A PIE - MAR", "A ROM H", "F NAP H"], "FRANCE": TAKE_PORTUGAL})
    assert position_value(game, "FRANCE", 0.0) == 3  # POR taken, MAR lost to the Italian army standing on it
    assert position_value(game, "FRANCE", 0.5) == 3 + 0.5 * 3
    assert position_value(game, "ITALY", 0.0) == 4  # NAP, ROM, VEN and MAR
    spring = DiplomacyGame()
    spring.step({"AUSTRIA": ["F TRI - ALB", "A VIE H", "A BUD H"], "ITALY": ["A VEN - TRI", "A ROM H", "F NAP H"]})
    assert spring.centres("AUSTRIA") == ("BUD", "TRI", "VIE")  # owned until the fall's count
    assert position_value(spring, "AUSTRIA", 0.0) == 2  # an Italian army stands on Trieste
    assert position_value(spring, "ITALY", 0.0) == 4  # Trieste stood on, Venice empty but its own


def test_centres_in_reach_one_centre_a_free_unit() -> None:
    start = DiplomacyGame()
    assert centres_in_reach(start, "FRANCE", counted={"BRE", "MAR", "PAR"}) == 1  # Marseilles' army to Spain
    assert centres_in_reach(start, "AUSTRIA", counted={"BUD", "TRI", "VIE"}) == 2  # one of Serbia, Rumania; Venice
    assert position_value(start, "FRANCE", 0.3, reach_weight=0.5) == 3 + 0.9 + 0.5
    both = DiplomacyGame()
    both.step({"FRANCE": ["A MAR H", "A PAR - GAS", "F BRE H"]})
    assert centres_in_reach(both, "FRANCE", counted={"BRE", "MAR", "PAR"}) == 1  # two armies, one Spain
    spread = DiplomacyGame()
    spread.step({"FRANCE": ["A PAR - BUR", "A MAR - SPA", "F BRE - MAO"]})
    # Burgundy reaches Belgium and Munich, the fleet Portugal; the army on Spain stays for the capture,
    # and a centre counted already (Spain, the home centres) is no target
    assert centres_in_reach(spread, "FRANCE", counted={"BRE", "MAR", "PAR", "SPA"}) == 2
    assert position_value(spread, "FRANCE", 0.0, reach_weight=1.0) == 4 + 2
    assert position_value(spread, "FRANCE", 0.0) == 4  # unseen by default
    pinned = DiplomacyGame()
    pinned.step({"RUSSIA": ["F SEV - RUM", "A WAR - GAL", "A MOS - UKR", "F STP/SC - BOT"]})
    # the fleet on Rumania holds it for the fall, so Bulgaria is not in its reach; Galicia reaches
    # Budapest (or Vienna), the Gulf of Bothnia Sweden
    assert centres_in_reach(pinned, "RUSSIA", counted={"MOS", "RUM", "SEV", "STP", "WAR"}) == 2


def test_a_reach_weight_makes_search_step_next_to_a_centre_in_spring() -> None:
    """All hold is greedy; marching Paris to Burgundy takes nothing this spring, so without a reach weight
    it only ties the hold (which stays), and with one it is played: Belgium and Munich are in reach."""
    hold = ["A MAR H", "A PAR H", "F BRE H"]
    burgundy = ["A MAR H", "A PAR - BUR", "F BRE H"]
    for weight, expected in ((0.0, hold), (0.4, burgundy)):
        game = DiplomacyGame()
        config = SearchConfig(candidates=1, opponent_samples=1, reach_weight=weight)
        pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), config)
        assert pending is not None
        outcome = pending.choose(ScriptedClient([hold, burgundy], _holds).generate(pending.requests))
        assert list(outcome.answer.orders) == expected, weight


class ByPowerClient:
    """Each power answers its scripted order sets in turn (then holds); powers not scripted hold."""

    def __init__(self, script: dict[str, Sequence[Sequence[str]]]) -> None:
        self.script = {power: iter(answers) for power, answers in script.items()}

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        answers = []
        for request in requests:
            assert request.legal is not None
            orders = next(self.script.get(request.legal["power"], iter(())), None)
            answer = _answer(request, orders or _holds(request))
            answers.append(replace(answer, prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5]))
        return answers


def _improved(game: DiplomacyGame, france: Sequence[Sequence[str]], germany: Sequence[str], **config: object):
    search = SearchConfig(candidates=len(france) - 1, opponent_samples=1, **config)  # type: ignore[arg-type]
    pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), search)
    assert pending is not None
    return pending.choose(ByPowerClient({"FRANCE": france, "GERMANY": [germany]}).generate(pending.requests))


def test_improvement_composes_the_candidates_orders_unit_by_unit() -> None:
    """One candidate takes Belgium, the other Portugal: the best candidate takes one, the composed set both.
    The composed set is not the policy's completion, so it carries no ids to train on."""
    game = DiplomacyGame(max_year=1905)
    game.step({"FRANCE": ["A PAR - BUR", "A MAR - SPA", "F BRE - MAO"]})
    belgium = ["A BUR - BEL", "A SPA H", "F MAO H"]
    portugal = ["A BUR H", "A SPA H", "F MAO - POR"]
    hold = ["A BUR H", "A SPA H", "F MAO H"]
    best = _improved(game, [hold, belgium, portugal], []).answer
    assert list(best.orders) == belgium and best.trainable
    outcome = _improved(game, [hold, belgium, portugal], [], improve_rounds=1)
    assert sorted(outcome.answer.orders) == ["A BUR - BEL", "A SPA H", "F MAO - POR"]
    assert outcome.changed and outcome.candidates == 3
    assert outcome.answer.complete and not outcome.answer.trainable
    assert outcome.answer.text.splitlines() == list(outcome.answer.orders)
    # an order that is not legal here (a bad answer) is neither kept nor tried: the unit holds, as in the game
    bogus = ["A BUR - BEL", "A SPA - LON", "F MAO H"]
    outcome = _improved(game, [hold, bogus, portugal], [], improve_rounds=1)
    assert sorted(outcome.answer.orders) == ["A BUR - BEL", "A SPA H", "F MAO - POR"]
    # the policy proposed nothing but holds: its pool has nothing to compose; the centres' pool moves both
    assert sorted(_improved(game, [hold, hold], [], improve_rounds=1).answer.orders) == hold
    centres = _improved(game, [hold, hold], [], improve_rounds=1, improve_pool="centres").answer
    assert sorted(centres.orders) == ["A BUR - BEL", "A SPA H", "F MAO - POR"]


def test_a_second_round_adopts_what_the_first_made_worth_it_and_a_quiet_round_ends_the_loop() -> None:
    """Marseilles's move to Spain is worth something only once Paris has gone to Burgundy, and Marseilles
    comes before Paris in a round: one round takes Burgundy alone, two take both, and a third round changes
    nothing, so the loop stops there however many rounds are allowed."""
    game = DiplomacyGame(max_year=1905)
    config = SearchConfig(candidates=1, opponent_samples=1, improve_rounds=5)
    pending = plan_search(game, "FRANCE", _request(game, "FRANCE"), config)
    assert pending is not None
    locs = list(game.legal_orders("FRANCE").locs)
    assert locs.index("MAR") < locs.index("PAR")  # the order the rounds visit the units in
    hold = _answer(_request(game, "FRANCE"), ["A MAR H", "A PAR H", "F BRE H"])
    proposed = _answer(_request(game, "FRANCE"), ["A MAR - SPA", "A PAR - BUR", "F BRE H"])
    calls: list[frozenset[str]] = []

    def value(orders: Sequence[str]) -> float:
        calls.append(frozenset(orders))
        burgundy = "A PAR - BUR" in orders
        return float(burgundy) + float(burgundy and "A MAR - SPA" in orders)

    def improved(rounds: int) -> list[str]:
        calls.clear()
        rounds_of = replace(pending, config=replace(config, improve_rounds=rounds))
        return sorted(rounds_of.improve(hold, [hold, proposed], value).orders)

    assert improved(1) == ["A MAR H", "A PAR - BUR", "F BRE H"]
    assert improved(2) == ["A MAR - SPA", "A PAR - BUR", "F BRE H"]
    assert improved(3) == ["A MAR - SPA", "A PAR - BUR", "F BRE H"]
    three_rounds = len(calls)  # two rounds that change something and a quiet third
    assert improved(5) == ["A MAR - SPA", "A PAR - BUR", "F BRE H"]
    assert len(calls) == three_rounds == 1 + 3 * 2  # the start, then one trial per unit with an alternative


def test_the_centres_pool_moves_onto_centres_only() -> None:
    """In spring, with a reach weight, Paris to Burgundy would be worth something (Belgium and Munich in
    reach) but Burgundy is not a centre, so the centres' pool never tries it; Marseilles to Spain it does."""
    game = DiplomacyGame(max_year=1905)
    hold = ["A MAR H", "A PAR H", "F BRE H"]
    outcome = _improved(game, [hold, hold], [], improve_rounds=2, improve_pool="centres", reach_weight=0.4)
    assert "A MAR - SPA" in outcome.answer.orders and "A PAR H" in outcome.answer.orders
    burgundy = ["A MAR H", "A PAR - BUR", "F BRE H"]  # proposed by the policy, it is composed in
    outcome = _improved(game, [hold, burgundy], [], improve_rounds=2, improve_pool="centres", reach_weight=0.4)
    assert {"A MAR - SPA", "A PAR - BUR"} <= set(outcome.answer.orders)


def test_the_centres_pool_adds_the_support_that_wins_a_contested_centre() -> None:
    """Germany's fleet is predicted into Belgium: France's army bounces there alone, and takes it with the
    Channel fleet's support, an order no candidate wrote."""
    game = DiplomacyGame(max_year=1905)
    game.step({"FRANCE": ["A PAR - BUR", "A MAR - SPA", "F BRE - ENG"], "GERMANY": ["F KIE - HOL"]})
    bounce = ["A BUR - BEL", "A SPA H", "F ENG H"]
    germany = ["A BER H", "A MUN H", "F HOL - BEL"]
    assert sorted(_improved(game, [bounce, bounce], germany, improve_rounds=2).answer.orders) == sorted(bounce)
    outcome = _improved(game, [bounce, bounce], germany, improve_rounds=2, improve_pool="centres")
    assert sorted(outcome.answer.orders) == ["A BUR - BEL", "A SPA H", "F ENG S A BUR - BEL"]
    # with Germany predicted to hold, the bounce already takes Belgium and nothing is changed
    holds = _holds(_request(game, "GERMANY"))
    outcome = _improved(game, [bounce, bounce], holds, improve_rounds=2, improve_pool="centres")
    assert sorted(outcome.answer.orders) == sorted(bounce) and not outcome.changed


def test_the_strongest_setting_is_the_one_the_zoo_measured() -> None:
    """The web's search box plays `SearchConfig.strongest`: the setting whose figures `zoo:best` ships."""
    manifest = json.loads((Path(__file__).parents[2] / "zoo" / "teacher-rl" / "manifest.json").read_text())
    measured = manifest["figures"]["with_search_reach_and_improvement"]
    assert measured["search"] == asdict(SearchConfig.strongest(8))
    assert measured["teacher_gap_ci95"][0] > 0


@pytest.mark.parametrize(
    "bad",
    [
        {"candidates": -1},
        {"candidates": 1.5},
        {"opponent_samples": 0},
        {"temperature": -0.1},
        {"unit_weight": float("inf")},
        {"reach_weight": -0.5},
        {"candidates": True},
        {"improve_rounds": -1},
        {"improve_pool": "everything"},
    ],
)
def test_bad_search_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="search\\."):
        SearchConfig(**bad)  # type: ignore[arg-type]


class _KeepingClient(RecordingClient):
    """RecordingClient that also keeps its answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[list[Generation]] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.answers.append(super().generate(requests))
        return self.answers[-1]


def test_a_searched_seat_sends_its_whole_search_in_the_phases_one_call_and_plays_its_choice() -> None:
    seats = {p: ("base" if p == "FRANCE" else "bot:random") for p in POWERS}
    bots = {p: make_agent("random", i) for i, p in enumerate(POWERS) if p != "FRANCE"}
    searched = Table(DiplomacyGame(), seats, bots, search={"FRANCE": SearchConfig(candidates=2, opponent_samples=2)})
    plain = Table(DiplomacyGame(), seats, dict(bots))
    holds = ["A MAR H", "A PAR H", "F BRE H"]
    spain = ["A MAR - SPA", "A PAR H", "F BRE H"]
    client, stats = ScriptedClient([holds, holds, spain], _holds), LockstepStats()
    outcomes = play_phase([searched, plain], client, stats)
    assert len(client.calls) == 1 and len(client.calls[0]) == (1 + 2 + 6 * 2) + 1
    assert stats.searches == 1 and stats.search_changed == 1 and stats.requests == 16
    assert outcomes[0].turns["FRANCE"].answer.orders == spain  # Spain taken: one centre more than holding
    assert outcomes[0].record.orders["FRANCE"] == tuple(sorted(spain))
    assert outcomes[1].record.orders["FRANCE"] == tuple(sorted(holds))  # the plain seat: its one answer


def test_a_suite_searches_for_its_llm_hero_only() -> None:
    search = SearchConfig(candidates=2, opponent_samples=1)
    play = GamesConfig(games=1, max_year=1901, search=search)
    client = RecordingClient()
    report = run_suite(SuiteConfig(policy="base", opponents=["bot:random"], play=play), client)
    assert report["timing"]["searches_all_suites"] == 2  # the hero's spring and fall moves of 1901
    assert [len(call) for call in client.calls][:2] == [1 + 2 + 6, 1 + 2 + 6]
    assert report["config"]["play"]["search"]["candidates"] == 2
    bots_only = run_suite(SuiteConfig(policy="bot:dumbbot", opponents=["bot:random"], play=play))  # no client needed
    assert bots_only["games"] == 1
