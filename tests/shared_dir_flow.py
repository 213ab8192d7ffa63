"""A two-node Ray cluster on one machine whose worker does not share the run directory's filesystem.

    unshare --kill-child -n -p -f --mount-proc sh -c 'ip link set lo up && exec python tests/shared_dir_flow.py WORK'

Run by tests/test_shared_run_dir.py: only loopback, its own process table (this script is PID 1: the nodes
end with it). The head starts as usual; the worker node starts in a mount namespace of its own with a fresh
tmpfs over WORK/private, so a directory there is a different, empty one for every process of that node, as
on a machine without the shared filesystem. WORK/shared is the same for both, as an NFS mount would be.
The driver then asks `check_shared_run_dir` about a run directory in each. What happened goes to
WORK/result.json.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GCS = "127.0.0.1:26379"
HEAD = [
    "--head", f"--port={GCS.split(':')[1]}", "--include-dashboard=false", "--node-manager-port=26401",
    "--object-manager-port=26402", "--metrics-export-port=26403", "--dashboard-agent-listen-port=26404",
    "--dashboard-agent-grpc-port=26405", "--runtime-env-agent-port=26406", "--min-worker-port=26500",
    "--max-worker-port=26599", "--ray-client-server-port=26407",
]  # fmt: skip
WORKER = [
    f"--address={GCS}", "--node-manager-port=27401", "--object-manager-port=27402", "--metrics-export-port=27403",
    "--dashboard-agent-listen-port=27404", "--dashboard-agent-grpc-port=27405", "--runtime-env-agent-port=27406",
    "--min-worker-port=27500", "--max-worker-port=27599",
]  # fmt: skip


def start_node(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`ray start --block`, again when it gave up: a node waits only 30 s for its raylet, which a loaded
    2-core machine can miss."""
    for _attempt in range(3):
        with log.open("ab") as out:
            node = subprocess.Popen(command, env=env, stdout=out, stderr=out)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and node.poll() is None:
            if b"Ray runtime started" in log.read_bytes():
                return node
            time.sleep(1)
        node.kill()
        node.wait()
        # What it left of itself (its processes name its temp dir; this PID namespace holds no other Ray).
        scope = next(word.split("=", 1)[1] for word in " ".join(command).split() if word.startswith("--temp-dir="))
        subprocess.run(["pkill", "-KILL", "-f", scope], check=False)
        time.sleep(2)
    raise RuntimeError(f"the node did not start; see {log}")


def main(work: Path) -> int:
    ray_bin = str(Path(sys.executable).parent / "ray")
    home = work / "home"
    home.mkdir()
    (home / "ray_bootstrap_config.yaml").write_text("{}")  # no cloud-metadata probe from the dashboard
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    (work / "private").mkdir()
    (work / "shared").mkdir()
    env = dict(
        os.environ,
        HOME=str(home),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_agent_register_timeout_ms="120000",
    )
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    head = start_node([ray_bin, "start", *HEAD, *common, f"--temp-dir={work / 'rh'}"], env, work / "head.log")
    worker_start = " ".join([ray_bin, "start", *WORKER, *common, f"--temp-dir={work / 'rw'}"])
    worker = start_node(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {work / 'private'} && exec {worker_start}"],
        dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1"),  # a worker's `ray start --address` aborts without it
        work / "worker.log",
    )
    result: dict[str, Any] = {}
    try:
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))  # Ray reads it at import
        import ray

        from diprl.run.shared_dir import check_shared_run_dir
        from diprl.structured_config import ConfigError

        ray.init(address=GCS, log_to_driver=False)
        deadline = time.monotonic() + 240
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(2)
        result["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        for name, run_dir in (
            ("private", work / "private" / "run"),
            ("relative", Path("runs/x")),
            ("shared", work / "shared" / "run"),
        ):
            try:
                result[name] = {"checked": check_shared_run_dir(run_dir)}
            except ConfigError as exc:
                result[name] = {"refused": str(exc)}
        result["shared_left"] = sorted(p.name for p in (work / "shared" / "run").iterdir())
        ray.shutdown()
    finally:
        for process in (worker, head):
            process.terminate()
        for process in (worker, head):
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        (work / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
