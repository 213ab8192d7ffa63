"""`python -m diprl.bench league-value --minutes M`: does the league give a stronger, less exploitable main
than self-play for the same compute? (issue 36)

    python -m diprl.bench league-value [--minutes 15] [--start pretrained|base|imitation] [--exploit-minutes E]
        [--games 14] [--exploit-games 56] [--max-year 1906] [--out DIR] [--final NAME=REF ...]
        [--exploiter NAME=REF ...] [overrides ...]

1. Train. From one start (`--start`, stated in the output): `pretrained` (the default: `model=tiny_pretrained`,
   zoo:pretrained's body, a fresh LoRA on top, RL anchored to it as in `+experiment=teacher`), `base` (the
   random-init `tiny`, from scratch) or `imitation` (the learning bench's imitation warm start on
   `tiny_wide`), the real training entry point runs `+experiment=selfplay`, `+experiment=pfsp` and
   `+experiment=league` for `--minutes` of wall clock each (the league trains its three roles within the
   same minutes: the same compute), in-run evaluations off so that the minutes go to training. Each run's
   final main (the newest version of `main` in its store) becomes `<experiment>@v1` in the bench's store.
2. Exploit. For each final main a fresh exploiter, from the same start, trains `--exploit-minutes` (default
   half of `--minutes`) against it frozen in all six seats: `+experiment=dumbbot` with that main as the
   league's one anchor (`train.frozen_adapters`), published as `exploit-<experiment>@v1`.
3. Measure, side by side in one run behind one PolicyServer, greedy, seeded (every power rotated):
   - crossplay of the three finals with `base`, DumbBot and Random: every ordered pair, the hero against
     six seats of the other, `--games` each; payoff, max-entropy Nash weights (with a bootstrap interval
     over the games) and openskill ratings (`diprl.eval.crossplay`);
   - each exploiter as hero against six seats of its main, `--exploit-games`: the share of main's seats it
     outranks (ties half) with its Wilson interval (`diprl.league.health.ExploitLedger`). Against six copies
     of itself a policy outranks half of them on average, so the exploiter's gain over the final main,
     share - 1/2, is that main's exploitability; its lower bound max(0, low - 1/2) is what the league reports.

A planted final (`--final selfplay=bot:hold`, or an adapter directory from an earlier run) skips that
training, and so does a planted exploiter (`--exploiter league=bot:dumbbot`: a fixed exploiter, or one
trained before): a quick check of the machinery, or a second look at finals already trained. Stages already done in
`--out` (their record under `stages/`) are not done again, so a stopped bench continues where it was.
Writes `<out>/league_value.json`, `crossplay.png` and `exploitability.png`. Last line:
`exploitability_selfplay=<x> exploitability_pfsp=<y> exploitability_league=<z> nash_selfplay=... nash_pfsp=...
nash_league=...`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from diprl.eval.crossplay import outrank_share
from diprl.league.health import Z95, ExploitLedger

EXPERIMENTS = ("selfplay", "pfsp", "league")
ANCHORS = ("base", "bot:dumbbot", "bot:random")
SEED = 12345
"""The training runs' evaluation seed (`evaluation.seed`), as the strength bench."""
EXPLOITER_PREFIX = "exploit-"
NASH_BOOTSTRAP = 200
"""Resamples of the crossplay's games behind each Nash weight's interval."""

QUIET_RUN = (
    "train.max_steps=100000",  # the minutes decide
    "train.wandb=false",
    "train.web_port=null",
    "train.dashboard=false",
    "inference.port=0",  # the bench's PolicyServers are reached through Serve handles: any free port, beside any run
    "evaluation.at_start=false",  # the bench measures every final itself, after training, side by side
    "evaluation.at_end=false",
    "evaluation.every_steps=0",
)
"""Every training run of the bench: its whole budget goes to training."""

WARM_RL = ("learner.lr=2e-3", "learner.kl_coef=0.3", "learner.ema_decay=1.0", "learner.adam_beta2=0.99")
"""RL from a start that already plays (`+experiment=teacher`'s settings, docs/results.md): a fifth of the
from-scratch rate, anchored by KL to the weights each learner starts from."""

EXPLOIT_OVERRIDES = ("learner.groups_per_step=8",)
"""An exploiter's match trains one seat: 16 groups in flight (2 workers x 8 matches), so a lag of 4 needs
at least 16 / 3 groups a step to keep them (`(max_policy_lag - 1) x groups_per_step >= groups in flight`)."""


