"""`ray up` end to end over real SSH on this machine, inside namespaces of its own (run by tests/test_ray_up.py).

    unshare -n -p -f --mount-proc sh -c 'ip link set lo up && exec python tests/launcher_flow.py WORK YAML'

Nothing here can reach another machine (the network namespace has only loopback) or touch another Ray
(the PID namespace shows only its own processes, and this script is its PID 1: when it exits, the kernel
ends everything it started). It starts a private `sshd` listening on port 22 of 127.0.0.2 (the head) and
127.0.0.3 (the worker) with a throwaway key, points a copy of the shipped cluster YAML at them (no docker
section: the image needs GPUs and a registry), runs `ray up -y`, waits for both nodes, submits the smoke
experiment with `ray job submit`, and runs `ray down -y`. What it saw goes to WORK/result.json.

The sshd sets HOME to WORK/home for every session, so what Ray writes into `~` on a node (its bootstrap
config and key, the `.bashrc` its runner sources) stays in WORK. An `ssh` wrapper first on PATH adds this
test's ssh config (its key, no host-key prompts) for the launcher and for the head's autoscaler alike; a
`ray` wrapper turns `ray stop` (the launcher's start commands and `ray down` run one) into stopping the
processes of this cluster's temp dir only.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
GCS_PORT, DASHBOARD_PORT, SERVE_PORT, PROMETHEUS_PORT = 16379, 18265, 18000, 19090
# Every port a node opens, its own (head and worker share the namespace's loopback).
HEAD_PORTS = (
    "--node-manager-port=21001 --object-manager-port=21002 --metrics-export-port=21003 "
    "--dashboard-agent-listen-port=21004 --dashboard-agent-grpc-port=21005 --runtime-env-agent-port=21006 "
    "--min-worker-port=22000 --max-worker-port=22199 --ray-client-server-port=21007"
)
WORKER_PORTS = (
    "--node-manager-port=23001 --object-manager-port=23002 --metrics-export-port=23003 "
    "--dashboard-agent-listen-port=23004 --dashboard-agent-grpc-port=23005 --runtime-env-agent-port=23006 "
    "--min-worker-port=24000 --max-worker-port=24199"
)
# A raylet waits this long (30 s by default) for its agents to report their ports, then aborts.
SLOW_MACHINE = "RAY_agent_register_timeout_ms=120000"
# The settings `make` exports for every run on a CPU machine, passed to the job through its runtime env.
JOB_ENV_KEYS = (
    "HF_HUB_OFFLINE",
    "WANDB_MODE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "DS_BUILD_OPS",
    "DS_ACCELERATOR",
    "DIPRL_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
)


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def sh(command: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
    """Run `command`, appending its output to `log`; its exit code (124 when it ran past `timeout`)."""
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"(timed out after {timeout} s)\n")
            return 124


def operator_token(work: Path) -> Path:
    return work / "driver-home" / ".config" / "diprl" / "ray_auth_token"


def node_tmp(work: Path, node: str) -> Path:
    """Each node's own Ray temp dir (sessions, sockets, logs): what its scoped `ray stop` matches."""
    return work / ("ray-head" if node == HEAD else "ray-worker")


