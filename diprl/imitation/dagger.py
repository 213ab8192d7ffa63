"""DAgger: the teacher labels the states the student reaches, and the body goes on training on them.

    python -m diprl.imitation.dagger [games=336 pretrain.init=tiny_pretrained pretrain.model=tiny_dagger ...]

Behaviour cloning is trained on the teacher's states, but the student plays its own: one wrong order
leads to a board the teacher never showed it, where it errs again, and the errors compound. DAgger
(Ross, Gordon and Bagnell, 2011) closes the gap: let the student play, ask the teacher what it would
have ordered in every state the student reached, and train on those labels too.

One round here: the student (`student`, the base of `pretrain.init` by default) plays the hero seat
against six teachers in `games` seeded games to `max_year`, served by a local PolicyServer and played in
lockstep like an evaluation suite; before each phase a teacher labeller (its own seat seed) records
what it would order in the hero's place. Those decisions, tokenised like the teacher data, join the
teacher games' training decisions (`repeats` times each, as states of their own), and pretraining
continues from the student's body (`pretrain.init`) into `pretrain.model`'s path. A game in
`heldout_every` is held out: agreement on the student's own states is reported before and after,
beside agreement on the teacher's held-out states. The games' seeds (`seed`) are not the strength
bench's (12345), so no evaluation game is trained on.

The last line is
`dagger_examples=<n> student_states_before=<x> student_states_after=<y> teacher_states_before=<a>
teacher_states_after=<b> model=<preset> path=<dir>`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from diprl.imitation.pretrain import PretrainConfig
from diprl.imitation.teacher import Decision, TeacherExample, label_decision, teacher_bot
from diprl.structured_config import Command, ConfigError, compose_structured, too_small

PROG = "python -m diprl.imitation.dagger"
SCHEMA_NAME = "dagger_schema"
REPORT = "dagger_report.json"
STRENGTH_BENCH_SEED = 12345
"""`python -m diprl.bench strength`'s games: DAgger refuses to play (and train on) them."""
GAME_BASE = 1_000_000
"""Student games are numbered from here (copy `k` of a repeated game from `(k + 1) * GAME_BASE`), so their
states never merge with the teacher games' (numbered from 0) in the batches of whole states."""


