"""Nobody runs code on a cluster's nodes but its operator: every shipped config starts Ray with token
authentication, the token reaches the nodes privately, and a client without it is refused.

The head start commands run as written (tests/cluster_auth_flow.py, in namespaces of its own: only loopback,
its own process table, fresh /tmp, /opt and /home), so the test sees what a node would run. Workers: their
start commands are checked to carry the same settings; tests/test_ray_up.py joins one with them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "cluster").glob("*.yaml") if "provider" in p.read_text())
TOOLS = ("unshare", "ip", "mount", "bash")


def _config(name: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((REPO / "cluster" / name).read_text())
    return config


def _ray_starts(config: dict[str, Any]) -> list[str]:
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    return [c for c in commands if "ray start" in c]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_ray_start_of_every_config_turns_token_auth_on_from_a_private_file(name: str) -> None:
    config = _config(name)
    [(node_path, local_path)] = [(n, p) for n, p in config["file_mounts"].items() if p.endswith("ray_auth_token")]
    synced = [n for n, p in config["file_mounts"].items() if p in (".", "./")]
    assert not any(node_path.startswith(s.rstrip("/") + "/") for s in synced), "the token is outside the synced tree"
    assert not local_path.startswith("."), "the token lives outside the checkout on the operator's machine"
    starts = _ray_starts(config)
    assert len(starts) == 2
    for start in starts:
        assert re.search(r"\bRAY_AUTH_MODE=token\b", start), start
        # An explicit path: Ray aborts when it is missing instead of generating a token of the node's own.
        assert f"RAY_AUTH_TOKEN_PATH={node_path.replace('~', '$HOME', 1)}" in start, start
        assert "stat -c %a" in start and "600" in start, "a token readable by others is refused before Ray starts"


def _need_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (for the namespaces)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the token test; missing {missing}")
        pytest.skip(f"the token test needs {missing}")


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_the_shipped_head_refuses_a_client_without_the_token(name: str) -> None:
    _need_tools()
    work = Path(tempfile.mkdtemp(prefix="diprl-auth-", dir=os.environ.get("TMPDIR") or None))
    assert not str(work).startswith(("/tmp/", "/opt/", "/home/")), "the flow mounts fresh ones over those"
    try:
        out = work / "result.json"
        command = (
            f"ip link set lo up && exec {sys.executable} {REPO / 'tests' / 'cluster_auth_flow.py'} "
            f"{REPO / 'cluster' / name} {out}"
        )
        flow = subprocess.run(
            ["unshare", "--kill-child", "-m", "-n", "-p", "-f", "--mount-proc", "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert out.is_file(), flow.stderr[-3000:]
        result = json.loads(out.read_text())
        context = json.dumps(result, indent=1)[-6000:]
        assert flow.returncode == 0, context
        # The operator's client works: the head is up, and refusing the other is not just a dead head.
        assert result["token_client"]["ran"], context
        assert result["token_jobs_api"] == 200, context
        assert not result["tokenless_client"]["ran"], f"a client without the token ran code on the head:\n{context}"
        assert result["tokenless_jobs_api"] in (401, 403), context
    finally:
        shutil.rmtree(work, ignore_errors=True)
