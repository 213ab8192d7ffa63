"""A run's directory and names: a new one or a resumed one, locked for the process that owns it.

The run directory (`runs/<experiment>-<UTC time>/` by default) holds everything a resume needs. A new
run refuses a directory that holds anything; a resume refuses a directory that is not a run, one in
use by another `train` (an `flock` held for the life of the run), a configuration that differs from
the saved one in anything but `RESUME_MAY_CHANGE`, and a run where some learner has no checkpoint that
verifies. The driver's own counters (`train_state.json`) are written atomically.

A run's actors live in its own Ray namespace and its PolicyServer in its own Serve application, both
named from the run directory, so two runs on one cluster never find (or replace) each other's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from diprl.atomic_io import write_file_atomic, write_json_atomic
from diprl.run.config import Config, ConfigError, typed_config

NAMESPACE = "diprl"
SERVE_APP = "policy-server"  # prefix of a run's PolicyServer application (and deployment): its replicas' name
LOCK_FILE = ".lock"  # flock'ed by the train process that owns a run directory
COUNTERS_FILE = "train_state.json"
# Keys a resume may change: budgets, capacity and how this invocation reports or reaches its servers.
# Anything else (model, learner, league, rewards, the episode's shape, seeds) would make the continued
# run another run.
RESUME_MAY_CHANGE = frozenset(
    {
        "train.max_steps",
        "train.max_minutes",
        "train.resume",
        "train.run_dir",
        "train.progress_every_s",
        "train.wandb",
        "train.dashboard",
        "train.web_port",
        "train.ray_num_cpus",
        "train.chaos",
        "train.chaos_after_step",
        "train.plant_collapse_at_step",
        "rollout.num_workers",
        "rollout.worker_cpus",
        "rollout.matches_in_flight",
        "learner.host_parallel",  # how a host's adapters share its process; each steps the same either way
        "inference.port",
        "inference.log_level",
    }
)
# Sections a resume may change whole: where each role runs (a run may continue on another cluster).
RESUME_MAY_CHANGE_SECTIONS = ("placement",)


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


class RunDir:
    """A run directory held by this process: an exclusive `flock` on its lock file until `release`.

    The lock dies with the process (a SIGKILL releases it), so a stale one never blocks a resume,
    while a second `train` on a directory in use gets a clear error instead of two drivers writing
    one league, one set of checkpoints and one metrics file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = _open_lock(path / LOCK_FILE)
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


def _open_lock(lock: Path) -> TextIO:
    """The lock file, opened for update without following a link: the process writes its pid into it, so a
    `.lock` planted as a symlink or hard link to another file would have that file truncated and overwritten.
    A symlink, a hard link or anything but a regular file is refused (`ConfigError`) before a byte is written.
    """
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(
                f"{lock} is a symbolic link: a run's lock file must be a plain file (it is written), remove the link"
            ) from None
        raise ConfigError(f"cannot open the run's lock file {lock} ({err.strerror})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_nlink != 1:
        problem = f"has {info.st_nlink} links (a hard link to another file)"
    if problem is not None:
        os.close(fd)
        raise ConfigError(f"{lock} {problem}: a run's lock file must be a plain file of its own, remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+")


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
    write_file_atomic(path / "config.yaml", resolved_yaml.encode())
    return run_dir


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)


def _check_resume(config: Config, path: Path, saved: Path) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from diprl.learn.checkpoint import CheckpointDir
    from diprl.run_yaml import load_run_yaml, read_run_yaml_text

    try:
        previous = typed_config(load_run_yaml(read_run_yaml_text(saved), str(saved)))
    except (OmegaConfBaseException, ConfigError, ValueError, OSError) as exc:
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
            f"a resume may change only {', '.join(sorted(RESUME_MAY_CHANGE))} and anything under "
            f"{', '.join(f'{section}.' for section in RESUME_MAY_CHANGE_SECTIONS)}"
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
    a, b = _flatten(json_safe(asdict(previous))), _flatten(json_safe(asdict(current)))
    return [
        k
        for k in sorted(set(a) | set(b))
        if a.get(k, _MISSING) != b.get(k, _MISSING)
        and k not in RESUME_MAY_CHANGE
        and k.split(".", 1)[0] not in RESUME_MAY_CHANGE_SECTIONS
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
    delivered: dict[str, int] = field(default_factory=dict)  # ... of them per policy (its queue's)
    completions: int = 0  # LLM decisions the rollouts made (every seat, phase and fork)
    hero_completions: int = 0  # ... of them by the hero seat
    bad_completions: int = 0  # ... of them malformed (the game layer played defaults)
    zero_variance_skips: int = 0  # trained seats whose forks all tied: no group
    results: int = 0
    failed_matches: int = 0
    evaluations: int = 0
    minutes: float = 0.0


def load_counters(run_dir: Path) -> Counters:
    path = run_dir / COUNTERS_FILE
    if not path.is_file():
        return Counters()
    try:
        return Counters(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, RecursionError) as exc:
        raise ConfigError(f"{path} is corrupt ({exc}); delete it to restart the counters") from None


def save_counters(run_dir: Path, counters: Counters) -> None:
    write_json_atomic(run_dir / COUNTERS_FILE, asdict(counters))


def json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