def start_sshd(work: Path, venv_bin: Path) -> subprocess.Popen[bytes]:
    key, host_key = work / "id_ed25519", work / "ssh_host_ed25519_key"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    write(work / "authorized_keys", (work / "id_ed25519.pub").read_text(), 0o600)
    home, bin_dir = work / "home", work / "bin"
    write(
        work / "sshd_config",
        f"""ListenAddress {HEAD}:22
ListenAddress {WORKER}:22
HostKey {host_key}
AuthorizedKeysFile {work / "authorized_keys"}
PidFile {work / "sshd.pid"}
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
SetEnv HOME={home}
LogLevel ERROR
""",
    )
    write(
        work / "ssh_config",
        f"""Host *
  IdentityFile {key}
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
""",
    )
    write(bin_dir / "ssh", f'#!/bin/sh\nexec /usr/bin/ssh -F {work / "ssh_config"} "$@"\n', 0o755)
    # `ray stop` (the start commands and `ray down` run one) stops the processes of this node's temp dir and
    # nothing else: the node is the address its SSH session came in on. The PID namespace shows no other
    # Ray anyway. Everything else goes to the real `ray`.
    write(
        bin_dir / "ray",
        f"""#!/bin/sh
if [ "$1" = stop ]; then
  case "$(echo "$SSH_CONNECTION" | cut -d' ' -f3)" in
    {HEAD}) dir='{node_tmp(work, HEAD)}/' ;;
    {WORKER}) dir='{node_tmp(work, WORKER)}/' ;;
    *) echo "ray stop: not in an SSH session to a node of this test" >&2; exit 1 ;;
  esac
  pkill -TERM -f -- "$dir"; sleep 2; pkill -KILL -f -- "$dir"; exit 0
fi
exec {venv_bin / "ray"} "$@"
""",
        0o755,
    )
    # Ray's command runner sources ~/.bashrc before every command on a node.
    write(
        home / ".bashrc",
        f"export PATH={bin_dir}:{venv_bin}:$PATH\n"
        "export RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1\n",
    )
    # The operator's token where the shipped config's file_mounts take it from (the launcher's HOME is
    # driver-home); nothing on the nodes says RAY_AUTH_MODE but the shipped start commands.
    write(operator_token(work), secrets.token_hex(32), 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    log = (work / "sshd.log").open("ab")
    return subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(work / "sshd_config")], stderr=log)


def cluster_copy(shipped: Path, work: Path, repo: Path) -> Path:
    """The shipped YAML pointed at the two loopback nodes, with this test's start commands and no docker."""
    config: dict[str, Any] = yaml.safe_load(shipped.read_text())
    shipped_head = list(config["head_start_ray_commands"])
    config["cluster_name"] = f"diprl-test-{secrets.token_hex(4)}"  # the launcher's state files are by name
    config["provider"].update(head_ip=HEAD, worker_ips=[WORKER])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(work / "id_ed25519")}
    config.pop("docker", None)
    config["initialization_commands"] = []
    config["setup_commands"] = ["python -c 'import ray, diprl'"]
    # As /opt/diprl -> . is; the token as shipped, from the operator's file to a path on each node.
    [token_mount] = [n for n, local in config["file_mounts"].items() if local.endswith("ray_auth_token")]
    node_token = work / "node-auth" / "ray_auth_token"
    config["file_mounts"] = {
        str(work / "home" / "diprl"): str(repo / "cluster"),
        str(node_token): config["file_mounts"][token_mount],
    }
    # The shipped head start commands, with this test's addresses, ports, files and a temp dir per node.
    synced = work / "home" / "diprl"  # this node's copy of cluster/ (the file mount above)
    substitutions = {
        "ray start --head --port=6379 --dashboard-host=127.0.0.1": (
            f"RAY_enable_autoscaler_v2=0 {SLOW_MACHINE} ray start --head --node-ip-address={HEAD} --port={GCS_PORT} "
            f"--dashboard-host={HEAD} --dashboard-port={DASHBOARD_PORT} {HEAD_PORTS} "
            f"--temp-dir={node_tmp(work, HEAD)} --num-cpus=4"
        ),
        "/opt/diprl/cluster/prometheus.yml": str(work / "prometheus.yml"),  # pointed at this head's temp dir
        "/opt/diprl/cluster/": f"{synced}/",
        "/tmp/grafana-dashboards": str(work / "grafana-dashboards"),
        "/tmp/prometheus.log": str(work / "prometheus.log"),
        "/tmp/prometheus": str(work / "prometheus-data"),
        "127.0.0.1:9090": f"{HEAD}:{PROMETHEUS_PORT}",
        token_mount: str(node_token),
    }
    head = "\n".join(shipped_head)
    for shipped_text, ours in substitutions.items():
        assert shipped_text in head, f"the shipped head start commands no longer say {shipped_text!r}"
        head = head.replace(shipped_text, ours)
    config["head_start_ray_commands"] = head.split("\n")
    prometheus_config = yaml.safe_load((repo / "cluster" / "prometheus.yml").read_text())
    prometheus_config["global"]["scrape_interval"] = "2s"
    prometheus_config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [
        str(node_tmp(work, HEAD) / "prom_metrics_service_discovery.json")
    ]
    (work / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config))
    # The shipped worker start commands, with this test's token path, address, ports and temp dir. Ray's
    # cluster switch at 0 (loopback only) makes a worker's `ray start --address` abort.
    worker_substitutions = {
        "ray start --address=$RAY_HEAD_IP:6379": (
            f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 {SLOW_MACHINE} ray start --address=$RAY_HEAD_IP:{GCS_PORT} "
            f"--node-ip-address={WORKER} {WORKER_PORTS} --temp-dir={node_tmp(work, WORKER)} --num-cpus=2"
        ),
        token_mount: str(node_token),
    }
    worker = "\n".join(config["worker_start_ray_commands"])
    for shipped_text, ours in worker_substitutions.items():
        assert shipped_text in worker, f"the shipped worker start commands no longer say {shipped_text!r}"
        worker = worker.replace(shipped_text, ours)
    config["worker_start_ray_commands"] = worker.split("\n")
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def leftovers(pattern: str, grace_s: float) -> list[str]:
    """Command lines of the processes matching `pattern` still running after `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        found = subprocess.run(["pgrep", "-a", "-f", pattern], capture_output=True, text=True).stdout.strip()
        if not found or time.monotonic() > deadline:
            return found.splitlines()
        time.sleep(1)


def control_path(config: Path) -> Path:
    """Where the launcher keeps this cluster's SSH control sockets (a fixed path outside WORK)."""
    name = yaml.safe_load(config.read_text())["cluster_name"]
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    return Path(f"/tmp/ray_ssh_{user}") / hashlib.sha256(name.encode()).hexdigest()[:10]