@dataclass(frozen=True)
class Start:
    """Where every policy of the bench starts: the served model preset and the training overrides."""

    name: str
    model: str
    overrides: tuple[str, ...]
    what: str


def start_of(name: str, out: Path) -> Start:
    """The start `name`; `imitation` trains the learning bench's warm start into `out/imitation` once."""
    if name == "pretrained":
        return Start(name, "tiny_pretrained", ("model=tiny_pretrained", *WARM_RL),
                     "zoo:pretrained's body (model=tiny_pretrained), a fresh LoRA, RL anchored to it")  # fmt: skip
    if name == "base":
        return Start(name, "tiny", ("model=tiny", "learner.lr=1e-2", "learner.adam_beta2=0.99"),
                     "the random-init tiny body (model=tiny), a fresh LoRA: from scratch")  # fmt: skip
    if name == "imitation":
        from diprl.bench.learning import warm_start_adapter

        adapter, model = warm_start_adapter(out / "imitation")
        return Start(name, model, (f"learner.init_adapter={adapter}", f"model={model}", *WARM_RL),
                     f"the imitation warm start {adapter} on {model}, RL anchored to it")  # fmt: skip
    raise ValueError(f"unknown start {name!r}: pretrained, base or imitation")


def training_args(
    experiment: str, minutes: float, run_dir: Path, start: Start, overrides: Sequence[str] = ()
) -> list[str]:
    """The `python -m diprl.train` overrides of one main's run; the caller's `overrides` come last and win."""
    return [
        f"+experiment={experiment}",
        f"train.run_dir={run_dir}",
        f"train.max_minutes={minutes}",
        *QUIET_RUN,
        *start.overrides,
        *overrides,
    ]


def exploit_args(
    target: str, minutes: float, run_dir: Path, start: Start, frozen: Mapping[str, str], overrides: Sequence[str] = ()
) -> list[str]:
    """The overrides of an exploiter's run: main (the exploiter) against `target` in all six seats of every
    match; `frozen` (name -> adapter directory) brings an adapter target into the run's store."""
    return [
        "+experiment=dumbbot",  # one role, every match against the anchors, which are `target` alone
        f"league.anchors=[{target}]",
        *(f"+train.frozen_adapters.{name}='{path}'" for name, path in sorted(frozen.items())),
        f"train.run_dir={run_dir}",
        f"train.max_minutes={minutes}",
        *QUIET_RUN,
        *EXPLOIT_OVERRIDES,
        *start.overrides,
        *overrides,
    ]


def parse_finals(items: Sequence[str], option: str = "--final", in_crossplay: bool = True) -> dict[str, str]:
    """`--final NAME=REF` items as {experiment: a rule bot's PolicyRef, or an adapter directory}. A final plays
    in the crossplay beside the anchors, so it may not be one; planted exploiters (`option="--exploiter",
    in_crossplay=False`) may be any rule bot. `option` names the flag in the errors."""
    out = {}
    for item in items:
        name, sep, ref = item.partition("=")
        if not sep or name not in EXPERIMENTS:
            raise ValueError(f"{option} {item!r}: expected NAME=REF with NAME one of {', '.join(EXPERIMENTS)}")
        if ref.startswith("bot:"):
            if in_crossplay and ref in ANCHORS:
                raise ValueError(f"{option} {item!r}: {ref} is already in the crossplay as an anchor")
            from diprl.eval.refs import check_policy_ref

            check_policy_ref(ref)
        elif Path(ref).is_dir():
            ref = str(Path(ref).resolve())  # the exploiter's run reads it too
        else:
            raise ValueError(f"{option} {item!r}: neither bot:<name> nor an adapter directory")
        out[name] = ref
    return out


# ---------------------------------------------------------------------------------------------- figures
def exploit_outcomes(report: Mapping[str, Any]) -> list[float]:
    """Per game of a suite report, the share of the opponents' seats the hero outranks by centres (ties half)."""
    return [
        outrank_share(game["centres"], game["hero_power"], [p for p in game["seats"] if p != game["hero_power"]])
        for game in report["per_game"]
    ]


