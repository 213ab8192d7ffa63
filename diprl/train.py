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
already delivered), so no group, result or checkpoint is lost. `train.resume=<run_dir>` continues a run
(see `prepare_run_dir` and the README's "Resume" section for what it checks).

Stopping: SIGINT or SIGTERM (or an actor's exception) stops taking new work, lets what runs finish, then
writes the final checkpoints, the final evaluation and the summary; a second signal aborts at once.
Every learner step counts exactly once: a step is durable once its checkpoint is; steps logged after the
newest checkpoint (lost with a killed driver or a learner Ray restarted) are moved out of
`metrics.jsonl` into `metrics.superseded.jsonl` when the learner takes them again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from diprl.atomic_io import fsync_dir
from diprl.console import quiet_libraries, ray_init_options
from diprl.messages import MatchResult
from diprl.rollout.episode import EpisodeConfig

if TYPE_CHECKING:
    from diprl.raysession import RayInfo

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
NAMESPACE = "diprl"
SERVE_APP = "policy-server"  # prefix of a run's PolicyServer application (and deployment): its replicas' name
LEDGER = "group-ledger"  # the GroupLedger actor; rollout workers look it up by this name
MAX_LEARNER_FAILURES = 3  # consecutive failed steps of one learner that end the run (one bad batch does not)
LOCK_FILE = ".lock"  # flock'ed by the train process that owns a run directory
# Keys a resume may change: budgets and how this invocation reports or reaches its servers. Anything
# else (model, learner, league, rewards, rollout shape, seeds) would make the continued run another run.
RESUME_MAY_CHANGE = frozenset(
    {
        "train.max_steps",
        "train.max_minutes",
        "train.resume",
        "train.run_dir",
        "train.progress_every_s",
        "train.wandb",
        "train.dashboard",
        "train.ray_num_cpus",
        "train.chaos",
        "train.chaos_after_step",
        "inference.port",
        "inference.log_level",
    }
)


def run_id(run_dir: Path) -> str:
    """A name for what one run creates on a (possibly shared) Ray cluster: the run directory's name
    plus a hash of its full path, so two runs never share one and a resumed run finds its own."""
    path = run_dir.resolve()
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", path.name).strip("-")[:48] or "run"
    return f"{slug}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def run_namespace(run_dir: Path) -> str:
    """The run's Ray namespace: its named actors (ledger, queues, learners, league, evaluator, rollout
    workers) live there, so another run on the same cluster can neither find nor replace them."""
    return f"{NAMESPACE}-{run_id(run_dir)}"


def serve_app_name(run_dir: Path) -> str:
    """The run's Serve application, deployment and HTTP route prefix (`/<name>`): Serve names are
    cluster-wide, not per namespace."""
    return f"{SERVE_APP}-{run_id(run_dir)}"


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
class RunDir:
    """A run directory held by this process: an exclusive `flock` on its lock file until `release`.

    The lock dies with the process (a SIGKILL releases it), so a stale one never blocks a resume,
    while a second `train` on a directory in use gets a clear error instead of two drivers writing
    one league, one set of checkpoints and one metrics file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = (path / LOCK_FILE).open("a+")
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.seek(0)
            owner = self._fh.read().strip() or "another process"
            self._fh.close()
            raise ConfigError(f"{path} is in use by another train run (pid {owner}); wait for it or stop it") from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(str(os.getpid()))
        self._fh.flush()

    def release(self) -> None:
        if not self._fh.closed:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def prepare_run_dir(config: Config, resolved_yaml: str) -> RunDir:
    """A new run directory, or the one being resumed, locked for this process.

    A new run refuses a directory that holds anything. A resume refuses a directory that is not a run,
    one in use, a configuration that differs from the saved one in anything but `RESUME_MAY_CHANGE`
    (the differing keys are named), and a run where some learner has no checkpoint that verifies:
    starting that learner over would reuse its league, adapters and metrics under a fresh network.
    """
    if config.train.resume:
        path = Path(config.train.resume)
        saved = path / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"resume={path}: not a run directory (no config.yaml)")
        run_dir = RunDir(path)
        try:
            _check_resume(config, path, saved)
        except BaseException:
            run_dir.release()
            raise
        return run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(config.train.run_dir or f"runs/{config.experiment}-{stamp}")
    if (path / "config.yaml").exists():
        raise ConfigError(f"{path} already holds a run: use train.resume={path} or another train.run_dir")
    if path.exists() and (not path.is_dir() or _entries(path)):
        raise ConfigError(f"train.run_dir={path} is not empty: a new run needs an empty or new directory")
    path.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir(path)
    if _entries(path):  # another process filled it between the check and the lock
        run_dir.release()
        raise ConfigError(f"train.run_dir={path} is not empty: a new run needs an empty or new directory")
    tmp = path / ".config.yaml.tmp"
    tmp.write_text(resolved_yaml)
    os.replace(tmp, path / "config.yaml")
    fsync_dir(path)
    return run_dir


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)


def _check_resume(config: Config, path: Path, saved: Path) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from diprl.learn.checkpoint import CheckpointDir

    try:
        previous = typed_config(OmegaConf.load(saved))
    except (OmegaConfBaseException, ConfigError, ValueError) as exc:
        raise ConfigError(f"resume={path}: its config.yaml does not load ({exc})") from exc
    if previous.experiment != config.experiment:
        raise ConfigError(
            f"resume={path}: that run is experiment {previous.experiment!r}, "
            f"this one {config.experiment!r}; pass +experiment={previous.experiment}"
        )
    changed = config_differences(previous, config)
    if changed:
        raise ConfigError(
            f"resume={path}: the configuration differs from the saved run in {', '.join(changed)}; "
            f"a resume may change only {', '.join(sorted(RESUME_MAY_CHANGE))}"
        )
    for policy in previous.league.roles:
        root = path / "checkpoints" / policy
        restored = CheckpointDir(root).newest_good()
        if restored.checkpoint is None:
            why = "; ".join(f"{p.name}: {reason}" for p, reason in restored.skipped) or "there is none"
            raise ConfigError(
                f"resume={path}: no checkpoint of {policy} verifies under {root} ({why}); refusing to start "
                "it over inside a run whose league and adapters continue: start a new run instead"
            )


def config_differences(previous: Config, current: Config) -> list[str]:
    """Dotted keys whose resolved values differ between two runs' configurations, except those a resume
    may change."""
    a, b = _flatten(_plain(asdict(previous))), _flatten(_plain(asdict(current)))
    return [
        k for k in sorted(set(a) | set(b)) if a.get(k, _MISSING) != b.get(k, _MISSING) and k not in RESUME_MAY_CHANGE
    ]


_MISSING = object()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out |= _flatten(value, name)
        else:
            out[name] = value
    return out


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
        self.serve_app = serve_app_name(run_dir)  # the run's Serve application, deployment and route
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
        self.stop_reason: str | None = None  # why the run stops before its budget (signal, failed actor)
        self.exit_code = 0
        self.ledger_closed = False
        self.evaluations_pending: tuple[dict[Any, tuple[str, int]], list[tuple[str, int]]] = ({}, [])
        self.learner_failures: dict[str, int] = {}  # consecutive failed steps per policy

    def request_stop(self, reason: str, exit_code: int) -> None:
        """Stop taking new work; what runs finishes, then the final checkpoint, evaluation and summary."""
        if self.stop_reason is None:
            self.stop_reason, self.exit_code = reason, exit_code

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        import ray
        from ray import serve
        from ray.util.queue import Queue

        from diprl.eval.evaluator import start_evaluator
        from diprl.inference.server import serve_policy
        from diprl.league.manager import league_actor
        from diprl.learn.learner import learner_actor
        from diprl.rollout.worker import GroupLedger, RolloutWorker, WorkerConfig

        cfg, t = self.config, self.config.train
        # Serve configures its own driver-side logger on import: quiet it again.
        quiet_libraries(self.verbose)
        adapter_root = (self.run_dir / "adapters").resolve()
        server_config = replace(
            cfg.inference,
            adapter_root=str(adapter_root),
            adapter_cache=str((self.run_dir / ".adapter_cache").resolve()),
            adapter_registry=None,
            name=self.serve_app,
            route_prefix=f"/{self.serve_app}",
            log_level="INFO" if self.verbose else cfg.inference.log_level,  # the replicas' vLLM and Serve logs
        )
        self.server = serve_policy(server_config)
        self.serve = serve
        self.league = league_actor(cfg.league, str(self.run_dir))
        self.policies: list[str] = list(cfg.league.roles)
        # Restarted after a crash like every other actor; a restarted queue starts empty (its groups are
        # lost, never duplicated: the ledger's accepted ids are on disk).
        restart = {"max_restarts": -1, "max_task_retries": -1}
        queue_names = {p: f"queue-{p}" for p in self.policies}  # the ledger finds them by name: it is restartable
        self.queues = {
            p: Queue(maxsize=t.queue_size, actor_options={"name": name, **restart}) for p, name in queue_names.items()
        }
        accepted_log = str((self.run_dir / "ledger" / "accepted.txt").resolve())
        self.ledger = GroupLedger.options(name=LEDGER).remote(queue_names, accepted_log)  # type: ignore[attr-defined]
        self.learners = {
            p: learner_actor(replace(cfg.learner, policy=p), str(self.run_dir), str(adapter_root), name=f"learner-{p}")
            for p in self.policies
        }
        for policy, learner in self.learners.items():
            state = ray.get(learner.state.remote())
            self.steps[policy] = int(state["step"])
            self.versions[policy] = str(state["version"])
            # Steps logged after the checkpoint the learner restored were lost: it takes them again.
            self._supersede(policy, self.steps[policy])
            if ray.get(self.league.pending_reset.remote(policy)):  # stopped between the answer and the reset
                self.versions[policy] = str(ray.get(learner.reset.remote()))
            ray.get(self.league.register_version.remote(policy, self.versions[policy], self.steps[policy]))
        worker_config = WorkerConfig(
            episode=t.episode,
            reward=t.reward,
            client="serve",
            serve_app=self.serve_app,
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
        for policy in self.policies:
            self._recover_learner_records(policy)

    def _recover_learner_records(self, policy: str) -> int:
        """Copy into metrics.jsonl the learner steps its checkpoint holds but this file lacks; their number.

        A driver killed after the learner took (and checkpointed) a step but before logging it leaves
        a step that counts (its checkpoint is durable) with no record here. The learner's own log has
        it: copied with `recovered: true`, so metrics.jsonl holds every counted step once, in order.
        """
        from diprl.tracking import read_metrics

        logged = {
            r["step"]
            for r in read_metrics(self.run_dir / "metrics.jsonl")
            if r.get("kind") == "learner" and r.get("policy") == policy and isinstance(r.get("step"), int)
        }
        recovered = 0
        for record in read_metrics(self.run_dir / "learner" / policy / "metrics.jsonl"):
            step = record.get("step")
            if isinstance(step, int) and 0 < step <= self.steps[policy] and step not in logged:
                values = {k: v for k, v in _learner_record(record).items() if k not in ("time", "kind", "policy")}
                self.tracker.log("learner", values | {"recovered": True}, policy)
                logged.add(step)
                recovered += 1
        return recovered

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
            serve_app=self.serve_app,
            model=self.config.model.name,
        )

    def _supersede(self, policy: str, last_step: int) -> int:
        """Move `policy`'s learner, rollout and evaluation records after `last_step` to metrics.superseded.jsonl."""

        def lost(record: dict[str, Any]) -> bool:
            step = record.get("step", record.get("learner/step"))
            return (
                record.get("policy") == policy
                and record.get("kind") in ("learner", "rollout", "eval")
                and isinstance(step, int)
                and step > last_step
            )

        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            return int(tracker.move_records(lost, self.run_dir / "metrics.superseded.jsonl"))
        from diprl.atomic_io import move_jsonl_records

        return move_jsonl_records(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.superseded.jsonl", lost)

    # ---------------------------------------------------------------- loop
    def budget_left(self) -> bool:
        t = self.config.train
        if self.stop_reason is not None or self.steps.get("main", 0) >= t.max_steps:
            return False
        return not (t.max_minutes and (time.monotonic() - self.started) / 60 >= t.max_minutes)

    def run(self) -> None:
        """Train until the budget runs out or a stop is requested, then end the run properly.

        An unexpected error in the loop stops it at once (what was in flight is abandoned); the final
        checkpoint, evaluation and summary are still written. A second signal (KeyboardInterrupt)
        aborts without them.
        """
        try:
            self._loop()
        except Exception as exc:
            self.request_stop(f"error: {exc!r:.300}", 1)
            self.tracker.log("fault", {"error": repr(exc)[:500], "stopping": True})
        self._end()

    def _stop_rollouts(self) -> None:
        """Nobody takes batches any more: deliveries waiting on a full queue return instead of blocking."""
        import ray

        if not self.ledger_closed:
            self.ledger_closed = True
            ray.get(self.ledger.close.remote())

    def _loop(self) -> None:
        import ray

        t, e = self.config.train, self.config.evaluation
        progress = _progress(t.progress_every_s)
        playing: dict[Any, tuple[Any, Any, int]] = {}  # ref -> (worker, match, attempt)
        learning: dict[Any, str] = {}  # ref -> policy
        evaluating: dict[Any, tuple[str, int]] = {}  # ref -> (version, step)
        eval_queue: list[tuple[str, int]] = []
        self.evaluations_pending = (evaluating, eval_queue)  # versions pruning must keep
        if e.at_start and self.counters.evaluations == 0:
            eval_queue.append((self.versions["main"], self.steps["main"]))
        next_eval_step = (self.steps["main"] // e.every_steps + 1) * e.every_steps if e.every_steps else None
        policy_turn = 0
        idle_workers = list(self.workers)

        self.progress = progress
        while True:
            running = self.budget_left()
            if not running:
                self._stop_rollouts()
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
            if eval_queue and not evaluating and self.stop_reason is None:  # a stopped run evaluates at its end
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

    def _end(self) -> None:
        """The final evaluation (if configured), checkpoints and summary, on every exit the run survives."""
        e = self.config.evaluation
        if e.at_end and self.last_eval_version != self.versions["main"]:
            # The final version against the same fixed games: the "after" of a before/after comparison.
            version, step = self.versions["main"], self.steps["main"]
            self._eval_done(self.evaluator.evaluate.remote(version, f"step{step}"), version, step)
        progress = getattr(self, "progress", None)
        if progress is not None:
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
            # All G forks of the match, each weighing 1/G in the league.
            ray.get(self.league.report.remote([MatchResult(**{"forks": len(results), **r}) for r in results]))
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

        try:
            metrics = ray.get(ref)
        except Exception as exc:  # about this batch (kept in the learner's quarantine file): the run goes on
            failures = self.learner_failures.get(policy, 0) + 1
            self.learner_failures[policy] = failures
            stopping = failures >= MAX_LEARNER_FAILURES
            self.tracker.log("fault", {"learner": policy, "error": repr(exc)[:500], "stopping": stopping}, policy)
            if stopping:  # not one bad batch but a learner that fails every step: end the run properly
                self.request_stop(f"learner-{policy} failed {failures} steps in a row: {exc!r:.300}", 1)
            return
        self.learner_failures[policy] = 0
        for fault in _learner_faults(metrics):
            self.tracker.log("fault", {"learner": policy, **fault}, policy)
        step, trained = int(metrics["step"]), int(metrics.get("trained", 0))
        previous = self.steps.get(policy, 0)
        if step < previous or (trained and step == previous):
            # Ray restarted the learner: it restored its newest checkpoint and redid this step.
            moved = self._supersede(policy, step - trained)
            self.tracker.log("fault", {"learner_restored": policy, "step": step - trained, "superseded": moved}, policy)
        self.steps[policy] = step
        self.last_learner[policy] = metrics
        rollout = {
            "learner/step": self.steps[policy],
            "rollout/mean_reward": _mean(self.recent_returns),
            "rollout/hero_centres": _mean(self.recent_centres),
            "rollout/groups_per_s": self._groups_per_s(),
            "queue/depth": self.queues[policy].qsize(),
        }
        self.tracker.log("learner", _learner_record(metrics), policy)
        self.tracker.log("rollout", rollout, policy)
        published = metrics.get("published")
        if published:
            self.versions[policy] = str(published)
            decision = ray.get(self.league.register_version.remote(policy, published, self.steps[policy]))
            self.tracker.log("league", {"version": published, **_plain(decision.to_dict())}, policy)
            if decision.reset:
                version = ray.get(self.learners[policy].reset.remote())
                self.versions[policy] = str(version)
                ray.get(self.league.register_version.remote(policy, version, self.steps[policy]))
            evaluating, eval_queue = self.evaluations_pending
            keep = {*ray.get(self.league.refs_in_use.remote()), *(v for v, _ in [*evaluating.values(), *eval_queue])}
            self.learners[policy].prune_versions.remote(sorted(keep))
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
                    if "SERVE_REPLICA" in actor["name"] and self.serve_app in actor["name"]:
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

        for policy, learner in self.learners.items():
            try:
                ray.get(learner.save_checkpoint.remote())
            except Exception as exc:  # keep ending: the league summary and the metrics still matter
                self.tracker.log("fault", {"checkpoint": policy, "error": repr(exc)[:500]}, policy)
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


def _learner_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """What metrics.jsonl keeps of a learner step's metrics (faults and quarantined records go in their own)."""
    return {k: v for k, v in metrics.items() if k not in ("published", "quarantined_records", "faults")}


def _tracker(run_dir: Path, config: Config, use_wandb: bool) -> Any:
    from diprl.tracking import Tracker

    return Tracker(run_dir, _plain(asdict(config)), use_wandb=use_wandb)


def _progress(every_s: float) -> Any:
    from diprl.tracking import ProgressLine

    return ProgressLine(every_s)


def _learner_faults(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One fault record per quarantined record, failed publish or checkpoint, and skipped non-finite step."""
    faults = [{"fault": "quarantined", **q} for q in metrics.get("quarantined_records") or []]
    faults += list(metrics.get("faults") or [])
    if metrics.get("nonfinite_gradients"):
        faults.append({"fault": "nonfinite_gradients", "step": metrics.get("step")})
    return faults


def _mean(values: Sequence[float] | deque[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def init_ray(config: Config, verbose: bool = False, namespace: str = NAMESPACE) -> RayInfo:
    """Join the cluster named by RAY_ADDRESS, or start a loopback-only local Ray (see diprl.raysession);
    the driver and the actors it creates use `namespace` (a run's own: `run_namespace`)."""
    from diprl.raysession import connect

    t = config.train
    wanted = int(config.inference.replica_cpus * config.inference.num_replicas + len(config.league.roles) + 1)
    wanted += int(t.num_workers * t.worker_cpus + 0.999)
    # Actors' own output (vLLM, Serve replicas) stays in Ray's log files unless --verbose: the terminal
    # shows our progress and results.
    return connect(
        num_cpus=t.ray_num_cpus or max(os.cpu_count() or 1, wanted),
        dashboard=t.dashboard,
        namespace=namespace,
        **ray_init_options(verbose),
    )


def run(config: Config, resolved_yaml: str, verbose: bool = False) -> dict[str, Any]:
    """One training run (or its continuation); returns the final summary printed on the last line.

    The summary's `stopped` says why a run ended before its budget (a signal, a failed actor) and
    `exit_code` what `main` returns: 0 at the budget, 1 after a failure, 128 + the signal's number.
    """
    import ray

    from diprl.inference.server import stop_serving

    quiet_libraries(verbose)
    with prepare_run_dir(config, resolved_yaml) as held:
        run_dir = held.path
        info = init_ray(config, verbose, namespace=run_namespace(run_dir))
        print(f"run directory: {run_dir}", flush=True)
        if hint := info.dashboard_hint():
            print(hint, flush=True)
        driver = Driver(config, run_dir, verbose)
        previous = _stop_on_signals(driver)
        try:
            driver.start()
            print(
                f"training {', '.join(driver.policies)} on {config.model.name}; league {config.experiment}; "
                f"versions {', '.join(driver.versions.values())}",
                flush=True,
            )
            driver.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            try:
                stop_serving(serve_app_name(run_dir), adapter_root=run_dir / "adapters")  # never another run's
            finally:
                ray.shutdown()
    summary: dict[str, Any] = {
        "train_steps": driver.steps.get("main", 0),
        "adapter_versions": _count_versions(run_dir / "adapters"),
        "groups": driver.counters.groups,
        "run_dir": str(run_dir),
    }
    if driver.stop_reason is not None:
        summary["stopped"] = driver.stop_reason.replace(" ", "_")[:80]
    print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {run_dir / 'plots'}; evaluations: {run_dir / 'eval'}")
    print(f"checkpoints: {run_dir / 'checkpoints'}; adapters: {run_dir / 'adapters'}; league: {run_dir / 'league'}")
    print(" ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    summary["exit_code"] = driver.exit_code
    return summary


def _stop_on_signals(driver: Driver) -> dict[int, Any]:
    """SIGINT/SIGTERM: the first asks the driver to stop and drain; the second aborts (KeyboardInterrupt).

    Installed after `ray.init`, which sets its own SIGTERM handler (exit at once). Returns the handlers
    replaced, to put back.
    """
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): aborting")
        name = signal.Signals(signum).name
        print(
            f"\n{name}: finishing the steps in flight, then the final checkpoint, evaluation and summary "
            "(send it again to abort)",
            file=sys.stderr,
            flush=True,
        )
        driver.request_stop(f"signal {name}", 128 + signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handler)
    return previous


def _count_versions(adapter_root: Path) -> int:
    from diprl.inference.adapters import AdapterStore

    if not adapter_root.is_dir():
        return 0
    store = AdapterStore(adapter_root)
    return sum(len(store.versions(p)) for p in store.policies())


def compose_config(overrides: Sequence[str]) -> tuple[Config, str]:
    """`conf/config.yaml` composed with Hydra overrides, typed and validated, plus its resolved YAML (what
    `config.yaml` in the run directory holds, and what a resume compares against)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return typed_config(cfg), OmegaConf.to_yaml(cfg, resolve=True)


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
        summary = run(config, resolved, verbose)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(summary.get("exit_code", 0))


if __name__ == "__main__":
    raise SystemExit(main())
