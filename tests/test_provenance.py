"""A run directory records what made it: the code's commit and changes, the packages, the machine."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from diprl.run.provenance import code_state, write_provenance


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_the_commit_and_every_uncommitted_change_are_fingerprinted(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    clean = code_state(repo)
    assert clean == {
        "commit": _git(repo, "rev-parse", "HEAD"), "clean": True, "diff_sha256": None,
        "untracked_files": 0, "untracked_sha256": None,
    }  # fmt: skip
    (repo / "a.py").write_text("x = 2\n")
    edited = code_state(repo)
    (repo / "a.py").write_text("x = 3\n")
    assert not edited["clean"] and edited["diff_sha256"] != code_state(repo)["diff_sha256"]
    (repo / "new.py").write_text("y = 1\n")
    one = code_state(repo)
    (repo / "new.py").write_text("y = 2\n")
    assert one["untracked_files"] == 1 and one["untracked_sha256"] != code_state(repo)["untracked_sha256"]
    assert code_state(tmp_path / "nowhere")["commit"] is None


def test_each_start_writes_its_own_record_with_versions_and_hardware(tmp_path: Path) -> None:
    first, second = write_provenance(tmp_path), write_provenance(tmp_path)
    assert first != second and first.parent == second.parent == tmp_path / "provenance"
    record = json.loads(first.read_text())
    assert record["code"]["commit"] == _git(Path(__file__).resolve().parents[1], "rev-parse", "HEAD")
    versions = record["versions"]
    assert all(versions[name] for name in ("torch", "vllm", "ray", "deepspeed", "transformers", "diplomacy"))
    assert versions["torch"] == f"torch {record['packages']['torch']}" and len(record["packages"]) > 50
    assert record["hardware"]["cores"] == os.cpu_count() and record["hardware"]["memory_gb"] > 0
    assert isinstance(record["hardware"]["gpus"], list)
