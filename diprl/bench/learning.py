"""Learning benchmark: does the whole system make the policy better at Diplomacy, measured honestly?

    python -m diprl.bench learning [--minutes 30] [--compare | --only NAME...] [--temperature 0]
                                   [--out runs/bench-learning] [training overrides ...]

One configuration = one real training run (`python -m diprl.train +experiment=random`: the hero
against six Random bots, the tiny model on this machine's CPUs, local Ray, the PolicyServer, the
learner, the league) with the same fixed evaluation before and after: 56 seeded games, every power 8
times (112 from the warm start, whose gain is smaller: `WARM_START_EVAL_GAMES`; its "before" is the warm
start's own evaluation, made once before the run), 1 hero vs 6 Random, to the end of 1906, the hero greedy
(`--temperature`, default 0; at a positive temperature its samples are seeded). The gain is the mean over
those games of
(hero centres after - hero centres before), paired game by game (same seed, same power), with a
95% interval from a paired bootstrap.

Bare, it runs the default configuration (from scratch, `train_turns=fork`); `--compare` runs all
four: {from scratch, imitation warm start} x {train_turns fork, all}. Reference (hero mean centres at
the end of 1906 against 6 Random): Random 4.0, Chaos 5.7, Territorial 15.3, DumbBot 17.1.

With a warm-start configuration, `warm_start_sc=<hero centres before any RL>` and
`warm_start_gain_lo=<lower 95% bound of its gain>` come on lines of their own. Last line, for the
default configuration:
`sc_before=<x> sc_after=<y> learning_gain=<y-x> learning_gain_lo=<lower 95% bound>`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from diprl.eval.stats import paired_gain

if TYPE_CHECKING:
    from diprl.eval.config import GamesConfig

EVAL_GAMES = 56
EVAL_MAX_YEAR = 1906


@dataclass(frozen=True)
class Variant:
    name: str
    train_turns: str
    warm_start: bool


DEFAULT = Variant("scratch-fork", "fork", False)
VARIANTS = (
    DEFAULT,
    Variant("scratch-all", "all", False),
    Variant("imitation-fork", "fork", True),
    Variant("imitation-all", "all", True),
)


def chosen_variants(compare: bool, only: Sequence[str] | None = None) -> tuple[Variant, ...]:
    """The configurations to run: `only` by name (in the table's order), else all four or the default."""
    if only:
        unknown = sorted(set(only) - {v.name for v in VARIANTS})
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; known: {[v.name for v in VARIANTS]}")
        return tuple(v for v in VARIANTS if v.name in only)
    return VARIANTS if compare else (DEFAULT,)


def _hero_centres(report_path: Path, opponents: str = "bot:random") -> list[float]:
    """Per-game hero centres of one evaluation, in game-index order (the pairing key)."""
    return [float(c) for c in _suite(report_path, opponents)["hero_centres_per_game"]]


def _eval_reports(run_dir: Path, before: Path | None = None) -> tuple[Path, Path]:
    """The first and last evaluation reports of a run (the driver evaluates at its start and its end), or
    `before` and the run's last one when the starting policy was evaluated before the run."""
    from diprl.tracking import read_metrics

    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and r.get("eval/report")]
    if len(evals) < (1 if before else 2):
        what = "an evaluation at the end" if before else "evaluations at the start and the end"
        raise RuntimeError(f"{run_dir}: expected {what}, found {len(evals)}")
    return before or Path(evals[0]["eval/report"]), Path(evals[-1]["eval/report"])


def _suite(report_path: Path, opponents: str = "bot:random") -> dict[str, Any]:
    """One opponent's suite of an evaluation report: a run's evaluator writes one per opponent under
    `suites`, `python -m diprl.evaluate` its hero's suite at the top."""
    report = json.loads(report_path.read_text())
    return dict(report["suites"][opponents]) if "suites" in report else dict(report)


EVAL_TEMPERATURE = 0.0
"""Greedy: each LLM seat plays its policy's most likely orders, so an evaluation measures what the policy
has learned to prefer rather than how much sampling noise it still carries (`--temperature 1` measures
sampled play; both evaluations of a pair use the same temperature and seeds)."""


