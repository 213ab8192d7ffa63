"""The run's actors and what they run beside: the run directory made ready for them, the PolicyServer's
config, every other actor created (or found again on a resume) and placed by resources, the web app, and
how Ray is started or joined.

`diprl.train` composes the configuration and hands these to the driver; nothing here decides anything
during the run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_file_atomic
from diprl.console import ray_init_options
from diprl.inference.adapters import pins
from diprl.inference.adapters.pins import PinKey
from diprl.learn.site import LearnerSite
from diprl.run.config import Config, ConfigError
from diprl.run.driver import Actors
from diprl.run.frozen import publish_frozen
from diprl.run.provenance import write_provenance
from diprl.run.rundir import NAMESPACE, serve_app_name
from diprl.run.shared_dir import check_shared_run_dir

LEDGER = "group-ledger"  # the GroupLedger actor; rollout workers look it up by this name


def queue_name(policy: str) -> str:
    return f"queue-{policy}"


def server_config(config: Config, run_dir: Path, verbose: bool = False) -> Any:
    """The run's PolicyServer: its own Serve app and route, serving the run's adapter store."""
    serve_app = serve_app_name(run_dir)
    return replace(
        config.inference,
        adapter_root=str((run_dir / "adapters").resolve()),
        name=serve_app,
        route_prefix=f"/{serve_app}",
        log_level="INFO" if verbose else config.inference.log_level,  # the replicas' vLLM and Serve logs
    )


PIN_KEY_ID = "pin_key.id"  # in the run directory: which key pinned its versions (a digest, never the key)


def run_pin_key(run_dir: Path | None = None) -> PinKey:
    """The run's adapter pin key: this (the driver's) machine's, read or made once; it installs nothing
    (`ready_run_dir` installs it in the driver's process for the run's length). The driver hands it
    to every actor that publishes or checks versions (learners, their ranks and hosts, PolicyServer
    replicas), so on a cluster no other node needs a key file. It travels in those actors' constructor
    arguments, inside Ray, and is never written into the run directory, a config or a log.

    With `run_dir`, the run remembers which key it started with (`pin_key.id`, a one-way digest): a run
    resumed under another key (another machine's, or a job whose working directory held the first) would
    refuse every version it published, an hour later in a learner; it is refused here, saying what to set.
    """
    key = pins.load_key()
    if run_dir is not None:
        marker = Path(run_dir) / PIN_KEY_ID
        if marker.exists():
            if marker.read_text().strip() != key.digest():
                raise ConfigError(
                    f"{run_dir} was started under another adapter pin key than this machine's ({pins.key_path()}): "
                    f"its versions would all be refused. Resume it with {pins.KEY_ENV} pointing at the key it "
                    "started with (docs/cluster.md)"
                )
        else:
            write_file_atomic(marker, (key.digest() + "\n").encode())
    return key


@contextlib.contextmanager
def ready_run_dir(config: Config, run_dir: Path) -> Iterator[PinKey]:
    """What the run directory must be and hold before any actor starts: seen by every node (on several,
    refused now rather than by a learner later), the code's provenance, the run's pin key (yielded: every
    actor that publishes or checks versions is handed it) and the frozen adapters it may be asked to serve.

    The key is installed in the driver's own process while the block runs (it publishes the frozen adapters
    and its web app reads versions); the key installed before, or none, is back when the run ends."""
    check_shared_run_dir(run_dir)
    write_provenance(run_dir)
    with pins.key_installed(run_pin_key(run_dir)) as pin_key:
        publish_frozen(config.train.frozen_adapters, run_dir / "adapters")
        yield pin_key


def start_actors(config: Config, run_dir: Path, pin_key: PinKey | None = None) -> Actors:
    """Create (or, on a resumed run, find) every actor of the run but the PolicyServer, placed by resources:
    their CPUs and GPUs, and the custom resources `config.placement` names for their role. `pin_key`
    (`run_pin_key`) goes to the learners; the league, ledger, queues, rollout workers and evaluator never
    open the adapter store, so they are not given it."""
    import ray
    from ray.util.queue import Queue

    from diprl.eval.evaluator import EvaluatorConfig, start_evaluator
    from diprl.league.manager import league_actor
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
    learners = start_learners(config, policies, LearnerSite(str(run_dir), str(adapter_root), pin_key=pin_key))
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


def start_learners(config: Config, policies: list[str], site: LearnerSite) -> dict[str, Any]:
    """A learner handle per policy: its own actor, or with `learner.adapters_per_actor` > 1 its place on a host
    actor that trains that many policies on one base (`diprl.learn.host`), in the order the league names them."""
    from diprl.learn.actor import HostedLearner, learner_actor, learner_host_actor

    where = config.placement
    per_actor = config.learner.adapters_per_actor
    if per_actor == 1:
        return {
            p: learner_actor(
                replace(config.learner, policy=p),
                site,
                name=f"learner-{p}",
                queue=queue_name(p),
                resources=where.learner,
            )
            for p in policies
        }
    learners: dict[str, Any] = {}
    for start in range(0, len(policies), per_actor):
        hosted = policies[start : start + per_actor]
        host = learner_host_actor(
            [replace(config.learner, policy=p) for p in hosted],
            site,
            queues={p: queue_name(p) for p in hosted},
            resources=where.learner,
        )
        learners.update({p: HostedLearner(host, p) for p in hosted})
    return learners


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
