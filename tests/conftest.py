"""Offline, loopback-only defaults for every test (the same values the Makefile exports).

Ray's token authentication stays on (its token lives in the diprl cache, see diprl.raysession) and
every test that needs Ray starts it through `diprl.raysession`, which pins loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from diprl.netaudit import Attempt

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_name, _value)

from diprl.raysession import prepare_environment  # noqa: E402  (after the offline defaults)

prepare_environment()  # before any test module imports Ray or vLLM

REPO = Path(__file__).resolve().parents[1]


SWEEP_READERS = ("tests/test_loopback.py", "tests/test_rollback_run.py", "tests/test_sweep.py")
"""The test files that read `smoke_sweep`: one unit of work for pytest-xdist, so that the sweep runs once."""


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist: its file, or the sweep's readers together."""
    return "smoke_sweep" if _file(nodeid) in SWEEP_READERS else _file(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How the suite splits over pytest-xdist's workers (`make test` runs two). A test file is one unit of work, run
    by one worker in file order, so its module fixtures (an engine, a Ray, a learner group) start once and its tests
    see them in the order they were written for; the files that read `smoke_sweep` are one unit, so the sweep runs
    once. Units go out in collection order (`--no-loadscope-reorder`), which puts the whole-system runs first."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FileUnits(config, log)


LONGEST_FIRST = (
    "tests/test_train.py",
    "tests/bench/test_league_value.py",
    "smoke_sweep",
    "tests/test_ray_up.py",
    "tests/test_multinode.py",
)
"""The units that took longest in the last full suite (4 to 6 minutes each), longest first. Only an order: a stale
guess costs minutes of the suite, never a result."""


@pytest.hookimpl(tryfirst=True)  # before pytest's own reordering, which keeps each module's fixtures together
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest units first, then the others that hold a `slow` test, then the rest, each file in its own order:
    under xdist the longest work starts while the other worker takes the many short files."""
    unlisted = {_file(item.nodeid) for item in items if "smoke_sweep" in getattr(item, "fixturenames", ())}
    unlisted -= set(SWEEP_READERS)
    if unlisted:
        raise pytest.UsageError(f"{sorted(unlisted)} read smoke_sweep: add them to SWEEP_READERS")
    slow = {_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> int:
        unit = _unit(item.nodeid)
        return LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST) + (unit not in slow)

    items.sort(key=rank)  # stable


@pytest.fixture(scope="session", autouse=True)
def _built_models() -> None:
    """The test session is an entry point: it builds the tiny model once, up front, as `train` and `evaluate`
    do (`diprl.policy.models.build_model`); everything the tests start only looks it up."""
    from diprl.policy.models import build_model

    build_model("tiny")


@dataclass(frozen=True)
class SmokeSweep:
    """What `smoke_sweep` ran: the sweep's directory, its exit code and output, and the connection attempts
    off loopback the network audit saw (None: not traced, the audit's tools are missing here)."""

    sweep_dir: Path
    exit_code: int
    output: str
    attempts: list[Attempt] | None


@pytest.fixture(scope="session")
def smoke_sweep(tmp_path_factory: pytest.TempPathFactory) -> SmokeSweep:
    """One sweep of the smoke experiment, run once for three test files: two points, one trained for real (the whole
    system: Ray head and dashboard, web app, PolicyServer, rollouts, learner, league, evaluator) and one refused by
    the config check (`learner.lr=-1`, exit status 2 before anything starts). The trained point is also the
    planted-collapse run: from step 2 on every evaluation of main reports no supports
    (`train.plant_collapse_at_step`), and the league's rollback guard is on. Where the network audit's tools are
    (CI), the sweep runs under the audit (`diprl.netaudit`). tests/test_loopback.py reads its trace,
    tests/test_sweep.py its points, tests/test_rollback_run.py the trained point's rollbacks. A whole-system run
    costs a Ray, a PolicyServer and a learner start: this is one where there were three."""
    from diprl import netaudit

    work = tmp_path_factory.mktemp("smoke-sweep")
    sweep_dir, output = work / "sweep", work / "output.log"
    command = [sys.executable, "-m", "diprl.train", "-m", "+experiment=smoke", "learner.lr=1e-3,-1"]
    command += ["train.max_steps=10", "train.max_minutes=15", "inference.port=0", f"train.run_dir={sweep_dir}"]
    # The planted collapse (tests/test_rollback_run.py): evaluations every 2 steps, every version kept.
    command += ["evaluation.every_steps=2", "train.plant_collapse_at_step=2", "league.health.rollback=true"]
    command += ["learner.keep_versions=0"]
    trace = None if netaudit.missing_tools() else work / "connect.trace"
    if trace is None:  # not traced: on this machine's network, so no fixed ports and no extra servers
        command += ["train.wandb=false", "train.web_port=null", "train.dashboard=false"]
        with open(output, "w") as sink:
            code = subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=1500).returncode
    else:
        code = netaudit.audit(command, trace, cwd=REPO, timeout_s=1500, output=output)
    attempts = None if trace is None else netaudit.parse_trace(trace.read_text())
    return SmokeSweep(sweep_dir, code, output.read_text(), attempts)
