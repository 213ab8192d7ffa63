"""`python -m diprl.train +experiment=pfsp`: league RL of an LLM on Ray, on a laptop or a GPU cluster.

Wiring only: compose the configuration (`diprl.run.config`), take the run directory (`diprl.run.rundir`),
start (or join) Ray, create the run's actors, and hand them to the driver (`diprl.run.driver`):

    PolicyServer (Ray Serve, vLLM)   <- rollout-<i> actors ask it for every LLM seat of every match in flight
    league (LeagueManager)           -> hands out Matches, takes MatchResults, grows the pool
    group-ledger -> queue-<policy>   -> learner-<policy> pulls its batches (GRPO on LoRA, publishes versions)
    evaluator                        -> fixed evaluation games against a frozen pool, every few steps

A killed actor is restarted by Ray and its call retried; `train.resume=<run_dir>` continues a run after
any stop (docs/training.md, "Resume", says what it checks). SIGINT or SIGTERM (or an actor's error)
stops taking new work, lets what runs finish, then writes the final checkpoints, evaluation and summary;
a second signal aborts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diprl.console import quiet_libraries, ray_init_options
from diprl.run.config import CONF_DIR, Config, ConfigError, compose_config
from diprl.run.driver import Actors, Driver, Stop
from diprl.run.provenance import write_provenance
from diprl.run.rundir import NAMESPACE, json_safe, load_counters, prepare_run_dir, run_namespace, serve_app_name

LEDGER = "group-ledger"  # the GroupLedger actor; rollout workers look it up by this name


def queue_name(policy: str) -> str:
    return f"queue-{policy}"


def server_config(config: Config, run_dir: Path, verbose: bool = False) -> Any:
    """The run's PolicyServer: its own Serve app and route, serving the run's adapter store."""
    serve_app = serve_app_name(run_dir)
    return replace(
        config.inference,
        adapter_root=str((run_dir / "adapters").resolve()),
        adapter_cache=str((run_dir / ".adapter_cache").resolve()),
        adapter_registry=None,
        name=serve_app,
        route_prefix=f"/{serve_app}",
        log_level="INFO" if verbose else config.inference.log_level,  # the replicas' vLLM and Serve logs
    )


def start_actors(config: Config, run_dir: Path) -> Actors:
    """Create (or, on a resumed run, find) every actor of the run but the PolicyServer, placed by resources:
    their CPUs and GPUs, and the custom resources `config.placement` names for their role."""
    import ray
    from ray.util.queue import Queue

    from diprl.eval.evaluator import EvaluatorConfig, start_evaluator
    from diprl.league.manager import league_actor
    from diprl.learn.learner import learner_actor
    from diprl.rollout.worker import GroupLedger, WorkerConfig, worker_actor

    where = config.placement
    _warn_missing_resources(where.missing(ray.cluster_resources()))
    serve_app = serve_app_name(run_dir)
    adapter_root = (run_dir / "adapters").resolve()
    league = league_actor(config.league, str(run_dir), resources=where.league)
    policies = list(config.league.roles)
    # Restarted after a crash like every other actor; a restarted queue starts empty (its groups are lost,
    # never duplicated: the ledger's accepted ids are on disk). The ledger and learners find them by name.
    # No CPU held, said outright: an actor that names custom resources (placement) and no CPUs holds one.
    restart = {"max_restarts": -1, "max_task_retries": -1, "num_cpus": 0}
    queues = {
        p: Queue(
            maxsize=config.train.queue_size,
            actor_options={"name": queue_name(p), "resources": where.queues, **restart},
        )
        for p in policies
    }
    accepted_log = str((run_dir / "ledger" / "accepted.txt").resolve())
    ledger = GroupLedger.options(name=LEDGER, resources=where.ledger, num_cpus=0).remote(  # type: ignore[attr-defined]
        {p: queue_name(p) for p in policies}, accepted_log
    )
    learners = {
        p: learner_actor(
            replace(config.learner, policy=p),
            str(run_dir),
            str(adapter_root),
            name=f"learner-{p}",
            queue=queue_name(p),
            resources=where.learner,
        )
        for p in policies
    }
    r = config.rollout
    worker_config = WorkerConfig(
        episode=r.episode,
        reward=r.reward,
        client="serve",
        serve_app=serve_app,
        seed=config.train.seed,
        train_turns=r.train_turns,
        model=config.model.name,
        matches_in_flight=r.matches_in_flight,
        start_states=r.start_states,
        trace_dir=str((run_dir / "traces").resolve()),
    )
    workers = [
        worker_actor(worker_config, LEDGER, i, r.worker_cpus, f"rollout-{i}", where.rollout)
        for i in range(r.num_workers)
    ]
    e = config.evaluation
    evaluator = start_evaluator(
        EvaluatorConfig(pool=list(e.opponents), play=e, serve_app=serve_app, model=config.model.name),
        str(run_dir),
        num_cpus=0.1,
        resources=where.evaluator,
    )
    ray.get([learner.pid_of.remote() for learner in learners.values()])  # built (or restored) before the loop
    return Actors(serve_app, league, ledger, queues, learners, workers, evaluator)


def _warn_missing_resources(missing: dict[str, list[str]]) -> None:
    """Say why the run waits when no node declares a resource the placement asks for. Not an error: on a
    cluster that is still starting (or an autoscaler's node type that declares it) such a node may join."""
    for role, names in missing.items():
        print(
            f"warning: placement.{role} asks for {', '.join(names)}, which no node of this Ray cluster declares "
            f"yet: its actors wait until a node that does joins (docs/cluster.md: where each role runs)",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def web_app(config: Config, run_dir: Path) -> Iterator[None]:
    """The web app beside the run (loopback), its address printed; LLM seats of games played there go to
    the run's own PolicyServer. `train.web_port=null` turns it off."""
    port = config.train.web_port
    if port is None:
        yield
        return
    from diprl.rollout.clients import ServeClient
    from diprl.web.clients import RunServerClients
    from diprl.web.server import start_web

    clients = RunServerClients(run_dir / "adapters", lambda: ServeClient(app_name=serve_app_name(run_dir)))
    try:
        web = start_web(run_dir.parent, port=port, client_factory=clients)
    except OSError:  # the port is taken (another run's app): any free one
        web = start_web(run_dir.parent, port=0, client_factory=clients)
    print(f"web app: {web.url} (runs, league, games, play)", flush=True)
    try:
        yield
    finally:
        web.stop()


def ray_options(config: Config, verbose: bool = False, namespace: str = NAMESPACE) -> dict[str, Any]:
    """How to join the cluster named by RAY_ADDRESS, or start a loopback-only local Ray (see
    diprl.raysession); the driver and the actors it creates use `namespace` (a run's own: `run_namespace`)."""
    t, r = config.train, config.rollout
    wanted = int(config.inference.replica_cpus * config.inference.num_replicas + len(config.league.roles) + 1)
    wanted += int(r.num_workers * r.worker_cpus + 0.999)
    # Actors' own output (vLLM, Serve replicas) stays in Ray's log files unless --verbose: the terminal
    # shows our progress and results.
    return {
        "num_cpus": t.ray_num_cpus or max(os.cpu_count() or 1, wanted),
        "dashboard": t.dashboard,
        "namespace": namespace,
        **ray_init_options(verbose),
    }


def run(config: Config, resolved_yaml: str, verbose: bool = False) -> dict[str, Any]:
    """One training run (or its continuation); returns the final summary printed on the last line.

    The summary's `stopped` says why a run ended before its budget (a signal, a failed actor) and
    `exit_code` what `main` returns: 0 at the budget, 1 after a failure, 128 + the signal's number.
    """
    from diprl.inference.server import deploying
    from diprl.raysession import ray_session
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.tracking import Tracker

    quiet_libraries(verbose)
    stop = Stop()
    with (
        prepare_run_dir(config, resolved_yaml) as held,
        ray_session(**ray_options(config, verbose, namespace=run_namespace(held.path))) as info,
    ):
        run_dir = held.path
        write_provenance(run_dir)
        print(f"run directory: {run_dir}", flush=True)
        if hint := info.dashboard_hint():
            print(hint, flush=True)
        previous = _stop_on_signals(stop)
        try:
            quiet_libraries(verbose)  # Serve configures its own driver-side logger on import: quiet it again
            server = server_config(config, run_dir, verbose)
            with deploying(server, config.placement.inference) as deployment, web_app(config, run_dir):
                actors = start_actors(config, run_dir)  # while the PolicyServer's replicas start
                deployment.result()  # up before any match or evaluation is asked of it
                tracker = Tracker(run_dir, json_safe(asdict(config)), use_wandb=config.train.wandb)
                journal = Journal(run_dir, tracker, RunStats())
                driver = Driver(config, run_dir, actors, journal, load_counters(run_dir), stop)
                driver.start()
                versions = ", ".join(driver.learning.versions.values())
                print(
                    f"training {', '.join(actors.learners)} on {config.model.name}; league {config.experiment}; "
                    f"versions {versions}",
                    flush=True,
                )
                driver.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    summary: dict[str, Any] = {
        "train_steps": driver.main_step,
        "adapter_versions": _count_versions(run_dir / "adapters"),
        "groups": driver.counters.groups,
        "run_dir": str(run_dir),
    }
    if stop.reason is not None:
        summary["stopped"] = stop.reason.replace(" ", "_")[:80]
    print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {run_dir / 'plots'}; evaluations: {run_dir / 'eval'}")
    print(f"checkpoints: {run_dir / 'checkpoints'}; adapters: {run_dir / 'adapters'}; league: {run_dir / 'league'}")
    print(" ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    summary["exit_code"] = stop.exit_code
    return summary


def _stop_on_signals(stop: Stop) -> dict[int, Any]:
    """SIGINT/SIGTERM: the first asks the run to stop and drain; the second aborts (KeyboardInterrupt).

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
        stop.request(f"signal {name}", 128 + signum)

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
