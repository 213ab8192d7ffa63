"""Episode without Ray or an engine: which hero turns become TrainingRecords under each `train_turns`."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from diprl.game import PowerOrders
from diprl.policy.constraint import OrderConstraint
from diprl.policy.tokenizer import load_tokenizer
from diprl.policy.vocab import TokenTable, token_table
from diprl.rollout.clients import UniformConstrainedClient
from diprl.rollout.credit import CreditAssigner, CreditConfig
from diprl.rollout.episode import Episode, EpisodeConfig
from diprl.rollout.rewards import Rubric, load_reward_config
from diprl.rollout.types import Match
from diprl.rollout.worker import policy_of

POWERS = ["AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY"]


@cache
def _table() -> tuple[object, TokenTable]:
    tokenizer = load_tokenizer()
    return tokenizer, token_table(tokenizer, 151936)


def _episode(train_turns: str, group_size: int = 3, **episode: Any) -> Episode:
    tokenizer, table = _table()
    reward = load_reward_config("default")
    credit = CreditAssigner(CreditConfig(train_turns=train_turns))
    options: dict[str, Any] = {"warmup_max_phases": 0, "horizon_years": 1, "trace_fraction": 0.0} | episode
    config = EpisodeConfig(group_size=group_size, **options)
    client = UniformConstrainedClient(table, seed=3, tokenizer=tokenizer)
    return Episode(config, Rubric(reward), credit, client, table)


def _match(seed: int) -> Match:
    seats = {p: "bot:random" for p in POWERS} | {"FRANCE": "main@v2"}
    return Match(match_id=f"t{seed}", seats=seats, hero="FRANCE", seed=seed)


def _check_records(records: list[dict]) -> None:
    _, table = _table()
    for record in records:
        n = len(record["completion_ids"])
        assert n > 0 and len(record["behaviour_logprobs"]) == n == len(record["advantages"])
        legal = PowerOrders.from_dict(record["legal"])
        assert legal.phase == record["phase"], "each record carries the legal orders of its own phase"
        OrderConstraint(legal, table).masks_for(record["completion_ids"])  # raises if off-grammar


def test_fork_turns_train_only_the_forked_decision() -> None:
    out = _episode("fork").run(_match(11))
    assert out.group is not None
    group = out.group.to_dict()
    assert len(group["records"]) == 3
    assert {r["phase"] for r in group["records"]} == {group["phase"]}
    _check_records(group["records"])


def test_all_turns_train_every_hero_turn_of_each_fork_with_its_group_advantage() -> None:
    fork_out = _episode("fork").run(_match(11))
    all_out = _episode("all").run(_match(11))
    assert fork_out.group is not None and all_out.group is not None
    records = all_out.group.to_dict()["records"]
    # Spring decision + autumn + (maybe retreats) + winter adjustments: more than one turn per fork.
    assert len(records) > 3
    phases = [r["phase"] for r in records]
    assert phases.count(all_out.group.phase) == 3 and len(set(phases)) > 1
    _check_records(records)
    # Same seeds, same play: the forked decision's records are identical under both settings.
    first = [r for r in records if r["phase"] == all_out.group.phase]
    assert [r["completion_ids"] for r in first] == [r.completion_ids for r in fork_out.group.records]
    # Later turns carry their fork's group advantage alone (no per-order term): one value per completion.
    for r in records:
        if r["phase"] != all_out.group.phase:
            assert len(set(r["advantages"])) == 1 and r["order_rewards"] == {}


def test_train_turns_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="train_turns"):
        CreditConfig(train_turns="every")


def test_policy_of_routes_versions_to_their_learner() -> None:
    assert policy_of("main@v3") == "main"
    assert policy_of("main_exploiter@v12") == "main_exploiter"
    assert policy_of("base") == "" and policy_of("bot:random") == ""


class _FailsOneFork:
    """The uniform client, except that the second fork's forked decision comes back as an engine error."""

    def __init__(self, inner: UniformConstrainedClient) -> None:
        self.inner = inner
        self.calls = 0

    def generate(self, requests: list[dict]) -> list[dict]:
        answers = self.inner.generate(requests)
        self.calls += 1
        if self.calls == 1:  # warmup 0 at S1901M: the first call is the forked decision of every fork
            answers[1] = {"policy": answers[1]["policy"], "error": "EngineDead: replica restarting", "orders": []}
        return answers


def test_a_fork_whose_decision_failed_is_left_out_of_the_baseline() -> None:
    episode = _episode("fork", group_size=4)
    episode.client = _FailsOneFork(episode.client)
    out = episode.run(_match(5))
    assert out.group is not None and len(out.results) == 4, "the failed fork still played (holds) and reports"
    kept = [r for i, r in enumerate(out.returns) if i != 1]
    assert out.group.returns == kept and len(out.group.records) == 3
    expected, _ = episode.credit.group_advantages(kept)
    assert expected is not None
    _, table = _table()
    for record, advantage in zip(out.group.records, expected, strict=True):
        orders = list(record.order_rewards)
        rebuilt = episode.credit.token_advantages(
            advantage, record.completion_ids, table.texts, orders, record.order_rewards
        )
        assert record.advantages == pytest.approx(rebuilt)
    assert out.untrainable_completions == 1


def _forked_kind(share: float) -> str:
    """The phase kind of the forked decision of a match whose warmup (7 phases, seed 0) ends at W1903A,
    where France builds: found by search, fixed by the seeds."""
    episode = _episode("fork", group_size=2, warmup_min_phases=7, warmup_max_phases=7, adjustment_fork_share=share)
    out = episode.run(_match(0))
    assert out.group is not None
    return f"{out.group.phase} {PowerOrders.from_dict(out.group.records[0].legal).kind.value}"


def test_builds_and_disbands_are_forked_at_the_configured_share() -> None:
    assert _forked_kind(1.0) == "W1903A build"
    assert _forked_kind(0.0).endswith(" movement")  # played on to the next movement decision
    with pytest.raises(ValueError, match="adjustment_fork_share"):
        EpisodeConfig(adjustment_fork_share=1.5)