@dataclass
class DaggerConfig:
    """Everything `python -m diprl.imitation.dagger` accepts as `key=value` (`games=336`, `pretrain.lr=1e-3`)."""

    pretrain: PretrainConfig = field(
        default_factory=lambda: PretrainConfig(model="tiny_dagger", init="tiny_pretrained", epochs=1.0, lr=1e-3)
    )
    student: str = "base"  # the PolicyRef in the hero seat, served on `pretrain.init`'s preset
    teacher: str = "dumbbot"  # labels the student's states and plays the six other seats
    games: int = 336  # student games (a multiple of 7 seats the student on every power equally)
    max_year: int = 1906
    seed: int = 1
    temperature: float = 0.0  # the student's sampling temperature (0: greedy, as it is evaluated)
    heldout_every: int = 8  # game i is held out when i % heldout_every == 0 (0: none held out)
    repeats: int = 3  # copies of each student decision among the training decisions
    out: str = "runs/dagger"

    def __post_init__(self) -> None:
        teacher_bot(self.teacher)
        problems = []
        if not self.pretrain.init:
            problems.append("pretrain.init must name the preset whose body the student plays and training continues")
        if self.pretrain.init == self.pretrain.model:
            problems.append(f"pretrain.model must differ from pretrain.init ({self.pretrain.init!r}): the start stays")
        if self.seed == STRENGTH_BENCH_SEED:
            problems.append(f"seed {self.seed} is the strength bench's: its games would be trained on")
        problems += too_small(self, ("games", "repeats"), 1)
        if self.heldout_every < 0 or self.heldout_every == 1:
            problems.append(f"heldout_every must be 0 or >= 2, got {self.heldout_every}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if problems:
            raise ConfigError("dagger config: " + "; ".join(problems))


def load_dagger_config(overrides: Sequence[str], conf_dir: Path | None = None) -> DaggerConfig:
    """`conf/dagger/default.yaml` with `overrides` applied, checked (every problem a `ConfigError`)."""
    return compose_structured(DaggerConfig, SCHEMA_NAME, "dagger", overrides, conf_dir)


class StudentStates:
    """Called before each phase of a student game: the teacher's label for the hero's state, if it orders."""

    def __init__(self, teacher: str, hero: str, index: int, game_seed: int) -> None:
        from diprl.bots import make_agent
        from diprl.bots.base import seat_seed
        from diprl.game.seating import standard_powers

        # The labeller's seat seed is past the seven the game's players use, as in teacher games.
        seat = len(standard_powers()) + standard_powers().index(hero)
        self.labeller = make_agent(teacher_bot(teacher), seat_seed(game_seed, seat))
        self.hero, self.index, self.game_seed = hero, index, game_seed
        self.decisions: list[Decision] = []

    def __call__(self, game: Any) -> None:
        if self.hero in game.orderable_powers():
            self.decisions.append(label_decision(game, self.hero, self.labeller, self.index, self.game_seed, False))


def student_game(spec: Any, teacher: str) -> Generator[Any, Any, tuple[Any, list[Decision]]]:
    """One suite game (`diprl.eval.suite.play_game`) whose hero's states the teacher labels on the way."""
    from diprl.eval.suite import play_game

    labels = StudentStates(teacher, spec.hero, spec.index, spec.seed)
    played = yield from play_game(spec, before_phase=labels)
    return played, labels.decisions


def play_student_games(config: DaggerConfig, client: Any) -> list[tuple[Any, list[Decision]]]:
    """Every student game (played game, labelled hero decisions), in game order, all in lockstep."""
    from diprl.eval.config import GamesConfig
    from diprl.eval.suite import SuiteConfig, game_specs
    from diprl.messages import PolicyRef
    from diprl.rollout.lockstep import IterSource, drive

    play = GamesConfig(games=config.games, max_year=config.max_year, seed=config.seed,
                       temperature=config.temperature, critical_supports=False)  # fmt: skip
    teacher = str(PolicyRef.bot_ref(teacher_bot(config.teacher)))
    specs = game_specs(SuiteConfig(policy=config.student, opponents=[teacher], play=play))
    results: dict[int, tuple[Any, list[Decision]]] = {}

    def done(_: Any, result: tuple[Any, list[Decision]]) -> None:
        results[result[0].index] = result

    drive(IterSource(student_game(spec, config.teacher) for spec in specs), client, len(specs), done)
    return [results[spec.index] for spec in specs]


def student_examples(
    games: Sequence[tuple[Any, list[Decision]]],
    config: DaggerConfig,
    tokenizer: Any,
    table: Any,
    max_prompt_tokens: int,
    completion_order: str = "province",
) -> tuple[list[TeacherExample], list[TeacherExample]]:
    """(training, held-out) examples of the labelled decisions: game `i` renumbered `GAME_BASE + i`, held out
    when `i % heldout_every == 0`, each training one `repeats` times as states of their own."""
    from diprl.imitation.teacher import tokenize

    train: list[TeacherExample] = []
    heldout: list[TeacherExample] = []
    teacher = teacher_bot(config.teacher)
    for played, decisions in games:
        split = "heldout" if config.heldout_every and played.index % config.heldout_every == 0 else "train"
        for decision in decisions:
            example = tokenize(
                decision, split, teacher, config.student, tokenizer, table, max_prompt_tokens, completion_order
            )
            if example is None:
                continue
            if split == "heldout":
                heldout.append(replace(example, game=GAME_BASE + played.index))
            else:
                train.extend(replace(example, game=(k + 1) * GAME_BASE + played.index) for k in range(config.repeats))
    return train, heldout


def run(config: DaggerConfig, cache: Path | None = None, conf_dir: Path | None = None) -> dict[str, Any]:
    """The whole round; returns the report, also written to `<out>/dagger_report.json`."""
    from diprl.atomic_io import write_json_atomic
    from diprl.eval.config import EvaluateConfig
    from diprl.evaluate import local_policy_client, make_plan
    from diprl.imitation.pretrain import run as pretrain
    from diprl.policy.models import load_preset, pretrained_tiny_dir
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table

    init = load_preset(config.pretrain.init, conf_dir)
    if init.tiny is None or not init.path:
        raise ConfigError(f"pretrain.init={init.name!r} is not a tiny preset with a trained body (a path)")
    body = pretrained_tiny_dir(init)
    out = Path(config.out)
    evaluate = EvaluateConfig(policy=config.student, served_model=init.name, out=str(out / "student"),
                              temperature=config.temperature, games=config.games, max_year=config.max_year)  # fmt: skip
    plan = make_plan(evaluate)  # the student, its model and adapters checked before anything starts
    start = time.perf_counter()
    # A rule-bot student (a cheap stand-in, for tests) needs no server.
    serve = local_policy_client(plan.config) if plan.llm_refs else contextlib.nullcontext(None)
    with serve as client:
        games = play_student_games(config, client)
    play_s = time.perf_counter() - start
    tokenizer = load_tokenizer(body)
    table = token_table(tokenizer, init.tiny.vocab_size)
    data = config.pretrain.data
    train, heldout = student_examples(games, config, tokenizer, table, data.max_prompt_tokens, data.completion_order)
    centres = [played.hero_centres for played, _ in games]
    report = pretrain(config.pretrain, cache, conf_dir, extra_train=train, extra_heldout=heldout)
    report = {
        "student": config.student,
        "init": init.name,
        "student_games": len(games),
        "student_centres_mean": sum(centres) / len(centres),
        "student_decisions": sum(len(d) for _, d in games),
        "dagger_train_examples": len(train),
        "dagger_heldout_examples": len(heldout),
        "play_s": play_s,
        "pretrain": report,
        "config": asdict(config),
    }
    write_json_atomic(out / REPORT, report, indent=1)
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What the command prints; the last line is the one the module docstring names."""
    inner = report["pretrain"]
    nan = {"per_unit": float("nan")}  # nothing held out (heldout_every=0)
    student_before = inner.get("extra_before", nan)["per_unit"]
    student_after = inner.get("extra_after", nan)["per_unit"]
    return [
        f"student {report['student']} on {report['init']}: {report['student_games']} games vs 6 teachers, "
        f"{report['student_centres_mean']:.2f} centres, {report['student_decisions']} decisions labelled "
        f"({report['play_s']:.0f} s)",
        f"trained {inner['steps']} steps on {inner['train_examples']} teacher + {report['dagger_train_examples']} "
        f"student decisions ({inner['timings']['train_s']:.0f} s)",
        f"dagger_examples={report['dagger_train_examples']} student_states_before={student_before:.4f} "
        f"student_states_after={student_after:.4f} teacher_states_before={inner['before']['per_unit']:.4f} "
        f"teacher_states_after={inner['after']['per_unit']:.4f} model={inner['model']} path={inner['path']}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 after the run or `--help`, 2 after a bad option (said on stderr)."""
    return Command(PROG, __doc__, load_dagger_config).run(argv, lambda c: summary_lines(run(c)))


if __name__ == "__main__":
    sys.exit(main())
