"""The configuration of a training run: Hydra composition into typed, validated dataclasses.

`conf/config.yaml` + an experiment (`+experiment=pfsp`) + command-line overrides become one `Config`:
`model` (a preset), `inference`, `learner` and `league` (their own typed configs), `rollout` (how
games are played), `train` (budget, reporting, the run directory), `evaluation` (the fixed games
played along the way) and `placement` (which nodes of a cluster run each role). A typo'd key, a wrong
type, an unknown experiment or model, or an inconsistent value is a `ConfigError` naming it, before
anything starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omegaconf import MISSING

from diprl.eval.config import GamesConfig
from diprl.messages import ZOO_PREFIX
from diprl.rollout.episode import EpisodeConfig
from diprl.structured_config import CONF_DIR, ConfigError

__all__ = ["CONF_DIR", "Config", "ConfigError", "PlacementConfig", "compose_config"]


@dataclass
class EvalScheduleConfig(GamesConfig):
    """Evaluation during training: fixed seeded games, the hero against a frozen pool.

    The games (`games`, `max_year`, `seed`, `temperature`, `max_tokens`, `sampling_seed`, `replays`,
    `critical_supports`) are a `GamesConfig`, extended here with when to evaluate and against whom; the
    evaluator receives exactly that games part. `replays` games per opponent are written under
    `eval/<tag>/replays/` (the web app's games page).
    """

    games: int = 14  # per opponent; a multiple of 7 rotates the hero over every power equally
    max_year: int = 1906
    seed: int = 12345
    every_steps: int = 10  # main learner steps between evaluations (0: only at the start and the end)
    opponents: list[str] = field(default_factory=lambda: ["bot:random", "bot:dumbbot"])
    at_start: bool = True
    at_end: bool = True
    retries: int = 2  # an evaluation whose call failed (a PolicyServer or evaluator restart) runs again this often

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")


@dataclass
class RolloutConfig:
    """How games are played for training: workers, matches in flight, episodes, rewards. Which seats of a
    match are trained is the league's call (`league.train_seats`: hero | learners).

    Sizing: a PolicyServer replica sees up to `num_workers x matches_in_flight x group_size x LLM seats`
    requests per phase (7 seats in self-play); keep that near its `max_num_seqs` (docs/rollouts.md,
    "Sizing the rollouts").
    """

    num_workers: int = 2  # rollout actors
    worker_cpus: float = 0.5
    matches_in_flight: int = 8  # per worker, played in lockstep: one policy call per phase for all of them
    reward: str = "default"  # conf/reward/<name>.yaml
    train_turns: str | None = None  # fork | all; None: the reward config's credit.train_turns
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    # Share of matches that start from a stored mid-game state (seeded bot games to max_year, every year
    # and phase kind: diprl.rollout.start_states) instead of spring 1901.
    start_states: float = 0.0
    match_retries: int = 3  # a match whose call failed (replica restart, ...) is replayed this often


@dataclass
class TrainConfig:
    """The run itself: budget, where it writes, how it reports."""

    run_dir: str | None = None  # default: runs/<experiment>-<UTC time>
    resume: str | None = None  # a run directory to continue (learner, league, counters)
    max_steps: int = 200  # main learner steps, counted across resumes
    max_minutes: float = 10.0  # wall-clock budget of this invocation (0: no limit)
    queue_size: int = 64  # groups per policy queue (a full queue blocks rollouts: backpressure)
    progress_every_s: float = 10.0
    wandb: bool = True
    ray_num_cpus: int | None = None  # local Ray only; None: max(cores, what the actors ask for)
    dashboard: bool = True
    # The web app (`python -m diprl.web`: runs, league, games, play) beside the run, on loopback at this
    # port (taken: any free one; 0: any free one; null: no app).
    web_port: int | None = 8080
    seed: int = 0
    # Testing the fault tolerance: actor names to kill (Ray restarts them) once the main learner has
    # taken `chaos_after_step` steps. E.g. [rollout-0, league, learner-main, policy-server].
    chaos: list[str] = field(default_factory=list)
    chaos_after_step: int = 1
    # Testing the collapse guards and rollback: every evaluation of main at or after this step reports that it
    # ordered no supports (the guards' input forced: a planted collapse), a `fault` record each; 0: never.
    plant_collapse_at_step: int = 0
    # Opponents from elsewhere: policy name -> a PEFT adapter directory (e.g. another run's adapters/main/v37),
    # published into this run's store as <name>@v1 before anything starts; league.anchors may name them
    # (diprl.run.frozen). Never trained.
    frozen_adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.plant_collapse_at_step, bool) or self.plant_collapse_at_step < 0:
            raise ValueError(f"train.plant_collapse_at_step must be >= 0 (0: never), got {self.plant_collapse_at_step}")


# Resources a role already asks for through its own fields (cpus, gpus): Ray refuses them in `resources`.
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


@dataclass
class PlacementConfig:
    """Where each role runs on a cluster: the Ray custom resources its actors ask for, beside their CPUs and GPUs.

    A cluster's node types declare custom resources (a node type's `resources` in a launcher yaml, or
    `ray start --resources='{"learner_node": 1}'` on a machine of one's own); an actor that asks for one runs
    only on a node that declares it, and after a node is lost Ray restarts it on another node that does.
    Ask for a small amount (0.001): it marks where a role may run, while CPUs and GPUs still bound how
    many fit. `node:__internal_head__` (Ray's own, on every head) pins a role to the head. Empty (the
    default, `placement=anywhere`): Ray places by CPUs and GPUs alone. `conf/placement/*.yaml` ship
    presets; docs/cluster.md, "Where each role runs", shows the node types they expect.
    """

    learner: dict[str, float] = field(default_factory=dict)  # every learner of every trained policy
    inference: dict[str, float] = field(default_factory=dict)  # every PolicyServer replica (with all its shards)
    rollout: dict[str, float] = field(default_factory=dict)  # rollout workers
    league: dict[str, float] = field(default_factory=dict)  # the league manager
    ledger: dict[str, float] = field(default_factory=dict)  # the group ledger
    queues: dict[str, float] = field(default_factory=dict)  # the learners' queues
    evaluator: dict[str, float] = field(default_factory=dict)  # the evaluator

    def __post_init__(self) -> None:
        problems = []
        for role in self.roles():
            resources = getattr(self, role)
            if not isinstance(resources, Mapping):
                problems.append(f"placement.{role} must map resource names to amounts, got {resources!r}")
                continue
            for name, amount in resources.items():
                problems.extend(_resource_problems(f"placement.{role}", name, amount))
        if problems:
            raise ValueError("invalid placement: " + "; ".join(problems))

    @classmethod
    def roles(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def missing(self, declared: Mapping[str, float]) -> dict[str, list[str]]:
        """Role -> the resources it asks for that no node in `declared` (`ray.cluster_resources()`) has."""
        missing = {role: sorted(set(getattr(self, role)) - set(declared)) for role in self.roles()}
        return {role: names for role, names in missing.items() if names}


def _resource_problems(where: str, name: Any, amount: Any) -> list[str]:
    """What Ray would refuse about one custom resource request, said before anything starts."""
    if not isinstance(name, str) or not name.strip():
        return [f"{where}: a resource name must be a non-empty string, got {name!r}"]
    if name in RAY_BUILTIN_RESOURCES:
        return [f"{where}: {name!r} is set by the role's own CPU/GPU fields, not by placement"]
    ok = isinstance(amount, int | float) and not isinstance(amount, bool) and math.isfinite(amount) and amount > 0
    if not ok:
        return [f"{where}.{name} must be a positive number, got {amount!r}"]
    if amount > 1 and not float(amount).is_integer():  # Ray's own rule for resource amounts
        return [f"{where}.{name} must be at most 1 or a whole number, got {amount!r}"]
    return []


@dataclass
class Config:
    """The composed run configuration (`conf/config.yaml` + an experiment + overrides)."""

    experiment: str = "default"
    model: Any = MISSING  # ModelPreset (Hydra group `model`)
    inference: Any = MISSING  # ServerConfig (group `inference`)
    learner: Any = MISSING  # LearnerConfig (group `learner`)
    league: Any = MISSING  # LeagueConfig (group `league`)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvalScheduleConfig = field(default_factory=EvalScheduleConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    from diprl.inference.config import register_configs as register_inference
    from diprl.league.config import register_configs as register_league
    from diprl.learn.config import register_configs as register_learner
    from diprl.policy.models import register_configs as register_models

    ConfigStore.instance().store(name="base_config", node=Config)
    register_models()
    register_inference()
    register_learner()
    register_league()


def _section(schema: type, raw: Any) -> Any:
    from omegaconf import OmegaConf

    body = dict(raw or {})
    body.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), body))


def typed_config(cfg: Any) -> Config:
    """The composed DictConfig as typed objects, every section validated; errors name the section."""
    from omegaconf import OmegaConf

    from diprl.inference.config import ServerConfig, rank_to_serve
    from diprl.league.config import LeagueConfig
    from diprl.learn.config import LearnerConfig
    from diprl.policy.models import preset_from_config

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    for section in ("model", "inference", "learner", "league"):
        if section not in raw:
            raise ConfigError(f"configuration has no {section!r} section")
    try:
        model = preset_from_config(raw["model"])
        inference = _section(ServerConfig, raw["inference"])
        learner = _section(LearnerConfig, raw["learner"])
        league = _section(LeagueConfig, raw["league"])
        rollout = _section(RolloutConfig, raw.get("rollout"))
        train = _section(TrainConfig, raw.get("train"))
        evaluation = _section(EvalScheduleConfig, raw.get("evaluation"))
        placement = _section(PlacementConfig, raw.get("placement"))
    except Exception as exc:  # OmegaConf validation or a dataclass __post_init__
        raise ConfigError(f"invalid configuration: {exc}") from exc
    config = Config(
        experiment=str(raw.get("experiment", "default")),
        model=model,
        # The server follows the model: its base weights, and LoRA slots wide enough for the preset's adapters.
        inference=replace(
            inference, model=model.name, max_lora_rank=rank_to_serve(inference.max_lora_rank, model.lora.rank)
        ),
        learner=replace(learner, model=model.name),
        league=league,
        rollout=rollout,
        train=train,
        evaluation=evaluation,
        placement=placement,
    )
    check(config)
    return config


def check(config: Config) -> None:
    """Cross-section consistency; every problem is named in one `ConfigError`."""
    from diprl.rollout.rewards import load_reward_config
    from diprl.run.frozen import frozen_problems

    t, r = config.train, config.rollout
    problems = []
    init = config.learner.init_adapter or ""
    if init.startswith(ZOO_PREFIX):
        from diprl.policy.zoo import ZooError, load_entry

        try:
            entry = load_entry(init)
        except ZooError as err:
            problems.append(f"learner.init_adapter: {err}")
        else:
            if entry.model != config.model.name:
                problems.append(f"learner.init_adapter={init} plays on model {entry.model}: add model={entry.model}")
    if t.max_steps < 0 or t.max_minutes < 0:
        problems.append("train.max_steps and train.max_minutes must be >= 0")
    if r.num_workers < 1:
        problems.append(f"rollout.num_workers must be >= 1, got {r.num_workers}")
    if not 0.0 <= r.start_states <= 1.0:
        problems.append(f"rollout.start_states must be a share in [0, 1], got {r.start_states}")
    if r.matches_in_flight < 1:
        problems.append(f"rollout.matches_in_flight must be >= 1, got {r.matches_in_flight}")
    if t.queue_size < config.learner.groups_per_step:
        problems.append(
            f"train.queue_size ({t.queue_size}) must hold a learner batch (learner.groups_per_step="
            f"{config.learner.groups_per_step})"
        )
    if config.evaluation.games % 7:
        problems.append(f"evaluation.games must be a multiple of 7 (powers rotated), got {config.evaluation.games}")
    if config.learner.max_policy_lag < 0:
        problems.append("learner.max_policy_lag must be >= 0")
    try:
        load_reward_config(r.reward)
    except (KeyError, ValueError) as exc:
        problems.append(str(exc))
    if r.train_turns not in (None, "fork", "all"):
        problems.append(f"rollout.train_turns must be fork or all, got {r.train_turns!r}")
    problems.extend(frozen_problems(t.frozen_adapters, list(config.league.roles), list(config.league.anchors)))
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))


def compose_config(overrides: Sequence[str]) -> tuple[Config, str]:
    """`conf/config.yaml` composed with Hydra overrides, typed and validated, plus its resolved YAML (what
    `config.yaml` in the run directory holds, and what a resume compares against)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return typed_config(cfg), OmegaConf.to_yaml(cfg, resolve=True)