def learner_step_in_prometheus() -> float | None:
    """The highest `diprl_learner_step` the head's Prometheus scraped during the run (None: never)."""
    promql = 'max_over_time(ray_diprl_learner_step{policy="main"}[1h])'
    url = f"http://{HEAD}:{PROMETHEUS_PORT}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            found = json.load(response)["data"]["result"]
    except OSError:
        return None
    return float(found[0]["value"][1]) if found else None


def alive_nodes(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["ray", "list", "nodes", "--address", f"http://{HEAD}:{DASHBOARD_PORT}", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    try:
        nodes = json.loads(out.stdout) if out.returncode == 0 else []
    except json.JSONDecodeError:
        nodes = []
    return sorted(n["node_ip"] for n in nodes if n.get("state") == "ALIVE")


def main(work: Path, shipped: Path) -> int:
    repo = Path(__file__).resolve().parents[1]
    venv_bin = Path(sys.executable).parent
    result: dict[str, Any] = {}
    sshd = start_sshd(work, venv_bin)
    launcher = work / "launcher"
    launcher.mkdir()
    env = dict(
        os.environ,
        PATH=f"{work / 'bin'}:{venv_bin}:{os.environ['PATH']}",
        HOME=str(work / "driver-home"),
        TMPDIR=str(launcher),
        RAY_TMPDIR=str(launcher),
        RAY_AUTH_TOKEN_PATH=str(operator_token(work)),
        RAY_AUTH_MODE="token",  # a client sends the token only when told the cluster wants one
        RAY_UP_enable_autoscaler_v2="0",  # v2 counts the head toward min_workers and never starts the worker
    )
    env.pop("RAY_ADDRESS", None)
    config = cluster_copy(shipped, work, repo)
    log = work / "launcher.log"
    started = time.monotonic()
    try:
        # A node's start has fixed 30-second windows (its raylet registering, its agents' ports) that a
        # loaded 2-core machine can miss: one more try before calling it a failure.
        for attempt in range(2):
            result["up"] = sh(["ray", "up", "-y", "--no-config-cache", str(config)], log, env, timeout=300)
            result["up_attempts"] = attempt + 1
            if result["up"] == 0:
                break
        result["up_s"] = round(time.monotonic() - started, 1)
        if result["up"] != 0:
            return 1
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and alive_nodes(env) != [HEAD, WORKER]:
            time.sleep(2)
        result["nodes"] = alive_nodes(env)
        # The shipped start commands turned token auth on: a client without the token lists nothing.
        tokenless = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        result["tokenless_nodes"] = alive_nodes(dict(tokenless, HOME=str(work / "stranger-home")))
        node_token = work / "node-auth" / "ray_auth_token"
        result["node_token_mode"] = oct(node_token.stat().st_mode & 0o777) if node_token.is_file() else None
        result["nodes_s"] = round(time.monotonic() - started, 1)
        if result["nodes"] != [HEAD, WORKER]:
            return 1
        grafana = node_tmp(work, HEAD) / "session_latest" / "metrics" / "grafana"
        provisioning = grafana / "provisioning" / "dashboards" / "default.yml"
        result["grafana_provisioning"] = provisioning.read_text() if provisioning.is_file() else ""
        result["grafana_dashboards"] = sorted(p.name for p in (work / "grafana-dashboards").glob("*.json"))
        job_env = {key: os.environ[key] for key in JOB_ENV_KEYS if key in os.environ}
        job_env["TMPDIR"] = str(work / "job-tmp")
        runtime_env = {
            "working_dir": str(repo),
            "excludes": [".git", ".venv", ".cache", ".mypy_cache", ".ruff_cache", ".pytest_cache", "runs", "wandb"],
            "env_vars": job_env,
        }
        (work / "job-tmp").mkdir()
        job = [
            "ray",
            "job",
            "submit",
            "--address",
            f"http://{HEAD}:{DASHBOARD_PORT}",
            "--submission-id",
            "diprl-smoke",
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--",
            "python",
            "-m",
            "diprl.train",
            "+experiment=smoke",
            f"train.run_dir={work / 'run'}",
            f"inference.port={SERVE_PORT}",
        ]
        result["job"] = sh(job, work / "job.log", env, timeout=900)
        status = subprocess.run(
            ["ray", "job", "status", "--address", f"http://{HEAD}:{DASHBOARD_PORT}", "diprl-smoke"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        result["job_status"] = status.stdout + status.stderr
        result["job_s"] = round(time.monotonic() - started, 1)
        result["prometheus_learner_step"] = learner_step_in_prometheus()
    finally:
        result["down"] = sh(["ray", "down", "-y", str(config)], log, env, timeout=180)
        result["down_s"] = round(time.monotonic() - started, 1)
        # `ray down` runs `ray stop` on the head only; with the shipped config's docker section it also stops
        # every node's container. This copy has none, so the worker's Ray is stopped here as that would.
        result["head_after_down"] = leftovers(f"{node_tmp(work, HEAD)}/", grace_s=10)
        stop_worker = [str(work / "bin" / "ssh"), f"root@{WORKER}", "source ~/.bashrc; ray stop"]
        result["worker_stop"] = sh(stop_worker, log, env, timeout=60)
        result["processes_after_down"] = leftovers(f"{work}/ray-", grace_s=10)
        shutil.rmtree(control_path(config), ignore_errors=True)  # the launcher's SSH sockets, under /tmp
        sshd.terminate()
        sshd.wait(timeout=30)
        (work / "result.json").write_text(json.dumps(result, indent=1))
    return 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # as PID 1 of its namespace an unhandled SIGTERM would be ignored


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
