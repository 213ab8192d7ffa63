"""What the terminal shows: library log levels, Ray's console options and progress bars.

Every command follows one rule: our progress and results on stdout, a progress bar on stderr while
something runs for more than a few seconds, and library logs (Ray, Serve, vLLM, DeepSpeed,
transformers...) at WARNING or above unless the user asks for `--verbose`. The commands used to
carry their own copies of this; one module keeps them consistent.

This module imports nothing from the rest of diprl (it sits below every package) and nothing heavy
at import time: Ray and tqdm are imported only when used.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import IO, Any

# Loggers of the libraries we start; they log at INFO by default and bury our own output.
NOISY_LOGGERS = (
    "ray",
    "ray.serve",
    "ray.data",
    "ray.train",
    "vllm",
    "deepspeed",
    "transformers",
    "peft",
    "torch",
    "filelock",
    "urllib3",
    "httpx",
    "wandb",
)

# Modules whose FutureWarnings (one library about another's API) are hidden unless verbose.
_LIBRARY_MODULES = r"(vllm|torch|transformers|peft|deepspeed|ray)(\.|$)"

# Environment variables read by the libraries (and their subprocesses) when they start: quiet values,
# then the verbose ones. Set only when the user has not set them, so an explicit choice always wins.
_QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "WANDB_SILENT": "true",
    "RAY_DEDUP_LOGS": "1",
}
_VERBOSE_ENV = {"VLLM_LOGGING_LEVEL": "INFO", "RAY_DEDUP_LOGS": "1"}  # dedup: one line per repeated message


def library_level(verbose: bool) -> int:
    """The level library loggers get: INFO with `verbose`, WARNING otherwise."""
    return logging.INFO if verbose else logging.WARNING


def quiet_libraries(verbose: bool = False) -> None:
    """Set the library loggers to WARNING (INFO with `verbose`) and the matching environment defaults.

    Call it before the libraries start and again after importing Ray Serve, which installs its own
    INFO-level logger on import. Without `verbose`, deprecation warnings (and the libraries'
    FutureWarnings about each other's APIs) are hidden too; other warnings still show.
    """
    if verbose:  # undo an earlier quiet call in this process; a value the user chose stays
        for key, value in _QUIET_ENV.items():
            if os.environ.get(key) == value:
                del os.environ[key]
    for key, value in (_VERBOSE_ENV if verbose else _QUIET_ENV).items():
        os.environ.setdefault(key, value)
    level = library_level(verbose)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if not verbose:
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*Pydantic.*")
        # API changes inside the libraries (vLLM calling a deprecated torch name): nothing a user can act on.
        warnings.filterwarnings("ignore", category=FutureWarning, module=_LIBRARY_MODULES)


def ray_init_options(verbose: bool = False) -> dict[str, Any]:
    """Keyword arguments for `ray.init` that match `verbose`.

    Without `verbose` the actors' own output (vLLM engine, Serve replicas, workers) stays in Ray's
    session log files (`/tmp/ray/session_latest/logs`, or under $TMPDIR) instead of the terminal, and
    Ray's driver logger starts at WARNING.
    """
    return {"logging_level": library_level(verbose), "log_to_driver": verbose}


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress_bar(total: int | None, desc: str = "", enabled: bool | None = None, unit: str = "it") -> Any:
    """A tqdm bar on stderr, so that stdout carries only results.

    `enabled=None` shows the bar when stderr is a terminal (not in logs, pipes or CI); True or False
    forces it. A disabled bar accepts the same calls and draws nothing. The bar disappears when
    closed (`leave=False`): the results printed after it are what stays on screen.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    show = _is_terminal(sys.stderr) if enabled is None else enabled
    return tqdm(
        total=total,
        desc=desc or None,
        unit=unit,
        file=sys.stderr,
        disable=not show,
        leave=False,
        dynamic_ncols=True,
    )


def add_console_flags(parser: Any, quiet: bool = True) -> None:
    """Add `--verbose` (library logs at INFO, actors' output on the terminal) and `--quiet` (no bar).

    `parser` is an `argparse.ArgumentParser`; `quiet=False` leaves out `--quiet` for a command that
    already has its own.
    """
    parser.add_argument(
        "--verbose", action="store_true", help="show library logs (Ray, vLLM...) at INFO and the actors' output"
    )
    if quiet:
        parser.add_argument("--quiet", action="store_true", help="no progress bar")


def bar_enabled(quiet: bool) -> bool | None:
    """`progress_bar`'s `enabled` for a command's `--quiet` flag: off when quiet, else on a terminal."""
    return False if quiet else None
