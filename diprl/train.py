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

import sys
from collections.abc import Sequence
from typing import Any

from diprl.console import quiet_libraries
from diprl.policy.models import build_model
from diprl.run.actors import ray_options, ready_run_dir, server_config, start_actors, web_app
from diprl.run.config import CONF_DIR, Config, ConfigError, compose_config
from diprl.run.driver import Driver, Stop, stop_on_signals
from diprl.run.rundir import prepare_run_dir, run_namespace


def run(config: Config, resolved_yaml: str, verbose: bool = False) -> dict[str, Any]:
    """One training run (or its continuation); returns the final summary printed on the last line.

    The summary's `stopped` says why a run ended before its budget (a signal, a failed actor) and
    `exit_code` what `main` returns: 0 at the budget, 1 after a failure, 128 + the signal's number.
    """
    from diprl.inference.deploy import deploying
    from diprl.raysession import ray_session

    quiet_libraries(verbose)
    stop = Stop()
    with (
        prepare_run_dir(config, resolved_yaml) as held,
        ray_session(**ray_options(config, verbose, namespace=run_namespace(held.path))) as info,
        # seen by every node, provenance, frozen adapters; the pin key, installed here until the run ends
        ready_run_dir(config, held.path) as pin_key,
    ):
        run_dir = held.path
        print(f"run directory: {run_dir}", flush=True)
        if hint := info.dashboard_hint():
            print(hint, flush=True)
        with stop_on_signals(stop):
            quiet_libraries(verbose)  # Serve configures its own driver-side logger on import: quiet it again
            server = server_config(config, run_dir, verbose)
            for model in (config.model, server.model):  # built once, here: actors and replicas look them up
                build_model(model)
            with deploying(server, config.placement.inference, pin_key) as deployment, web_app(config, run_dir):
                actors = start_actors(config, run_dir, pin_key)  # while the PolicyServer's replicas start
                deployment.result()  # up before any match or evaluation is asked of it
                driver = Driver.for_run(config, run_dir, actors, stop)
                driver.start()
                versions = ", ".join(driver.learning.versions.values())
                print(
                    f"training {', '.join(actors.learners)} on {config.model.name}; league {config.experiment}; "
                    f"versions {versions}",
                    flush=True,
                )
                driver.run()
    summary = driver.summary()
    print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {run_dir / 'plots'}; evaluations: {run_dir / 'eval'}")
    print(f"checkpoints: {run_dir / 'checkpoints'}; adapters: {run_dir / 'adapters'}; league: {run_dir / 'league'}")
    print(" ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    summary["exit_code"] = stop.exit_code
    return summary


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
    if any(a in ("-m", "--multirun") for a in args):  # a sweep: every point a run of its own (diprl.sweep)
        from diprl.sweep import run_sweep

        return run_sweep(args)
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