def exploitability(exploiter: str, target: str, outcomes: Sequence[float], z: float = Z95) -> dict[str, Any]:
    """The exploiter's gain over `target` from its games against it (`ExploitLedger`, Wilson interval).

    `share` is the mean share of the target's seats the exploiter outranks; six copies of the target
    would outrank half, so `exploitability` = share - 1/2 with the interval shifted alike, and
    `lower_bound` = max(0, low - 1/2), the league's lower bound on how exploitable the target is.
    """
    if not outcomes:
        raise ValueError(f"no games of {exploiter} against {target}")
    ledger = ExploitLedger()
    for outcome in outcomes:
        ledger.record(exploiter, target, float(outcome))
    (estimate,) = ledger.estimates(z)
    return {
        "exploiter": exploiter,
        "target": target,
        "games": estimate.games,
        "share": estimate.rate,
        "share_ci95": [estimate.low, estimate.high],
        "exploitability": estimate.rate - 0.5,
        "ci95": [estimate.low - 0.5, estimate.high - 0.5],
        "lower_bound": ledger.lower_bounds(z)[target]["lower_bound"],
    }


def pair_shares(reports: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """(hero, opponent) -> per-game shares of the crossplay's pair reports."""
    return {(r["policy"], r["opponents"][0]): exploit_outcomes(r) for r in reports}


def nash_intervals(
    refs: Sequence[str],
    shares: Mapping[tuple[str, str], Sequence[float]],
    n_boot: int = NASH_BOOTSTRAP,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, list[float]]:
    """Percentile-bootstrap interval of each member's max-entropy Nash weight: every ordered pair's games
    resampled on their own (seeded), the payoff rebuilt and solved again. Pairs without games read 1/2."""
    from diprl.league.nash import max_entropy_nash

    rng = np.random.default_rng(seed)
    refs = list(refs)
    data = {pair: np.asarray(values, dtype=float) for pair, values in shares.items() if len(values)}
    weights = np.empty((n_boot, len(refs)))
    for k in range(n_boot):
        matrix = np.full((len(refs), len(refs)), 0.5)
        for (a, b), values in data.items():
            matrix[refs.index(a), refs.index(b)] = values[rng.integers(0, values.size, values.size)].mean()
        weights[k] = max_entropy_nash(matrix)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(weights, [alpha, 1.0 - alpha], axis=0)
    return {r: [float(lo), float(hi)] for r, lo, hi in zip(refs, low, high, strict=True)}


def last_line(exploit: Mapping[str, Mapping[str, Any]], nash: Mapping[str, float]) -> str:
    """`exploitability_<e>=... nash_<e>=...` for the three experiments, in `EXPERIMENTS` order."""
    return " ".join(
        [f"exploitability_{e}={exploit[e]['exploitability']:.3f}" for e in EXPERIMENTS]
        + [f"nash_{e}={nash[e]:.3f}" for e in EXPERIMENTS]
    )


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """What the bench prints: the budget, each experiment's row, the crossplay, then the last line."""
    from diprl.eval.crossplay import format_crossplay

    lines = [
        f"start: {summary['start']['what']}; {summary['minutes']:g} minutes of training each, exploiters "
        f"{summary['exploit_minutes']:g}; games greedy to {summary['max_year']}, seed {SEED}",
        "| experiment | final | steps | exploiter's share of main's seats | exploitability [95%] | lower bound "
        "| Nash weight [95%] | rating mu-3s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cross = summary["crossplay"]
    for e in EXPERIMENTS:
        ex, ref = summary["exploit"][e], summary["finals"][e]
        low, high = ex["ci95"]
        nlo, nhi = summary["nash_ci95"][ref]
        steps = summary["train"][e].get("train_steps", "planted")
        lines.append(
            f"| {e} | {ref} | {steps} | {ex['share']:.3f} ({ex['games']:g} games) "
            f"| {ex['exploitability']:+.3f} [{low:+.3f}, {high:+.3f}] | {ex['lower_bound']:.3f} "
            f"| {cross['nash'][ref]:.3f} [{nlo:.3f}, {nhi:.3f}] | {cross['ratings'][ref]['ordinal']:.2f} |"
        )
    return [*lines, "", *format_crossplay(cross), "", last_line(summary["exploit"], summary["nash"])]


def plot_exploitability(summary: Mapping[str, Any], path: Path) -> Path:
    """Each final main's exploitability with its interval, and its Nash weight with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        (
            "exploitability (exploiter's share - 1/2)",
            [summary["exploit"][e]["exploitability"] for e in EXPERIMENTS],
            [summary["exploit"][e]["ci95"] for e in EXPERIMENTS],
        ),
        (
            "Nash weight in the crossplay",
            [summary["nash"][e] for e in EXPERIMENTS],
            [summary["nash_ci95"][summary["finals"][e]] for e in EXPERIMENTS],
        ),
    )
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = np.arange(len(EXPERIMENTS))
    for ax, (title, values, intervals) in zip(axes, panels, strict=True):
        mid = np.array(values, dtype=float)
        lows, highs = np.array(intervals, dtype=float).T
        errors = np.vstack([np.maximum(mid - lows, 0.0), np.maximum(highs - mid, 0.0)])
        ax.bar(x, mid, yerr=errors, capsize=4, color=["#888888", "#4878a8", "#6aa84f"])
        ax.set_xticks(x, EXPERIMENTS)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"league-value: {summary['minutes']:g} min each from {summary['start']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- stages
def _stage(out: Path, name: str, make: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """The record of stage `name` (`out/stages/<name>.json`), made by `make(*args)` unless an earlier run did."""
    from diprl.atomic_io import write_json_atomic

    path = out / "stages" / f"{name}.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    record = make(*args)
    write_json_atomic(path, record, indent=1)
    return record


def _train(args: list[str], run_dir: Path) -> dict[str, Any]:
    """One real training run (`diprl.train.run`): its figures and its final main's adapter directory."""
    from diprl.inference.adapters import AdapterStore
    from diprl.run.config import compose_config
    from diprl.train import run

    if run_dir.exists():
        raise RuntimeError(f"{run_dir} exists without its stage record: remove it, or use another --out")
    config, resolved = compose_config(args)
    started = time.perf_counter()
    summary = run(config, resolved)
    store = AdapterStore(run_dir / "adapters")
    final = store.latest("main")
    if summary.get("exit_code", 0) != 0 or final is None:
        raise RuntimeError(f"{run_dir}: the run did not finish ({summary.get('stopped', 'no version of main')})")
    return {
        "run_dir": str(run_dir),
        "wall_minutes": (time.perf_counter() - started) / 60.0,
        "train_steps": summary["train_steps"],
        "groups": summary["groups"],
        "final": str(final),
        "final_dir": str(store.resolve(str(final)).path),
        "overrides": args,
    }


def _planted(ref: str) -> dict[str, Any]:
    """The record of a final planted instead of trained: a rule bot, or an adapter directory."""
    return {"planted": ref, "final": ref} | ({} if ref.startswith("bot:") else {"final_dir": ref})


def _bench_ref(store_root: Path, name: str, record: Mapping[str, Any]) -> str:
    """The PolicyRef a stage's policy plays as in the bench: a rule bot as itself, an adapter as `<name>@v1`
    of the bench's store (published once, as a run publishes a frozen adapter)."""
    from diprl.run.frozen import publish_frozen

    if "final_dir" not in record:
        return str(record["final"])
    return publish_frozen({name: str(record["final_dir"])}, store_root)[name]


def run_bench(
    out: Path,
    minutes: float,
    exploit_minutes: float,
    start_name: str = "pretrained",
    games: int = 14,
    exploit_games: int = 56,
    max_year: int = 1906,
    planted: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
    planted_exploiters: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Every stage (see the module doc); returns the summary written to `out/league_value.json`."""
    from diprl.atomic_io import write_json_atomic
    from diprl.eval.config import EvaluateConfig, GamesConfig
    from diprl.eval.crossplay import crossplay_configs, summarize_crossplay
    from diprl.eval.plots import plot_crossplay
    from diprl.eval.suite import SuiteConfig, run_suites
    from diprl.evaluate import local_policy_client

    planted, planted_exploiters = dict(planted or {}), dict(planted_exploiters or {})
    start = start_of(start_name, out)
    store_root = out / "adapters"
    train: dict[str, dict[str, Any]] = {}
    exploit_runs: dict[str, dict[str, Any]] = {}
    finals: dict[str, str] = {}
    exploiters: dict[str, str] = {}
    for e in EXPERIMENTS:
        run_dir = out / "train" / e
        if e in planted:
            train[e] = _stage(out, f"train-{e}", _planted, planted[e])
        else:
            train[e] = _stage(out, f"train-{e}", _train, training_args(e, minutes, run_dir, start, overrides), run_dir)
        finals[e] = _bench_ref(store_root, e, train[e])
    for e in EXPERIMENTS:
        run_dir = out / "exploit" / e
        if e in planted_exploiters:
            exploit_runs[e] = _stage(out, f"exploit-{e}", _planted, planted_exploiters[e])
        else:
            # An adapter final is brought into the exploiter's run under the name it has in the bench's store.
            frozen = {e: str(train[e]["final_dir"])} if "final_dir" in train[e] else {}
            args = exploit_args(finals[e], exploit_minutes, run_dir, start, frozen, overrides)
            exploit_runs[e] = _stage(out, f"exploit-{e}", _train, args, run_dir)
        exploiters[e] = _bench_ref(store_root, f"{EXPLOITER_PREFIX}{e}", exploit_runs[e])

    play = GamesConfig(games=games, max_year=max_year, seed=SEED, temperature=0.0, critical_supports=False)
    refs = [*(finals[e] for e in EXPERIMENTS), *ANCHORS]
    cross = crossplay_configs(refs, SuiteConfig(policy=refs[0], opponents=[refs[1]], play=play))
    exploit_suites = [
        SuiteConfig(
            policy=exploiters[e],
            opponents=[finals[e]],
            play=replace(play, games=exploit_games),
            label=f"{exploiters[e]} vs 6 x {finals[e]} ({e}'s final)",
        )
        for e in EXPERIMENTS
    ]
    evaluate = EvaluateConfig(
        policy="base", served_model=start.model, adapters=str(store_root), out=str(out), temperature=0.0
    )
    started = time.perf_counter()
    with local_policy_client(evaluate) as client:
        reports = run_suites([*cross, *exploit_suites], client, progress=True)
    crossplay = summarize_crossplay(refs, reports[: len(cross)])
    exploit = {
        e: exploitability(exploiters[e], finals[e], exploit_outcomes(report))
        for e, report in zip(EXPERIMENTS, reports[len(cross) :], strict=True)
    }
    summary: dict[str, Any] = {
        "start": {"name": start.name, "model": start.model, "overrides": list(start.overrides), "what": start.what},
        "minutes": minutes,
        "exploit_minutes": exploit_minutes,
        "games": games,
        "exploit_games": exploit_games,
        "max_year": max_year,
        "seed": SEED,
        "overrides": list(overrides),
        "train": train,
        "exploit_runs": exploit_runs,
        "finals": finals,
        "exploiters": exploiters,
        "crossplay": crossplay,
        "nash": {e: crossplay["nash"][finals[e]] for e in EXPERIMENTS},
        "nash_ci95": nash_intervals(refs, pair_shares(reports[: len(cross)])),
        "exploit": exploit,
        "measure_minutes": (time.perf_counter() - started) / 60.0,
    }
    summary["plots"] = [
        str(plot_crossplay(crossplay, out / "crossplay.png")),
        str(plot_exploitability(summary, out / "exploitability.png")),
    ]
    write_json_atomic(out / "league_value.json", summary, indent=1)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench league-value", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="training minutes of each experiment's run")
    parser.add_argument(
        "--exploit-minutes", type=float, default=None, help="training minutes of each exploiter (default: half)"
    )
    parser.add_argument("--start", choices=("pretrained", "base", "imitation"), default="pretrained",
                        help="where every policy starts (default: pretrained, zoo:pretrained's body)")  # fmt: skip
    parser.add_argument("--games", type=int, default=14, help="crossplay games per ordered pair (a multiple of 7)")
    parser.add_argument("--exploit-games", type=int, default=56, help="games of each exploiter against its main")
    parser.add_argument("--max-year", type=int, default=1906, help="the measurement's games end after this year")
    parser.add_argument(
        "--final", action="append", default=[], metavar="NAME=REF",
        help="plant a final instead of training it: bot:<name> or an adapter directory (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--exploiter", action="append", default=[], metavar="NAME=REF",
        help="plant an exploiter instead of training it: bot:<name> or an adapter directory (repeatable)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(f"runs/bench-league-value-{time.strftime('%Y%m%d-%H%M%S')}"))
    parser.add_argument("overrides", nargs="*", help="training overrides for every run (Hydra syntax)")
    args = parser.parse_args(argv)
    from diprl.eval.config import check_max_year

    for name in ("games", "exploit_games"):
        if getattr(args, name) < 7 or getattr(args, name) % 7:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of 7 (every power as often)")
    try:
        check_max_year(args.max_year)
        planted = parse_finals(args.final)
        planted_exploiters = parse_finals(args.exploiter, "--exploiter", in_crossplay=False)
        for name, ref in planted_exploiters.items():
            if planted.get(name) == ref:
                raise ValueError(f"--exploiter {name}={ref}: it is {name}'s planted final itself")
    except ValueError as err:
        parser.error(str(err))
    exploit_minutes = args.minutes / 2.0 if args.exploit_minutes is None else args.exploit_minutes
    summary = run_bench(
        args.out, args.minutes, exploit_minutes, args.start, args.games, args.exploit_games, args.max_year,
        planted, args.overrides, planted_exploiters,
    )  # fmt: skip
    print("\n".join(summary_lines(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
