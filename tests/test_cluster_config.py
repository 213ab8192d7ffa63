"""The cluster files must pass Ray's own schema, or `ray up` fails on the first try on a cluster; and they must
say what running on GPU machines needs (tests/test_ray_up.py runs the self-hosted one's command path)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "cluster" / name).read_text())
    validate_config(prepare_config(config))  # prepare_config fills defaults as `ray up` does
    return config


def test_the_self_hosted_cluster_uses_rays_local_provider_over_ssh() -> None:
    config = load("a100.yaml")
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert config["auth"]["ssh_user"] and config["auth"]["ssh_private_key"]
    assert config["file_mounts"]["/opt/diprl"] == "."  # where the image installed diprl, editable
    assert set(config["file_mounts"]) == {"/opt/diprl", "/opt/diprl-auth/ray_auth_token"}  # and the Ray token


def test_every_node_runs_the_image_built_from_docker_with_its_gpus() -> None:
    config = load("a100.yaml")
    docker = config["docker"]
    # Ray adds only --runtime=nvidia, and only when `docker info` lists that runtime (Ray issue 43231).
    assert "--gpus all" in docker["run_options"]
    [build] = config["initialization_commands"]
    assert f"-t {docker['image']} " in build and "docker/Dockerfile" in build
    mount = f"/tmp/ray_tmp_mount/{config['cluster_name']}/opt/diprl"  # where Ray syncs file_mounts on the host
    assert build.endswith(mount) and f"-f {mount}/docker/Dockerfile" in build
    assert any("nvidia-smi" in c for c in config["setup_commands"])


def test_nccl_and_gloo_are_told_the_interface_in_one_place() -> None:
    options = " ".join(load("a100.yaml")["docker"]["run_options"])
    assert re.search(r"--env NCCL_SOCKET_IFNAME=\S+", options) and re.search(r"--env GLOO_SOCKET_IFNAME=\S+", options)


def test_no_usage_reports_and_the_dashboard_on_loopback() -> None:
    for name in ("a100.yaml", "aws-a100.yaml"):
        config = load(name)
        starts = [
            c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c
        ]
        assert len(starts) == 2 and all("--disable-usage-stats" in c for c in starts), name
        assert any("--dashboard-host=127.0.0.1" in c for c in starts), name
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert all(v in dockerfile for v in ("VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1", "RAY_USAGE_STATS_ENABLED=0"))


def test_the_head_runs_prometheus_on_rays_service_discovery_file() -> None:
    config = load("a100.yaml")
    [start] = [c for c in config["head_start_ray_commands"] if "prometheus " in c]
    assert "--config.file=/opt/diprl/cluster/prometheus.yml" in start and "127.0.0.1:9090" in start
    assert any("RAY_PROMETHEUS_HOST=http://127.0.0.1:9090" in c for c in config["head_start_ray_commands"])
    [grafana] = [c for c in config["head_start_ray_commands"] if "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR" in c]
    assert "cp /opt/diprl/cluster/grafana/diprl.json /tmp/grafana-dashboards/" in grafana
    assert "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR=/tmp/grafana-dashboards" in grafana
    prometheus = yaml.safe_load((ROOT / "cluster" / "prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    assert re.search(r"apt-get install .*\bprometheus\b", (ROOT / "docker" / "Dockerfile").read_text())


def test_the_grafana_dashboard_charts_every_gauge_diprl_exports() -> None:
    from diprl.tracking import RAY_GAUGES, STAGE_GAUGE

    dashboard = json.loads((ROOT / "cluster" / "grafana" / "diprl.json").read_text())
    charted = {
        m for panel in dashboard["panels"] for t in panel["targets"] for m in re.findall(r"ray_diprl_\w+", t["expr"])
    }
    exported = {name for name, _ in RAY_GAUGES.values()} | {STAGE_GAUGE}
    assert charted == {f"ray_{name}" for name in exported}  # Ray prefixes custom metrics with ray_
    assert dashboard["uid"] == "diprl"


def test_the_cloud_variant_has_gpu_nodes_and_installs_the_gpu_requirements() -> None:
    config = load("aws-a100.yaml")
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types, "no GPU node type: inference and the learner could not be scheduled"
    assert any("requirements/gpu.txt" in cmd for cmd in config["setup_commands"])


def test_gpu_image_pins_the_v1_model_runner() -> None:
    """FACTS.md: GPU vLLM builds default to Model Runner V2, whose logits-processor interface differs."""
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in (ROOT / "docker" / "Dockerfile").read_text()


def test_gpu_image_runs_the_training_entry() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert '"diprl.train"' in text and '"diprl.arena"' not in text


def _synced_paths(config: dict[str, Any], source: Path, dest: Path) -> list[str]:
    """What `ray up` would copy of `source`: rsync's own list, with the launcher's exclude and filter arguments."""
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    options = {"rsync_exclude": config.get("rsync_exclude"), "rsync_filter": config.get("rsync_filter")}
    arguments = SSHCommandRunner._create_rsync_filter_args(None, options)  # type: ignore[arg-type]
    listed = subprocess.run(
        ["rsync", "-an", "--out-format=%n", *arguments, f"{source}/", f"{dest}/"],
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.splitlines()


@pytest.mark.parametrize("name", ["a100.yaml", "aws-a100.yaml"])
def test_ray_up_syncs_none_of_the_venv_the_cache_or_the_runs(name: str, tmp_path: Path) -> None:
    """`.cache` holds the local Ray's token, `.venv` gigabytes of this machine's packages, `runs/` results."""
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    config = load(name)
    checkout = tmp_path / "checkout"
    for path in (".venv/bin/python", ".cache/ray/auth_token", "runs/pfsp-1/metrics.jsonl", "diprl/train.py"):
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text("x")
    (checkout / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    synced = _synced_paths(config, checkout, tmp_path / "node")
    assert "diprl/train.py" in synced
    assert not [p for p in synced if p.split("/")[0] in (".venv", ".cache", "runs")], synced
    # The same on this checkout as it is, whatever it holds.
    synced = _synced_paths(config, ROOT, tmp_path / "node")
    assert "diprl/train.py" in synced and "cluster/a100.yaml" in synced
    assert not [p for p in synced if p.split("/")[0] in (".venv", ".cache", "runs")]


def test_the_launcher_gets_a_cluster_only_ssh_key_and_the_docs_say_how_to_make_it() -> None:
    """The launcher copies `ssh_private_key` to the head: never the key that opens everything else of yours."""
    key = load("a100.yaml")["auth"]["ssh_private_key"]
    assert Path(key).name not in {"id_rsa", "id_ed25519", "id_ecdsa", "id_dsa"}, key
    make = f"ssh-keygen -t ed25519 -f {key}"
    for text in ((ROOT / "cluster" / "a100.yaml").read_text(), (ROOT / "docs" / "cluster.md").read_text()):
        assert make in text
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert "authorized_keys" in docs and "ssh-copy-id" in docs
