"""`python -m diprl.train +experiment=pfsp`: league RL of an LLM on Ray, on a laptop or a GPU cluster.

Wiring only. The driver starts (or joins) Ray and places the pieces by resources:

    PolicyServer (Ray Serve, vLLM)   <- rollout-<i> actors ask it for every LLM seat's orders
    league (LeagueManager)           -> hands out Matches, takes MatchResults, grows the pool
    group-ledger -> one queue per trained policy -> learner-<policy> (GRPO on LoRA, publishes versions)
    evaluator                        -> fixed evaluation games against a frozen pool, every few steps

then keeps every rollout worker busy, feeds each learner whole batches of groups from its queue, tells the
league about every published version, evaluates on a cadence, and reports (progress line, metrics JSONL,
W&B, Ray metrics, plots) until a step or time budget runs out. A killed actor is restarted by Ray and its
call retried; a match whose call failed is replayed with the same seed (the ledger drops a group that was
already delivered), so no group, result or checkpoint is lost. `resume=<run_dir>` continues a run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from diprl.atomic_io import fsync_dir
from diprl.console import quiet_libraries, ray_init_options
from diprl.rollout.episode import EpisodeConfig

if TYPE_CHECKING:
    from diprl.raysession import RayInfo

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
NAMESPACE = "diprl"
SERVE_APP = "policy-server"  # the PolicyServer's Serve application and deployment: its replicas' name
LEDGER = "group-ledger"  # the GroupLedger actor; rollout workers look it up by this name


# ------------------------------------------------------------------------------------------ config
@dataclass
class EvalScheduleConfig:
    """Evaluation during training: fixed seeded games, the hero against a frozen pool."""

    every_steps: int = 10  # main learner steps between evaluations (0: only at the start and the end)
    games: int = 14  # per opponent; a multiple of 7 rotates the hero over every power equally
    max_year: int = 1906
    opponents: list[str] = field(default_factory=lambda: ["bot:random", "bot:dumbbot"])
    temperature: float = 1.0
    at_start: bool = True
    at_end: bool = True
    seed: int = 12345


@dataclass
class TrainConfig:
    """The run itself: budget, rollout capacity, where it writes, how it reports."""

    run_dir: str | None = None  # default: runs/<experiment>-<UTC time>
    resume: str | None = None  # a run directory to continue (learner, league, counters)
    max_steps: int = 200  # main learner steps, counted across resumes
    max_minutes: float = 10.0  # wall-clock budget of this invocation (0: no limit)
    num_workers: int = 2  # rollout actors
    worker_cpus: float = 0.5
    queue_size: int = 64  # groups per policy queue (a full queue blocks rollouts: backpressure)
    reward: str = "default"  # conf/reward/<name>.yaml
    train_turns: str | None = None  # fork | all; None: the reward config's credit.train_turns
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    match_retries: int = 3  # a match whose call failed (replica restart, ...) is replayed this often
    progress_every_s: float = 10.0
    wandb: bool = True
    ray_num_cpus: int | None = None  # local Ray only; None: max(cores, what the actors ask for)
    dashboard: bool = True
    seed: int = 0
    # Testing the fault tolerance: actor names to kill (Ray restarts them) once the main learner has
    # taken `chaos_after_step` steps. E.g. [rollout-0, league, learner-main, policy-server].
    chaos: list[str] = field(default_factory=list)
    chaos_after_step: int = 1


@dataclass
class Config:
    """The composed run configuration (`conf/config.yaml` + an experiment + overrides)."""

    experiment: str = "default"
    model: Any = MISSING  # ModelPreset (Hydra group `model`)
    inference: Any = MISSING  # ServerConfig (group `inference`)
    learner: Any = MISSING  # LearnerConfig (group `learner`)
    league: Any = MISSING  # LeagueConfig (group `league`)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvalScheduleConfig = field(default_factory=EvalScheduleConfig)


class ConfigError(ValueError):
    """A bad configuration: reported before anything starts."""


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


def typed_config(cfg: Any) -> Config:
    """The composed DictConfig as typed objects, every section validated; errors name the section."""
    from omegaconf import OmegaConf

    from diprl.inference.config import ServerConfig
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
        sections: dict[str, Any] = {}
        for name, schema in (("inference", ServerConfig), ("learner", LearnerConfig), ("league", LeagueConfig)):
            body = dict(raw[name])
            body.pop("defaults", None)
            sections[name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), body))
        train = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), raw.get("train", {})))
        evaluation = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(EvalScheduleConfig), raw.get("evaluation", {}))
        )
    except Exception as exc:  # OmegaConf validation or a dataclass __post_init__
        raise ConfigError(f"invalid configuration: {exc}") from exc
    assert isinstance(train, TrainConfig) and isinstance(evaluation, EvalScheduleConfig)
    config = Config(
        experiment=str(raw.get("experiment", "default")),
        model=model,
        inference=replace(sections["inference"], model=model.name),
        learner=replace(sections["learner"], model=model.name),
        league=sections["league"],
        train=train,
        evaluation=evaluation,
    )
    _check(config)
    return config


def _check(config: Config) -> None:
    from diprl.rollout.rewards import load_reward_config

    t = config.train
    problems = []
    if t.max_steps < 0 or t.max_minutes < 0:
        problems.append("train.max_steps and train.max_minutes must be >= 0")
    if t.num_workers < 1:
        problems.append(f"train.num_workers must be >= 1, got {t.num_workers}")
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
        load_reward_config(t.reward)
    except (KeyError, ValueError) as exc:
        problems.append(str(exc))
    if t.train_turns not in (None, "fork", "all"):
        problems.append(f"train.train_turns must be fork or all, got {t.train_turns!r}")
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------ run dir
def prepare_run_dir(config: Config, resolved_yaml: str) -> Path:
    """A new run directory, or the one being resumed (which must be a run of the same experiment)."""
    if config.train.resume:
        run_dir = Path(config.train.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"resume={run_dir}: not a run directory (no config.yaml)")
        from omegaconf import OmegaConf

        previous = OmegaConf.to_container(OmegaConf.load(saved))
        experiment = previous.get("experiment") if isinstance(previous, dict) else None
        if str(experiment) != config.experiment:
            raise ConfigError(
                f"resume={run_dir}: that run is experiment {experiment!r}, "
                f"this one {config.experiment!r}; pass +experiment={experiment}"
            )
        return run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(config.train.run_dir or f"runs/{config.experiment}-{stamp}")
    if (run_dir / "config.yaml").exists():
        raise ConfigError(f"{run_dir} already holds a run: use resume={run_dir} or another train.run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(resolved_yaml)
    os.replace(tmp, run_dir / "config.yaml")
    fsync_dir(run_dir)
    return run_dir


@dataclass
class Counters:
    """What the driver itself must carry across a resume (learner and league persist their own state)."""

    matches: int = 0
    groups: int = 0
    results: int = 0
    failed_matches: int = 0
    evaluations: int = 0
    minutes: float = 0.0


def load_counters(run_dir: Path) -> Counters:
    path = run_dir / "train_state.json"
    if not path.is_file():
        return Counters()
    try:
        return Counters(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"{path} is corrupt ({exc}); delete it to restart the counters") from exc


def save_counters(run_dir: Path, counters: Counters) -> None:
    tmp = run_dir / ".train_state.json.tmp"
    with tmp.open("w") as f:
        json.dump(asdict(counters), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / "train_state.json")


# ------------------------------------------------------------------------------------------ driver
class Driver:
    """Owns the actors of one run and the loop that keeps them busy."""

    def __init__(self, config: Config, run_dir: Path, verbose: bool = False) -> None:
        self.config = config
        self.run_dir = run_dir
        self.verbose = verbose
        self.counters = load_counters(run_dir)
        self.started = time.monotonic()
        self.recent_returns: deque[float] = deque(maxlen=64)
        self.recent_centres: deque[float] = deque(maxlen=64)
        self.group_times: deque[float] = deque(maxlen=64)
        self.steps: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.last_learner: dict[str, dict[str, Any]] = {}
        self.last_eval: dict[str, Any] = {}
        self.rating: float | None = None
        self.chaos_done = False
        self.last_eval_version: str | None = None

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        import ray
        from ray import serve
        from ray.util.queue import Queue

        from diprl.eval.evaluator import start_evaluator
        from diprl.inference.registry import start_registry
        from diprl.inference.server import serve_policy
        from diprl.league.manager import league_actor
        from diprl.learn.learner import learner_actor
        from diprl.rollout.worker import GroupLedger, RolloutWorker, WorkerConfig

        cfg, t = self.config, self.config.train
        # Serve configures its own driver-side logger on import: quiet it again.
        quiet_libraries(self.verbose)
        adapter_root = (self.run_dir / "adapters").resolve()
        self.registry = start_registry()
        server_config = replace(
            cfg.inference,
            adapter_root=str(adapter_root),
            adapter_cache=str((self.run_dir / ".adapter_cache").resolve()),
            adapter_registry=None,
            name=SERVE_APP,
            log_level="INFO" if self.verbose else cfg.inference.log_level,  # the replicas' vLLM and Serve logs
        )
        self.server = serve_policy(server_config)
        self.serve = serve
        self.league = league_actor(cfg.league, str(self.run_dir))
        self.policies: list[str] = list(cfg.league.roles)
        self.queues = {p: Queue(maxsize=t.queue_size, actor_options={"name": f"queue-{p}"}) for p in self.policies}
        self.ledger = GroupLedger.options(name=LEDGER).remote(self.queues)  # type: ignore[attr-defined]
        self.learners = {
            p: learner_actor(replace(cfg.learner, policy=p), str(self.run_dir), str(adapter_root), name=f"learner-{p}")
            for p in self.policies
        }
        for policy, learner in self.learners.items():
            state = ray.get(learner.state.remote())
            self.steps[policy] = int(state["step"])
            self.versions[policy] = str(state["version"])
            ray.get(self.league.register_version.remote(policy, self.versions[policy], self.steps[policy]))
        worker_config = WorkerConfig(
            episode=t.episode,
            reward=t.reward,
            client="serve",
            serve_app=SERVE_APP,
            seed=t.seed,
            train_turns=t.train_turns,
            model=cfg.model.name,
        )
        self.workers = [
            RolloutWorker.options(name=f"rollout-{i}", num_cpus=t.worker_cpus).remote(  # type: ignore[attr-defined]
                worker_config, LEDGER, i
            )
            for i in range(t.num_workers)
        ]
        self.evaluator = start_evaluator(self._evaluator_config(), str(self.run_dir), num_cpus=0.1)
        self.tracker = _tracker(self.run_dir, cfg, t.wandb)

    def _evaluator_config(self) -> Any:
        from diprl.eval.evaluator import EvaluatorConfig

        e = self.config.evaluation
        return EvaluatorConfig(
            pool=list(e.opponents),
            games=e.games,
            max_year=e.max_year,
            seed=e.seed,
            temperature=e.temperature,
            max_tokens=self.config.train.episode.max_tokens,
            serve_app=SERVE_APP,
            model=self.config.model.name,
        )

    # ---------------------------------------------------------------- loop
    def budget_left(self) -> bool:
        t = self.config.train
        if self.steps.get("main", 0) >= t.max_steps:
            return False
        return not (t.max_minutes and (time.monotonic() - self.started) / 60 >= t.max_minutes)

    def run(self) -> None:
        import ray

        t, e = self.config.train, self.config.evaluation
        progress = _progress(t.progress_every_s)
        playing: dict[Any, tuple[Any, Any, int]] = {}  # ref -> (worker, match, attempt)
        learning: dict[Any, str] = {}  # ref -> policy
        evaluating: dict[Any, tuple[str, int]] = {}  # ref -> (version, step)
        eval_queue: list[tuple[str, int]] = []
        if e.at_start and self.counters.evaluations == 0:
            eval_queue.append((self.versions["main"], self.steps["main"]))
        next_eval_step = (self.steps["main"] // e.every_steps + 1) * e.every_steps if e.every_steps else None
        policy_turn = 0
        idle_workers = list(self.workers)

        while True:
            running = self.budget_left()
            # 1. every idle worker plays the next match (round robin over trained policies)
            while running and idle_workers:
                policy = self.policies[policy_turn % len(self.policies)]
                policy_turn += 1
                match = ray.get(self.league.next_match.remote(policy))
                worker = idle_workers.pop()
                playing[worker.play.remote(match)] = (worker, match, 0)
            # 2. every idle learner gets a batch when its queue holds one
            busy = set(learning.values())
            for policy, learner in self.learners.items():
                n = self.config.learner.groups_per_step
                if policy not in busy and running and self.queues[policy].qsize() >= n:
                    groups = self.queues[policy].get_nowait_batch(n)
                    learning[learner.train_step.remote(groups)] = policy
            # 3. evaluations, one at a time
            if next_eval_step is not None and self.steps["main"] >= next_eval_step:
                eval_queue.append((self.versions["main"], self.steps["main"]))
                next_eval_step += e.every_steps
            if eval_queue and not evaluating:
                version, step = eval_queue.pop(0)
                evaluating[self.evaluator.evaluate.remote(version, f"step{step}")] = (version, step)
            self._maybe_chaos()
            pending = list(playing) + list(learning) + list(evaluating)
            if not pending:
                break
            done, _ = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                if ref in playing:
                    worker, match, attempt = playing.pop(ref)
                    self._match_done(ref, worker, match, attempt, playing, idle_workers)
                elif ref in learning:
                    self._learner_done(ref, learning.pop(ref))
                else:
                    self._eval_done(ref, *evaluating.pop(ref))
            progress.update(self._progress_fields())
            self.counters.minutes = (time.monotonic() - self.started) / 60
        if e.at_end and self.last_eval_version != self.versions["main"]:
            # The final version against the same fixed games: the "after" of a before/after comparison.
            version, step = self.versions["main"], self.steps["main"]
            self._eval_done(self.evaluator.evaluate.remote(version, f"step{step}"), version, step)
        progress.update(self._progress_fields(), force=True)
        progress.close()
        self._finish()

    def _match_done(
        self, ref: Any, worker: Any, match: Any, attempt: int, playing: dict[Any, Any], idle: list[Any]
    ) -> None:
        import ray

        try:
            summary = ray.get(ref)
        except Exception as exc:  # the PolicyServer restarting, an engine error: replay the same match
            self.counters.failed_matches += 1
            self.tracker.log("fault", {"match_id": match.match_id, "attempt": attempt, "error": repr(exc)[:500]})
            if attempt < self.config.train.match_retries:
                playing[worker.play.remote(match)] = (worker, match, attempt + 1)
            else:
                idle.append(worker)
            return
        idle.append(worker)
        self.counters.matches += 1
        results = summary["results"]
        if results:
            ray.get(self.league.report.remote(results))
            self.counters.results += len(results)
            hero = results[0]["hero"]
            self.recent_centres.append(sum(r["centres"][hero] for r in results) / len(results))
        if summary["delivered"]:
            self.counters.groups += 1
            self.group_times.append(time.monotonic())
        if summary.get("group_returns"):
            self.recent_returns.extend(summary["group_returns"])

    def _learner_done(self, ref: Any, policy: str) -> None:
        import ray

        metrics = ray.get(ref)
        self.steps[policy] = int(metrics["step"])
        self.last_learner[policy] = metrics
        rollout = {
            "learner/step": self.steps[policy],
            "rollout/mean_reward": _mean(self.recent_returns),
            "rollout/hero_centres": _mean(self.recent_centres),
            "rollout/groups_per_s": self._groups_per_s(),
            "queue/depth": self.queues[policy].qsize(),
        }
        self.tracker.log("learner", {k: v for k, v in metrics.items() if k != "published"}, policy)
        self.tracker.log("rollout", rollout, policy)
        published = metrics.get("published")
        if published:
            self.versions[policy] = str(published)
            decision = ray.get(self.league.register_version.remote(policy, published, self.steps[policy]))
            self.tracker.log("league", {"version": published, **_plain(decision)}, policy)
            if decision.get("reset"):
                version = ray.get(self.learners[policy].reset.remote())
                self.versions[policy] = str(version)
                ray.get(self.league.register_version.remote(policy, version, self.steps[policy]))
        if policy == "main" and self.steps[policy] % 5 == 0:
            self.rating = self._main_rating()
        save_counters(self.run_dir, self.counters)

    def _main_rating(self) -> float | None:
        """The league's rating of main's current version (None before it has one)."""
        import ray

        version = self.versions.get("main")
        return None if version is None else ray.get(self.league.rating.remote(version))

    def _eval_done(self, ref: Any, version: str, step: int) -> None:
        import ray

        try:
            result = ray.get(ref)
        except Exception as exc:
            self.tracker.log("fault", {"evaluation": version, "error": repr(exc)[:500]})
            return
        self.counters.evaluations += 1
        self.last_eval_version = version
        report_path = str(self.run_dir / "eval" / result["tag"] / "report.json")
        for opponents, report in result["suites"].items():
            centres = report["hero_centres"]
            values = {
                "step": step,
                "version": version,
                "opponents": opponents,
                "eval/hero_mean_sc": report["hero_mean_sc"],
                "eval/hero_mean_sc_lo": centres["ci95"][0],
                "eval/hero_mean_sc_hi": centres["ci95"][1],
                "eval/hero_solo_rate": report["hero_solo_rate"],
                "eval/report": report_path,
            }
            self.last_eval[opponents] = values
            self.tracker.log("eval", values)
        save_counters(self.run_dir, self.counters)

    def _maybe_chaos(self) -> None:
        """Kill the configured actors once (fault-tolerance tests); Ray restarts every one of them."""
        import ray

        t = self.config.train
        if self.chaos_done or not t.chaos or self.steps.get("main", 0) < t.chaos_after_step:
            return
        self.chaos_done = True
        for name in t.chaos:
            if name == "policy-server":  # Serve notices the dead replica and starts another
                for actor in ray.util.list_named_actors(all_namespaces=True):
                    if "SERVE_REPLICA" in actor["name"] and SERVE_APP in actor["name"]:
                        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
            else:
                ray.kill(ray.get_actor(name), no_restart=False)
            self.tracker.log("fault", {"killed": name})

    # ---------------------------------------------------------------- report
    def _groups_per_s(self) -> float:
        if len(self.group_times) < 2:
            return 0.0
        span = self.group_times[-1] - self.group_times[0]
        return (len(self.group_times) - 1) / span if span > 0 else 0.0

    def _progress_fields(self) -> dict[str, Any]:
        main = self.last_learner.get("main", {})
        fields: dict[str, Any] = {
            "step": self.steps.get("main", 0),
            "groups/s": round(self._groups_per_s(), 3),
            "tok/s": round(float(main.get("tokens_per_s", 0.0)), 1),
            "reward": round(_mean(self.recent_returns), 3),
            "hero_sc": round(_mean(self.recent_centres), 2),
            "queue": sum(q.qsize() for q in self.queues.values()),
            "lag": round(float(main.get("policy_lag_mean", 0.0)), 2),
            "version": self.versions.get("main", "-"),
        }
        for opponents, values in self.last_eval.items():
            fields[f"eval_sc[{opponents}]"] = round(values["eval/hero_mean_sc"], 2)
        if self.rating is not None:
            fields["rating"] = round(self.rating, 2)
        return fields

    def _finish(self) -> None:
        import ray

        from diprl.tracking import plot_learning_curves, read_metrics

        for learner in self.learners.values():
            ray.get(learner.save_checkpoint.remote())
        summary = ray.get(self.league.summary.remote())
        (self.run_dir / "league_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        self.rating = self._main_rating()
        self.tracker.log("league", {"league/rating": self.rating} if self.rating is not None else {})
        save_counters(self.run_dir, self.counters)
        self.tracker.close()
        plot_learning_curves(
            read_metrics(self.run_dir / "metrics.jsonl"),
            self.run_dir / "plots" / "learning_curves.png",
            title=f"{self.config.experiment}: {self.run_dir.name}",
        )


def _tracker(run_dir: Path, config: Config, use_wandb: bool) -> Any:
    from diprl.tracking import Tracker

    return Tracker(run_dir, _plain(asdict(config)), use_wandb=use_wandb)


def _progress(every_s: float) -> Any:
    from diprl.tracking import ProgressLine

    return ProgressLine(every_s)


def _mean(values: Sequence[float] | deque[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def init_ray(config: Config, verbose: bool = False) -> RayInfo:
    """Join the cluster named by RAY_ADDRESS, or start a loopback-only local Ray (see diprl.raysession)."""
    from diprl.raysession import connect

    t = config.train
    wanted = int(config.inference.replica_cpus * config.inference.num_replicas + len(config.league.roles) + 1)
    wanted += int(t.num_workers * t.worker_cpus + 0.999)
    # Actors' own output (vLLM, Serve replicas) stays in Ray's log files unless --verbose: the terminal
    # shows our progress and results.
    return connect(
        num_cpus=t.ray_num_cpus or max(os.cpu_count() or 1, wanted),
        dashboard=t.dashboard,
        namespace=NAMESPACE,
        **ray_init_options(verbose),
    )


def run(config: Config, resolved_yaml: str, verbose: bool = False) -> dict[str, Any]:
    """One training run (or its continuation); returns the final summary printed on the last line."""
    import ray

    from diprl.inference.server import stop_serving

    quiet_libraries(verbose)
    run_dir = prepare_run_dir(config, resolved_yaml)
    info = init_ray(config, verbose)
    print(f"run directory: {run_dir}", flush=True)
    if hint := info.dashboard_hint():
        print(hint, flush=True)
    driver = Driver(config, run_dir, verbose)
    try:
        driver.start()
        print(
            f"training {', '.join(driver.policies)} on {config.model.name}; league {config.experiment}; "
            f"versions {', '.join(driver.versions.values())}",
            flush=True,
        )
        driver.run()
    finally:
        try:
            stop_serving(SERVE_APP)
        finally:
            ray.shutdown()
    summary = {
        "train_steps": driver.steps.get("main", 0),
        "adapter_versions": _count_versions(run_dir / "adapters"),
        "groups": driver.counters.groups,
        "run_dir": str(run_dir),
    }
    print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {run_dir / 'plots'}; evaluations: {run_dir / 'eval'}")
    print(f"checkpoints: {run_dir / 'checkpoints'}; adapters: {run_dir / 'adapters'}; league: {run_dir / 'league'}")
    print(" ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    return summary


def _count_versions(adapter_root: Path) -> int:
    from diprl.inference.adapters import AdapterStore

    if not adapter_root.is_dir():
        return 0
    store = AdapterStore(adapter_root)
    return sum(len(store.versions(p)) for p in store.policies())


def compose_config(overrides: Sequence[str]) -> tuple[Config, str]:
    """`conf/config.yaml` composed with Hydra overrides, typed and validated, plus its resolved YAML."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return typed_config(cfg), OmegaConf.to_yaml(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Compose `conf/config.yaml` with the command line's overrides (Hydra syntax) and run."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in args or "hydra.verbose=true" in args
    args = [a for a in args if a not in ("--verbose", "hydra.verbose=true")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("experiments:", ", ".join(sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))))
        return 0
    try:
        config, resolved = compose_config(args)
    except (HydraException, OmegaConfBaseException, ConfigError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run(config, resolved, verbose)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