def training_args(
    variant: Variant,
    minutes: float,
    run_dir: Path,
    temperature: float = EVAL_TEMPERATURE,
    overrides: Sequence[str] = (),
) -> list[str]:
    """The `python -m diprl.train` overrides of one configuration (its warm start added by `run_variant`)."""
    return [
        "+experiment=random",
        f"train.run_dir={run_dir}",
        f"train.max_minutes={minutes}",
        "train.max_steps=100000",
        f"rollout.train_turns={variant.train_turns}",
        f"evaluation.games={EVAL_GAMES}",
        f"evaluation.max_year={EVAL_MAX_YEAR}",
        f"evaluation.temperature={temperature}",
        "evaluation.opponents=[bot:random]",
        "evaluation.every_steps=0",
        "train.wandb=false",
        *overrides,
    ]


def run_variant(
    variant: Variant, minutes: float, out: Path, overrides: Sequence[str] = (), temperature: float = EVAL_TEMPERATURE
) -> dict[str, Any]:
    from diprl.run.config import compose_config
    from diprl.train import run

    run_dir = out / variant.name
    warm: list[str] = []
    if variant.warm_start:
        adapter, model = warm_start_adapter(out / "imitation")
        warm = warm_start_overrides(adapter, model)
    config, resolved = compose_config(training_args(variant, minutes, run_dir, temperature, [*warm, *overrides]))
    evaluated_before = None
    if variant.warm_start and not config.evaluation.at_start:
        evaluated_before = warm_start_evaluation(out / "imitation", config.model.name, config.evaluation.games_config())
    start = time.perf_counter()
    summary = run(config, resolved)
    before_path, after_path = _eval_reports(run_dir, evaluated_before)
    before, after = _hero_centres(before_path), _hero_centres(after_path)
    gain = paired_gain(before, after)
    return {
        "variant": variant.name,
        "minutes": (time.perf_counter() - start) / 60,
        "train_steps": summary["train_steps"],
        "groups": summary["groups"],
        "sc_before": float(np.mean(before)),
        "sc_after": float(np.mean(after)),
        "learning_gain": gain["gain"],
        "learning_gain_lo": gain["lo"],
        "learning_gain_hi": gain["hi"],
        "eval_temperature": temperature,
        "eval_games": len(before),
        "before_report": str(before_path),
        "run_dir": str(run_dir),
    }


WARM_START_RECIPE = (
    "data.games=640",
    "data.heldout_games=24",
    "data.max_year=1906",
    "data.heldout_examples=1000",
    "epochs=1",
    "threads=2",
    "learner.model=tiny_wide",
)
"""The imitation the warm start is: one epoch over about 70,000 DumbBot decisions of 616 games (every phase
kind), the lr decaying to 0, on `tiny` with rank-32 adapters (`tiny_wide`), two torch threads; about 12
minutes here with the teacher data cached, 1.5 more to play them (docs/imitation.md)."""


def warm_start_adapter(out: Path, overrides: Sequence[str] = WARM_START_RECIPE) -> tuple[str, str]:
    """Imitation of DumbBot (once per output directory): the adapter directory the learner starts from,
    and the model preset it was trained on.

    `python -m diprl.imitation` with its defaults (`conf/imitation/default.yaml`) and `overrides`; the
    teacher data come from the cache when an earlier run made them. The imitation report names the
    trained version; without a report (none yet, or a run that stopped part-way, whose store may hold
    only the learner's untrained first version) it trains.
    """
    from diprl.imitation.config import load_imitate_config
    from diprl.imitation.run import REPORT
    from diprl.imitation.run import run as imitate
    from diprl.inference.adapters import AdapterStore

    adapters = out / "adapters"
    report_path = out / REPORT
    if not report_path.is_file():
        config = load_imitate_config(
            ["learner.policy=imitation", f"out={out}", f"adapter_root={adapters}", "quiet=true", *overrides]
        )
        imitate(config)
    report = json.loads(report_path.read_text())
    return str(AdapterStore(adapters).resolve(str(report["version"])).path), str(report["model"])


