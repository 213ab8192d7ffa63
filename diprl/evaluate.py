"""Evaluate a policy on the fixed benchmark suite: `python -m diprl.evaluate policy=<ref> [key=value ...]`.

    python -m diprl.evaluate policy=main@v12 opponents=bot:dumbbot games=140 max_year=1935 out=runs/eval/v12
    python -m diprl.evaluate policy=bot:dumbbot opponents=bot:random games=70 replays=2 out=runs/eval/ladder
    python -m diprl.evaluate policy=base opponents=[bot:dumbbot,bot:random] adapters=runs/adapters
    python -m diprl.evaluate policy=main@v12 crossplay=[main@v12,main@v6,base,bot:dumbbot] games=70

The hero (`policy`) plays against `opponents` in the other six seats, the seven powers rotated,
in seeded games (see `diprl.eval.suite`). Any PolicyRef may sit anywhere: `bot:<name>`, `base`,
`<policy>@v<N>` (published under `adapters=`), and `<policy>@best`: the version a training run's league
found best and marked in its adapters (`adapters=runs/<run>/adapters`). When a seat needs the LLM, a local
Ray (loopback) and the PolicyServer (`server=local`, conf/inference/local.yaml) are started for the run; a
bots-only run starts nothing. Options are checked before anything starts: an unknown key, a bad
value or an unknown PolicyRef is an error (exit status 2). A run whose hero got only errors from the
PolicyServer (its units held all game) keeps its report but exits with status 1.

Writes `report.json` and PNG plots to `out` (replays under `out/replays/` with `replays=N`, each crossplay
pair's under `out/crossplay_replays/<hero>_vs_<opponent>/` with `crossplay_replays=N`),
prints the report, and ends with the line `hero_solo_rate=<x> hero_mean_sc=<y>`. A progress bar
goes to stderr when it is a terminal (`progress=false`: none); library logs stay at WARNING unless
`verbose=true` (see `diprl.console`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diprl.console import quiet_libraries, ray_init_options
from diprl.eval.config import EvaluateConfig, load_evaluate_config, option_help
from diprl.eval.refs import check_published, is_llm, zoo_model
from diprl.eval.report import check_writable
from diprl.eval.suite import SuiteConfig
from diprl.inference.adapters import AdapterStore, IncompatibleAdapter
from diprl.messages import PolicyRef
from diprl.rollout.clients import PolicyClient
from diprl.structured_config import Command

if TYPE_CHECKING:
    from diprl.inference.config import ServerConfig

PROG = "python -m diprl.evaluate"
CROSSPLAY_REPLAYS = "crossplay_replays"  # under `out`: one folder a pair, `<hero>_vs_<opponent>/game0000/`


@dataclass
class Plan:
    """What a run will do, fully checked: the main suite and the crossplay suites, if any."""

    config: EvaluateConfig
    suite: SuiteConfig
    crossplay: list[SuiteConfig] = field(default_factory=list)

    @property
    def suites(self) -> list[SuiteConfig]:
        return [self.suite, *self.crossplay]

    @property
    def llm_refs(self) -> list[str]:
        return sorted({r for s in self.suites for r in s.refs if is_llm(r)})


def make_plan(config: EvaluateConfig, have_client: bool = False) -> Plan:
    """Check every option and build the suites; raises ValueError/OSError naming what is wrong."""
    if not config.policy:
        raise ValueError("policy=<ref> is required (bot:<name>, base, or <policy>@v<N>)")
    named = AdapterStore(config.adapters).resolve_alias  # `main@best` -> the version the run marked, first
    opponents = config.opponents
    opponents = named(opponents) if isinstance(opponents, str) else [named(str(o)) for o in opponents]
    config = replace(
        config, policy=named(config.policy), opponents=opponents, crossplay=[named(r) for r in config.crossplay]
    )
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out} exists and is not a directory")
    check_writable(out / "report.json")
    if config.crossplay_games < 0:
        raise ValueError(f"crossplay_games must be >= 0, got {config.crossplay_games}")
    suite = SuiteConfig(
        policy=config.policy,
        opponents=config.opponents,
        play=config,
        workers=config.workers,
        replay_dir=str(out / "replays") if config.replays else None,
    )
    plan = Plan(config, suite)
    if config.crossplay_replays and not config.crossplay:
        raise ValueError("crossplay_replays=N needs crossplay=[refA,refB,...]: there are no pairs to keep replays of")
    if config.crossplay:
        from diprl.eval.crossplay import crossplay_configs

        games = config.crossplay_games or config.games
        if not 0 <= config.crossplay_replays <= games:
            raise ValueError(f"crossplay_replays must be between 0 and the crossplay games ({games}), got "
                             f"{config.crossplay_replays}")  # fmt: skip
        template = replace(suite, play=replace(suite.play, games=games, replays=0), replay_dir=None)
        plan.crossplay = crossplay_configs(
            config.crossplay, template, config.crossplay_replays, out / CROSSPLAY_REPLAYS
        )
    zoo = zoo_model(plan.llm_refs)
    if zoo is not None and not config.served_model:
        plan.config = config = replace(config, served_model=zoo)  # a zoo entry is served on its own model
    elif zoo is not None and zoo != config.served_model:
        raise ValueError(f"served_model={config.served_model} but the zoo entries play on {zoo!r}")
    if plan.llm_refs and not have_client:
        try:
            server = server_config(config)
        except KeyError as exc:
            raise ValueError(str(exc).strip("'\"")) from None
        adapters = [r for r in plan.llm_refs if PolicyRef.parse(r).is_adapter]
        try:
            check_published(adapters, config.adapters, server.max_lora_rank)
        except IncompatibleAdapter as exc:
            # Checked before play: a suite whose hero only gets errors from the server plays holds to the end.
            raise ValueError(
                f"{exc}: the PolicyServer ({config.server}) serves model {server.model!r}; pass served_model=<the "
                "preset the adapter was trained on> (e.g. served_model=tiny_wide for rank 32)"
            ) from None
    return plan


def server_config(config: EvaluateConfig) -> ServerConfig:
    """The PolicyServer's config: `config.server`'s file serving `config.served_model` (when given), over
    `config.adapters`."""
    from diprl.inference.config import load_server_config, with_preset_lora_rank
    from diprl.policy.models import known_presets

    server = load_server_config(config.server)
    if config.served_model:
        if config.served_model not in known_presets():
            raise ValueError(
                f"served_model={config.served_model!r} is not a model preset (conf/model/): {sorted(known_presets())}"
            )
        server = with_preset_lora_rank(replace(server, model=config.served_model))
    return replace(server, adapter_root=str(Path(config.adapters).resolve()))


@contextlib.contextmanager
def local_policy_client(config: EvaluateConfig) -> Iterator[PolicyClient]:
    """A local Ray (loopback) with the PolicyServer serving `config.adapters`, torn down afterwards."""
    from diprl.inference.deploy import serving
    from diprl.policy.models import build_model
    from diprl.raysession import ray_session
    from diprl.rollout.clients import ServeClient

    quiet_libraries(config.verbose)  # again: importing Ray Serve installs its own INFO-level logger
    # The command reaches its server through Serve handles, never its HTTP route: any free port will do, so
    # an evaluation runs beside a training run's server (which holds the configured port).
    server = replace(server_config(config), port=0)
    build_model(server.model)  # once, up front: the replicas only look it up
    if config.verbose:
        server = replace(server, log_level="INFO")  # the replicas' vLLM and Serve logs too
    with ray_session(address="local", num_cpus=config.ray_cpus or None, **ray_init_options(config.verbose)):
        print(f"starting the PolicyServer ({config.server}, adapters {server.adapter_root})", file=sys.stderr)
        with serving(server):
            yield ServeClient(app_name=server.name, deployment=server.name, max_batch=server.max_batch)


def run(plan: Plan, client: PolicyClient | None = None) -> dict[str, Any]:
    """Play the plan's suites in one lockstep run; write report.json and plots; return the report."""
    from diprl.atomic_io import write_json_atomic
    from diprl.eval.plots import write_plots
    from diprl.eval.suite import run_suites

    config = plan.config
    context: contextlib.AbstractContextManager[PolicyClient | None] = (
        local_policy_client(config) if plan.llm_refs and client is None else contextlib.nullcontext(client)
    )
    with context as active:
        reports = run_suites(plan.suites, active, progress=config.progress)
    report = dict(reports[0])
    crossplay = None
    if plan.crossplay:
        from diprl.eval.crossplay import summarize_crossplay

        crossplay = summarize_crossplay(config.crossplay, reports[1:])
        report["crossplay"] = crossplay
    out = Path(config.out)
    write_json_atomic(out / "report.json", report, indent=1)
    report["plots"] = [str(p) for p in write_plots([reports[0]], out, crossplay)]
    if config.replays:
        report["replays"] = sorted(str(p) for p in (out / "replays").glob("*/index.html"))
    if plan.crossplay and config.crossplay_replays:
        report["crossplay_replays"] = sorted(str(p) for p in (out / CROSSPLAY_REPLAYS).glob("*/*/index.html"))
    return report


def main(argv: Sequence[str] | None = None, client: PolicyClient | None = None) -> int:
    """Entry point; `client` replaces the local PolicyServer (tests, callers inside a Ray cluster)."""
    have_client = client is not None
    command = Command(PROG, __doc__, lambda args: make_plan(load_evaluate_config(args), have_client), option_help)
    plan = command.read(argv)
    if isinstance(plan, int):
        return plan
    quiet_libraries(plan.config.verbose)
    from diprl.eval.report import format_suite, summary_line, unmeasured_hero

    report = run(plan, client)
    lines = format_suite(report)
    if "crossplay" in report:
        from diprl.eval.crossplay import format_crossplay

        lines += ["", *format_crossplay(report["crossplay"])]
    lines += ["", f"report: {Path(plan.config.out) / 'report.json'}; plots: {', '.join(report['plots'])}"]
    for key, what in (("replays", "replays"), ("crossplay_replays", "crossplay replays")):
        if report.get(key):
            lines.append(f"{what} (open in a browser): {', '.join(report[key])}")
    print("\n".join(lines))
    print(summary_line(report))
    problem = unmeasured_hero(report)
    if problem:
        print(f"error: {problem}; report kept in {plan.config.out}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
