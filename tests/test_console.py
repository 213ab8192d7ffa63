"""What the terminal shows: library log levels, Ray's console options, progress bars, and `--verbose` on every
command (checked through each command's own parser, so a command that drops the flag fails here)."""

from __future__ import annotations

import ast
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from diprl import console


@pytest.fixture
def restore_loggers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Library logger levels, the environment variables and warning filters as they were before the test."""
    levels = {name: logging.getLogger(name).level for name in console.NOISY_LOGGERS}
    for key in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "WANDB_SILENT"):
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings():
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_quiet_sets_library_loggers_to_warning_and_verbose_restores_info(restore_loggers: None) -> None:
    import os

    console.quiet_libraries(verbose=False)
    assert {logging.getLogger(n).level for n in console.NOISY_LOGGERS} == {logging.WARNING}
    assert not logging.getLogger("ray.serve").isEnabledFor(logging.INFO)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"

    console.quiet_libraries(verbose=True)  # e.g. a second call after `--verbose` was parsed
    assert {logging.getLogger(n).level for n in console.NOISY_LOGGERS} == {logging.INFO}
    assert logging.getLogger("vllm").isEnabledFor(logging.INFO)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "TRANSFORMERS_VERBOSITY" not in os.environ  # back to the library's own default


def test_a_level_the_user_chose_is_kept(restore_loggers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    console.quiet_libraries(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    console.quiet_libraries(verbose=True)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"


def test_quiet_hides_library_future_warnings_but_not_ours(restore_loggers: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_libraries(verbose=False)  # its filters go on top of "always"
        warnings.warn_explicit("reduce_op is deprecated", FutureWarning, "dispatcher.py", 1, module="vllm.triton")
        warnings.warn_explicit("our own", FutureWarning, "suite.py", 1, module="diprl.eval.suite")
        warnings.warn_explicit("a user-facing problem", UserWarning, "x.py", 1, module="vllm.x")
    assert sorted(str(w.message) for w in caught) == ["a user-facing problem", "our own"]


def test_ray_keeps_actor_output_off_the_terminal_unless_verbose() -> None:
    assert console.ray_init_options(False) == {"logging_level": logging.WARNING, "log_to_driver": False}
    assert console.ray_init_options(True) == {"logging_level": logging.INFO, "log_to_driver": True}


def test_progress_bar_draws_on_stderr_only_when_enabled(capsys: pytest.CaptureFixture[str]) -> None:
    with console.progress_bar(3, "games", enabled=None, unit="game") as bar:  # stderr is captured: no terminal
        bar.update(3)
    assert capsys.readouterr() == ("", "")
    with console.progress_bar(3, "games", enabled=True, unit="game") as bar:
        bar.update(3)
    out, err = capsys.readouterr()
    assert out == ""
    assert "games" in err and "/3" in err
    assert console.bar_enabled(quiet=True) is False and console.bar_enabled(quiet=False) is None


def test_console_module_imports_nothing_from_the_rest_of_diprl() -> None:
    tree = ast.parse(Path(console.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "diprl"}


BENCHMARKS_WITH_FLAGS = ("engine", "constraint", "inference", "rollout", "learner", "league", "preload")


@pytest.mark.parametrize("name", BENCHMARKS_WITH_FLAGS)
def test_every_benchmark_takes_verbose_and_quiet(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from diprl.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--verbose" in help_text and "--quiet" in help_text


def test_arena_and_ladder_take_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    from diprl import arena
    from diprl.eval import ladder

    args = arena.build_parser().parse_args(["--hero", "random", "--opponents", "random", "--verbose"])
    assert args.verbose and not args.quiet
    with pytest.raises(SystemExit) as exc:
        ladder.main(["--help"])
    assert exc.value.code == 0
    assert "--verbose" in capsys.readouterr().out


def test_imitation_takes_verbose_as_a_key() -> None:
    from diprl.imitation.config import load_imitate_config

    assert load_imitate_config(["verbose=true"]).verbose is True
    assert load_imitate_config([]).verbose is False