def warm_start_evaluation(out: Path, model: str, play: GamesConfig) -> Path:
    """The warm start's own evaluation (`python -m diprl.evaluate` of the imitation's version, served as
    `model`, on the games of `play`), made once per output directory and those games: its report.

    The same games a run's evaluator plays at its start (same seeds, powers, temperature and per-request
    sampling seeds; the run's step-0 version is the imitation's weights published again), so a run from
    the warm start need not evaluate it inside its training minutes (`evaluation.at_start=false`), and
    every run of one bench directory is paired with the same "before". A report made for other games is
    made again.
    """
    from diprl.eval.config import load_evaluate_config
    from diprl.evaluate import make_plan
    from diprl.evaluate import run as evaluate
    from diprl.imitation.run import REPORT

    version = str(json.loads((out / REPORT).read_text())["version"])
    wanted = {"policy": version, "opponents": ["bot:random"], "play": asdict(play)}
    where = out / f"evaluation-{play.games}-games-{play.max_year}-t{play.temperature:g}"
    report_path = where / "report.json"
    if report_path.is_file():
        made = json.loads(report_path.read_text())["config"]
        if {k: made.get(k) for k in wanted} == wanted:
            return report_path
    config = load_evaluate_config(
        [
            f"policy={version}",
            "opponents=[bot:random]",
            f"adapters={out / 'adapters'}",
            f"served_model={model}",
            f"out={where}",
            "progress=false",
            *play.overrides(),
        ]
    )
    evaluate(make_plan(config))
    return report_path


WARM_START_LR = 2e-3
"""RL from the warm start steps at a fifth of the from-scratch rate (the `random` experiment's 1e-2): Adam's
first steps move every LoRA weight by about the lr whatever its gradient, and an adapter that already plays
at twice Random's level has more to lose to such steps than a random one. With the KL anchor below, 30
minutes at 4e-3 lost 1.29 centres [-1.79, -0.80], at 2e-3 the policy held (+0.12 [-0.25, +0.52]); free, at
3e-3, it lost 0.95."""


WARM_START_WARMUP_MAX_PHASES = 16
"""RL from the warm start forks decisions anywhere in the first 16 phases (about four years), not only in
the first four as from scratch (`conf/experiment/random.yaml`). Forked early only, 30 minutes took the
warm start from 8.75 centres to 7.50 [-1.84, -0.62]: by 1902 it already held 5.3 centres (from-scratch
RL ends near 5.0 there), so the early decisions had little left to teach, while the later years, never
trained, lost what imitation had taught them (1904: 7.39 centres before, 6.68 after). Forked over 16 phases
it still lost, less: 8.75 -> 7.80 [-1.43, -0.48] in 30 minutes (docs/results.md: the warm
start's table, 2026-11-29)."""


WARM_START_KL_COEF = 0.3
"""RL from the warm start pays a KL penalty to the warm start itself (`learner.ema_decay=1.0` keeps the
reference where the learner started). Without it, 30 minutes lost 0.95 centres: GRPO spread probability away
from imitation's sharp choices (entropy 0.42 -> 0.51) and the greedy argmax eroded. Anchored at 0.3 the
entropy stayed at 0.47-0.48, the per-token KL near 0.025, and the greedy policy held: +0.12 [-0.25, +0.52]
in 43 steps at lr 2e-3 (docs/results.md, 2026-11-29). At lr 4e-3 the same penalty did not hold (-1.29)."""


RECORDS_PER_STEP = 64
"""Records a learner step trains on: the `random` experiment's 16 groups of 4 forks. A warm start with
larger groups takes fewer of them a step, so that a step costs the learner the same."""


WARM_START_GROUP_SIZE = 8
"""RL from the warm start compares eight forks of each decision, `RECORDS_PER_STEP // 8` such groups a
learner step, and plays every decision it does not train greedily
(`rollout.episode.untrained_temperature=0`: the warmup, the other seats, each fork's later turns). A
policy this good samples its own choice most of the time: four forks of one decision rarely hold a
better alternative, so a group's comparison was mostly noise; eight hold one about twice as often. And one
warmup now serves eight forks instead of four, so the same 30 minutes trained more steps (52 and 47 against
38). With four forks, four anchored runs gained +0.12 to +0.18 on the bench's 56 games, none measurably;
with eight, two runs gained +0.46 [+0.05, +0.89] and +0.39 [-0.14, +0.91] (docs/results.md, 2026-11-29)."""


