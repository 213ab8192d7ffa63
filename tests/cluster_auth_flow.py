"""A shipped cluster config's head start commands, run as written, and clients with and without its token.

    unshare --kill-child -m -n -p -f --mount-proc \
        sh -c 'ip link set lo up && exec python tests/cluster_auth_flow.py YAML OUT'

Run by tests/test_cluster_auth.py in namespaces of its own: a network with only loopback (the shipped ports,
6379 and 8265, are free there whatever runs on the machine), a PID namespace (the commands' `ray stop` sees
only this head) and a mount namespace with fresh `/tmp`, `/opt` and `/home`, so that the paths the commands
name (`/opt/diprl`, `~/ray_bootstrap_config.yaml`, the token's path on a node) exist without touching the
machine's own. The checkout is bound at `/opt/diprl` (where the image installs it) and the token is put
where the config's `file_mounts` put it on a node, mode 0600, as `ray up` would. What happened goes to OUT
as JSON.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

HOME = Path("/home/ubuntu")  # the cloud variant's account; the commands name only `~`
DASHBOARD = "http://127.0.0.1:8265"
CLIENT = """
import ray
ray.init(address="127.0.0.1:6379", log_to_driver=False)
import subprocess
whoami = ray.remote(lambda: subprocess.run(["id", "-un"], capture_output=True, text=True).stdout)
print("ran:", ray.get(whoami.remote()))
"""


def token_mount(config: dict[str, Any]) -> str | None:
    """Where the config's file_mounts put the cluster's Ray token on a node (None: it ships none)."""
    for node_path, local_path in config.get("file_mounts", {}).items():
        if Path(local_path).name == "ray_auth_token":
            return str(node_path).replace("~", str(HOME), 1)
    return None


def prepare_node(repo: Path, token_path: str | None) -> str:
    for mount in ("/tmp", "/opt", "/home"):
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", mount], check=True)
    Path("/opt/diprl").mkdir()
    subprocess.run(["mount", "--bind", str(repo), "/opt/diprl"], check=True)
    HOME.mkdir(parents=True)
    (HOME / "venv").symlink_to(Path(sys.executable).parents[1])  # the cloud variant's ~/venv
    (HOME / "ray_bootstrap_config.yaml").write_text("{}")  # `ray up` writes it; its head reads it
    token = secrets.token_hex(32)
    if token_path:
        path = Path(token_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
        path.chmod(0o600)
    return token


def run_client(env: dict[str, str]) -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, env=env, timeout=90)
    except subprocess.TimeoutExpired:
        return {"rc": 124, "ran": False, "output": "timed out"}
    return {"rc": done.returncode, "ran": "ran:" in done.stdout, "output": (done.stdout + done.stderr)[-1500:]}


def jobs_api(token: str | None) -> int:
    request = urllib.request.Request(f"{DASHBOARD}/api/jobs/")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return -1


def main(shipped: Path, out: Path) -> int:
    repo = Path(__file__).resolve().parents[1]
    config: dict[str, Any] = yaml.safe_load(shipped.read_text())
    token_path = token_mount(config)
    result: dict[str, Any] = {"token_path": token_path}
    try:
        token = prepare_node(repo, token_path)
        venv_bin = str(Path(sys.executable).parent)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        node_env = dict(clean, HOME=str(HOME), TMPDIR="/tmp", PATH=f"{venv_bin}:{clean['PATH']}")
        result["commands"] = []
        for i, command in enumerate(config["head_start_ray_commands"]):
            log = Path(f"/tmp/command-{i}.log")  # a file, not a pipe: a command may leave a daemon behind
            with log.open("w") as sink:
                rc = subprocess.run(["bash", "-c", command], stdout=sink, stderr=sink, env=node_env, timeout=240)
            result["commands"].append({"rc": rc.returncode, "output": log.read_text()[-1500:]})
        deadline = time.monotonic() + 120
        while jobs_api(token) == -1 and time.monotonic() < deadline:
            time.sleep(2)
        # A client as anyone on the network would be: no token anywhere, nothing telling it to send one.
        result["tokenless_client"] = run_client(node_env)
        result["tokenless_jobs_api"] = jobs_api(None)
        # The operator: the same token, from where the operator keeps it.
        holder = Path("/tmp/operator_token")
        holder.write_text(token)
        holder.chmod(0o600)
        with_token = dict(node_env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(holder))
        result["token_client"] = run_client(with_token)
        result["token_jobs_api"] = jobs_api(token)
    finally:  # as PID 1 of its namespace, this process takes the head with it when it exits
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
