"""`ray up cluster/a100.yaml`'s command path, proven end to end on this machine over real SSH.

tests/launcher_flow.py does the work inside a network namespace with only loopback and a PID namespace of
its own (root, `unshare`): a private sshd on 127.0.0.2 (head) and 127.0.0.3 (worker), `ray up -y` on a copy
of the shipped YAML, both nodes alive, the smoke experiment as a Ray job, `ray down -y`. This test checks
what came out: the job's summary line, the run directory's checkpoints and metrics, and that nothing of
the cluster is left running.

Needs root and Debian's `openssh-server`, `rsync`, `iproute2` and `util-linux` (`make install` installs
them); CI must run it, so there a missing tool is a failure naming it, elsewhere a skip.
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

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("unshare", "ip", "ssh-keygen", "ssh", "rsync", "pkill")


def _need_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not Path("/usr/sbin/sshd").is_file():
        missing.append("/usr/sbin/sshd (openssh-server)")
    if os.geteuid() != 0:
        missing.append("root (for the namespaces and sshd)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the `ray up` test; missing {missing} (make install installs them)")
        pytest.skip(f"the `ray up` test needs {missing}")


def _summary(log: str) -> dict[str, str]:
    """The driver's last line: `key=value` pairs, one of them the run directory."""
    lines = [line for line in log.splitlines() if "run_dir=" in line and "=" in line.split()[0]]
    assert lines, f"no summary line in the job's output:\n{log[-3000:]}"
    return dict(part.split("=", 1) for part in lines[-1].split() if "=" in part)


@pytest.mark.slow
def test_ray_up_runs_the_smoke_experiment_as_a_job_on_a_head_and_a_worker() -> None:
    _need_tools()
    # Short: Ray's socket paths live under it and a Unix socket path has at most 107 bytes.
    work = Path(tempfile.mkdtemp(prefix="diprl-up-", dir="/tmp"))
    try:
        command = (
            f"ip link set lo up && exec {sys.executable} {REPO / 'tests' / 'launcher_flow.py'} "
            f"{work} {REPO / 'cluster' / 'a100.yaml'}"
        )
        flow = subprocess.run(
            ["unshare", "--kill-child", "-n", "-p", "-f", "--mount-proc", "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=1500,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        logs = {name: (work / name).read_text() for name in ("launcher.log", "job.log") if (work / name).is_file()}
        context = f"flow: {flow.stderr[-2000:]}\n" + "\n".join(f"--- {k}\n{v[-4000:]}" for k, v in logs.items())
        assert (work / "result.json").is_file(), context
        result = json.loads((work / "result.json").read_text())
        context = f"{result}\n{context}"
        assert flow.returncode == 0, context
        assert result["up"] == 0, context
        assert result["nodes"] == ["127.0.0.2", "127.0.0.3"], context
        # Both joined with the shipped start commands' token auth: a client without the token sees nothing.
        assert result["tokenless_nodes"] == [] and result["node_token_mode"] == "0o600", context
        # Ray provisions Grafana with the folder the shipped start command filled with diprl's dashboard.
        assert f"path: {work / 'grafana-dashboards'}" in result["grafana_provisioning"], context
        assert {"diprl.json", "default_grafana_dashboard.json"} <= set(result["grafana_dashboards"]), context
        assert result["job"] == 0 and "Job 'diprl-smoke' succeeded" in result["job_status"], context
        summary = _summary(logs["job.log"])
        run_dir = Path(summary["run_dir"])
        assert run_dir == work / "run"
        steps = int(summary["train_steps"])
        assert steps >= 1
        learner_steps = {
            record.get("step", record.get("learner/step"))
            for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if record["kind"] == "learner"
        }
        assert len(learner_steps) == steps, "every learner step has its metrics record"
        assert (run_dir / "checkpoints" / "main" / f"step-{steps}").is_dir()
        # The head's Prometheus (started by the shipped command) scraped the driver's learner step.
        assert result["prometheus_learner_step"] is not None, context
        assert 1 <= result["prometheus_learner_step"] <= steps
        assert result["down"] == 0 and result["head_after_down"] == [], context
        assert result["worker_stop"] == 0 and result["processes_after_down"] == [], context
    finally:
        shutil.rmtree(work, ignore_errors=True)