WARM_START_EVAL_GAMES = 112
"""RL from the warm start is evaluated on 112 games (every power 16 times; the first 56 are the from-scratch
games, the same seeds), before and after. Its gain is a few tenths of a centre where from scratch it is
several centres, and 56 games resolve about +-0.45 around it: two runs of the eight-fork setting gained
+0.46 [+0.05, +0.89] and +0.39 [-0.14, +0.91] there. 112 games resolve about +-0.35. Chosen on 2026-11-29,
before the runs measured with it (the rows evaluated on 112 games afterwards are marked as such in
docs/results.md). The warm start's own evaluation is made before the run (`warm_start_evaluation`), not inside its
30 minutes: evaluated at the run's start, the 112 games shared the 2 cores with training for 7 minutes, and
the first run so set had taken 17 learner steps in 18 minutes where the 56-game runs had taken 30."""


def warm_start_overrides(adapter: str, model: str) -> list[str]:
    """Training overrides that start from `adapter`, on the model it was trained on (the composed config
    serves that model's LoRA rank: `diprl.run.config.typed_config`), at `WARM_START_LR`, anchored to the
    adapter by `WARM_START_KL_COEF`, forking over `WARM_START_WARMUP_MAX_PHASES` into groups of
    `WARM_START_GROUP_SIZE`, evaluated on `WARM_START_EVAL_GAMES`; the bench's own overrides come after these
    and win."""
    return [
        f"learner.init_adapter={adapter}",
        f"model={model}",
        f"learner.lr={WARM_START_LR}",
        f"learner.kl_coef={WARM_START_KL_COEF}",
        "learner.ema_decay=1.0",
        f"rollout.episode.warmup_max_phases={WARM_START_WARMUP_MAX_PHASES}",
        f"rollout.episode.group_size={WARM_START_GROUP_SIZE}",
        f"learner.groups_per_step={RECORDS_PER_STEP // WARM_START_GROUP_SIZE}",
        "rollout.episode.untrained_temperature=0",
        f"evaluation.games={WARM_START_EVAL_GAMES}",
        "evaluation.at_start=false",  # evaluated before the run instead: `warm_start_evaluation`
    ]


def warm_start_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The warm start's own lines: its strength before any RL, and the lower bound of RL's gain from it
    (the best warm-start configuration run, by that bound)."""
    warm = [r for r in rows if r["variant"].startswith("imitation")]
    if not warm:
        return []
    best = max(warm, key=lambda r: r["learning_gain_lo"])
    return [f"warm_start_sc={best['sc_before']:.3f}", f"warm_start_gain_lo={best['learning_gain_lo']:.3f}"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench learning", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes per configuration")
    parser.add_argument("--compare", action="store_true", help="run all four configurations")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[v.name for v in VARIANTS],
        help="run just these configurations (e.g. to add the ones a previous run did not measure)",
    )
    parser.add_argument(
        "--temperature", type=float, default=EVAL_TEMPERATURE, help="evaluation temperature (0: greedy, the default)"
    )
    parser.add_argument("--out", type=Path, default=Path(f"runs/bench-learning-{time.strftime('%Y%m%d-%H%M%S')}"))
    parser.add_argument("overrides", nargs="*", help="extra training overrides (Hydra syntax)")
    args = parser.parse_args(argv)
    rows = [
        run_variant(v, args.minutes, args.out, args.overrides, args.temperature)
        for v in chosen_variants(args.compare, args.only)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(rows, indent=1))
    print("| configuration | train steps | groups | centres before | centres after | gain [95% CI] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['train_steps']} | {r['groups']} | {r['sc_before']:.2f} | {r['sc_after']:.2f} "
            f"| {r['learning_gain']:+.2f} [{r['learning_gain_lo']:+.2f}, {r['learning_gain_hi']:+.2f}] |"
        )
    for line in warm_start_lines(rows):
        print(line)
    d = next((r for r in rows if r["variant"] == DEFAULT.name), rows[0])
    if d["variant"] != DEFAULT.name:
        print(f"(the default configuration was not run; the last line is {d['variant']})")
    print(
        f"sc_before={d['sc_before']:.3f} sc_after={d['sc_after']:.3f} "
        f"learning_gain={d['learning_gain']:.3f} learning_gain_lo={d['learning_gain_lo']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
