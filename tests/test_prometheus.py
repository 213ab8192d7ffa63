"""Metrics on a cluster: Prometheus, started on the shipped config, finds Ray's nodes through the service-discovery
file Ray writes and reads diprl's gauges back, the way the training driver exports them (its `Tracker`).

Needs Debian's `prometheus` (`make install` installs it); CI must run it, so there a missing binary is a
failure, elsewhere a skip. The whole smoke experiment's gauges are read through Prometheus on a `ray up`
cluster by tests/test_ray_up.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def prometheus_config(shipped: Path, service_discovery: Path, interval_s: int) -> dict[str, Any]:
    """The shipped Prometheus config, pointed at `service_discovery` and scraping every `interval_s`."""
    config: dict[str, Any] = yaml.safe_load(shipped.read_text())
    [job] = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    job["file_sd_configs"][0]["files"] = [str(service_discovery)]
    assert job["file_sd_configs"][0]["refresh_interval"] == "10s"  # the endpoints change after Prometheus starts
    job["file_sd_configs"][0]["refresh_interval"] = f"{interval_s}s"
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = f"{interval_s}s"
    return config


def query(port: int, promql: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Ray's socket paths live under its temp dir, and a Unix socket path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="diprl-prom-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prometheus_reads_diprl_learner_step_and_league_health_through_rays_service_discovery(short_tmp: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Prometheus test; `prometheus` is missing (make install installs it)")
        pytest.skip("needs Debian's prometheus")
    import ray

    from diprl.ports import free_port
    from diprl.raysession import connect
    from diprl.tracking import Tracker

    ray_tmp = short_tmp / "ray"
    connect(
        address="local",
        num_cpus=1,
        dashboard=True,  # the dashboard keeps the service-discovery file
        dashboard_port=free_port("127.0.0.1"),
        _temp_dir=str(ray_tmp),
        _system_config={"metrics_report_interval_ms": 1000},
    )
    port = free_port("127.0.0.1")
    config = short_tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            prometheus_config(REPO / "cluster" / "prometheus.yml", ray_tmp / "prom_metrics_service_discovery.json", 1)
        )
    )
    log = (short_tmp / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={short_tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        (short_tmp / "run").mkdir()
        tracker = Tracker(short_tmp / "run", {}, use_wandb=False)
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not found:
            tracker.log("learner", {"learner/step": 7, "tokens_per_s": 1234.5}, policy="main")  # as each step does
            health = {"step": 7, "league/exploitability_lb": 0.26, "league/nash_main": 0.4, "league/rollbacks": 1}
            tracker.log("league", health, policy="main")  # as the driver's league health record does
            time.sleep(2)
            try:
                found = query(port, 'ray_diprl_learner_step{policy="main"}')
            except OSError:  # Prometheus still starting
                continue
        assert found, (short_tmp / "prometheus.log").read_text()[-2000:]
        assert float(found[0]["value"][1]) == 7.0
        assert float(query(port, 'ray_diprl_learner_tokens_per_s{policy="main"}')[0]["value"][1]) == 1234.5
        for name, value in (("exploitability_lb", 0.26), ("nash_main", 0.4), ("rollbacks", 1.0)):
            [series] = query(port, f'ray_diprl_league_{name}{{policy="main"}}')
            assert float(series["value"][1]) == value
        tracker.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
        ray.shutdown()
