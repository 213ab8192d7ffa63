"""The documented cluster command runs the configuration `python -m diprl.plan` computes with.

README.md, docs/cluster.md and the cluster files tell an operator what to submit; a command that composes the
CPU experiment's values (16 groups a step, a checkpoint every step, 10 minutes) would run something else than
what the plan sized, and stop a 14B job during its start. Every documented cluster command is composed here
and compared with the plan of the same model and overrides.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from diprl.plan import compose_plan, make_plan
from diprl.run.config import compose_config

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/cluster.md", "cluster/a100.yaml", "cluster/aws-a100.yaml")
START_UP_S = 30 * 60  # vLLM's start with a 14B model, the pool's first versions: room before the first step
PLAN_CLUSTER = "a100x8"  # the smallest shipped cluster: its step is the slowest


def documented_commands(name: str) -> list[list[str]]:
    """The overrides of every `python -m diprl.train` cluster command in a document, continuations joined."""
    text = (ROOT / name).read_text()
    text = re.sub(r"\\\n\s*#?\s*", " ", text)  # shell continuations, also inside YAML comments
    commands = []
    for line in text.splitlines():
        found = re.search(r"python -m diprl\.train (.*)$", line)
        if found and "model=qwen3" in found.group(1):
            words = shlex.split(found.group(1).replace("`", " "), comments=False)
            commands.append([w for w in words if "=" in w])
    return commands


def test_every_document_names_the_cluster_experiment() -> None:
    for name in DOCUMENTS:
        commands = documented_commands(name)
        assert commands, f"{name} shows no cluster command"
        for overrides in commands:
            experiments = [w for w in overrides if w.startswith("+experiment=")]
            assert experiments and experiments[0].endswith("_cluster"), (name, overrides)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_the_documented_cluster_command_composes_to_the_plans_assumptions(name: str) -> None:
    for overrides in documented_commands(name):
        config, _ = compose_config(overrides)
        sized = [w for w in overrides if w.startswith(("model=", "inference.", "learner."))]
        plan = make_plan(compose_plan([*sized, f"cluster={PLAN_CLUSTER}"]))
        assert plan.fits, plan.refusals
        assert config.model == plan.config.model, overrides
        assert config.learner == plan.config.learner, overrides  # 8 groups a step, a checkpoint every tenth
        assert config.inference == plan.config.inference, overrides
        workload = plan.config.workload
        assert config.rollout.episode.group_size == workload.group_size
        assert (config.rollout.train_turns or "fork") == "fork" and workload.decisions_per_fork == 1
        assert config.rollout.num_workers == workload.rollout_workers
        warmup = (config.rollout.episode.warmup_min_phases + config.rollout.episode.warmup_max_phases) / 2
        assert warmup == workload.warmup_phases
        # The run's budget holds its steps at the plan's pace, after the start.
        assert config.train.max_minutes * 60 >= config.train.max_steps * plan.step_s + START_UP_S, (
            config.train.max_minutes,
            config.train.max_steps,
            plan.step_s,
        )


@pytest.mark.parametrize("experiment", ["pfsp_cluster", "league_cluster"])
def test_the_cluster_experiments_keep_the_plans_learner_and_rollouts(experiment: str) -> None:
    config, _ = compose_config([f"+experiment={experiment}", "model=qwen3_8b"])
    plan = compose_plan(["model=qwen3_8b"])
    assert config.learner == plan.learner and config.inference == plan.inference
    assert config.rollout.num_workers == plan.workload.rollout_workers


@pytest.mark.parametrize(
    "overrides", [[], ["model=qwen3_14b", "inference.tensor_parallel_size=2", "train.max_steps=500"]]
)
def test_the_league_cluster_budget_holds_its_steps_at_the_pace_of_a_league(overrides: list[str]) -> None:
    """A league step is one step of every role, its groups all served: the plan of all three roles sizes it."""
    config, _ = compose_config(["+experiment=league_cluster", *overrides])
    sized = [w for w in overrides if w.startswith(("model=", "inference.", "learner."))]
    plan = make_plan(compose_plan([*sized, "league=league", f"cluster={PLAN_CLUSTER}"]))
    assert plan.fits, plan.refusals
    assert plan.config.policies == tuple(config.league.roles) == ("main", "main_exploiter", "league_exploiter")
    assert config.train.max_minutes * 60 >= config.train.max_steps * plan.step_s + START_UP_S, (
        config.train.max_steps,
        plan.step_s,
    )


def test_figures_quoted_from_the_inference_config_match_it() -> None:
    """One source: what the docs say `conf/inference/cluster.yaml` holds is what it holds."""
    import yaml

    shipped = yaml.safe_load((ROOT / "conf" / "inference" / "cluster.yaml").read_text())
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"\s+", " ", page.read_text())
        for key, value in re.findall(r"`(\w+)` \(([\d,]+) in `conf/inference/cluster\.yaml`", text):
            assert int(value.replace(",", "")) == shipped[key], (page.name, key, value)
