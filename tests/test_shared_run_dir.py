"""One run directory for the whole cluster: a run directory some node cannot read and write is refused at start.

tests/shared_dir_flow.py makes a head and a worker node on this machine (namespaces of its own) whose worker
sees a fresh, empty filesystem under one directory, as a machine without the shared mount would: a run
directory there is refused naming the worker and what to set, a relative one is refused on a cluster, and
one both nodes see passes and is left clean. A single node checks nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from diprl.run.shared_dir import check_shared_run_dir

REPO = Path(__file__).resolve().parents[1]


def test_one_node_has_nothing_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": "a" * 56}, {"Alive": False}])
    assert check_shared_run_dir(Path("runs/relative-is-fine-alone")) == 1  # a laptop: nothing is asked of it
    assert not Path("runs/relative-is-fine-alone").exists()


@pytest.mark.slow
def test_a_run_directory_a_node_cannot_see_is_refused_with_what_to_set() -> None:
    missing = [t for t in ("unshare", "ip", "mount") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the shared run directory test; missing {missing or 'root'}")
        pytest.skip(f"needs root and {missing}")
    work = Path(tempfile.mkdtemp(prefix="diprl-fs-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        command = f"ip link set lo up && exec {sys.executable} {REPO / 'tests' / 'shared_dir_flow.py'} {work}"
        flow = subprocess.run(
            ["unshare", "--kill-child", "-n", "-p", "-f", "--mount-proc", "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            cwd=work,
        )
        logs = "".join((work / n).read_text()[-2000:] for n in ("head.log", "worker.log") if (work / n).is_file())
        assert (work / "result.json").is_file(), flow.stderr[-3000:] + logs
        result = json.loads((work / "result.json").read_text())
        context = json.dumps(result, indent=1) + flow.stderr[-2000:] + logs
        assert result.get("nodes") == 2, context
        refused = result["private"]["refused"]
        assert "cannot read the driver's probe file" in refused and "node 127.0.0.1" in refused, context
        assert "set train.run_dir to one absolute path" in refused
        assert "is relative on a cluster of 2 nodes" in result["relative"]["refused"], context
        assert result["shared"] == {"checked": 2}, context
        assert result["shared_left"] == [], "the probe leaves nothing behind"
    finally:
        shutil.rmtree(work, ignore_errors=True)
