"""Trajectory groups for learner tests: real prompts and legal orders, completions from the uniform sampler."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from diprl.game import DiplomacyGame
from diprl.messages import GenerationRequest, PolicyRef, TrainingRecord, TrajectoryGroup
from diprl.policy.prompt import build_prompt
from diprl.policy.vocab import TokenTable
from diprl.rollout.clients import UniformConstrainedClient


def make_group(
    table: TokenTable,
    tokenizer: Any,
    version: str,
    advantages: list[float],
    power: str = "FRANCE",
    seed: int = 0,
    temperature: float = 1.0,
) -> TrajectoryGroup:
    """One group: len(advantages) forks of the opening position, each with a constant per-token advantage."""
    game = DiplomacyGame()
    legal = game.legal_orders(power).to_dict()
    request = GenerationRequest(policy=version, prompt=build_prompt(game, power).text, legal=legal)
    results = UniformConstrainedClient(table, seed=seed, tokenizer=tokenizer).generate([request] * len(advantages))
    records = [
        TrainingRecord(
            prompt_ids=r.prompt_ids,
            completion_ids=r.token_ids,
            behaviour_logprobs=r.logprobs,
            legal=legal,
            advantages=[a] * len(r.token_ids),
            policy_version=PolicyRef.parse(version),
            temperature=temperature,
            power=power,
            phase=game.phase,
            reward=a,
        )
        for r, a in zip(results, advantages, strict=True)
    ]
    return TrajectoryGroup(
        group_id=f"{version}-{seed}",
        match_id="m",
        power=power,
        phase=game.phase,
        policy_version=PolicyRef.parse(version),
        records=records,
        returns=list(advantages),
        advantage_std=1.0,
    )


def on_policy(learner: Any, group: TrajectoryGroup) -> TrajectoryGroup:
    """The group with behaviour logprobs replaced by the learner's own (as if its engine had sampled them)."""
    scores = learner.score(group.records)
    records = [replace(r, behaviour_logprobs=s) for r, s in zip(group.records, scores, strict=True)]
    return replace(group, records=records)
