"""Checkpoints are atomic, verified against their manifest, fall back past corrupt ones, and are retained."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from diprl.atomic_io import sha256_file
from diprl.learn.checkpoint import CheckpointDir, CorruptCheckpoint


def _writer(payload: bytes):  # type: ignore[no-untyped-def]
    def write(tmp: Path) -> None:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "state.bin").write_bytes(payload)
        (tmp / "meta.txt").write_text("x")

    return write


def test_save_verify_and_retention(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main", keep=2)
    for step in (1, 2, 3):
        ckpts.save(step, _writer(bytes([step]) * 100), {"version": f"main@v{step}"})
    assert [s for s, _ in ckpts.steps()] == [2, 3]
    restored = ckpts.newest_good()
    assert restored.checkpoint is not None and restored.checkpoint.step == 3 and restored.skipped == []
    assert restored.checkpoint.meta == {"version": "main@v3"}
    assert not list((tmp_path / "main").glob(".tmp-*"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / "sub" / "state.bin").write_bytes(b"\x00" * 100), "SHA-256"),
        (lambda p: (p / "sub" / "state.bin").write_bytes(b"\x03" * 10), "bytes"),
        (lambda p: (p / "meta.txt").unlink(), "missing"),
        (lambda p: (p / "MANIFEST.json").unlink(), "partial write"),
        (lambda p: (p / "MANIFEST.json").write_text("{"), "unreadable"),
    ],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path: Path, damage, reason: str) -> None:  # type: ignore[no-untyped-def]
    ckpts = CheckpointDir(tmp_path / "main", keep=3)
    ckpts.save(1, _writer(b"\x01" * 100), {})
    newest = ckpts.save(2, _writer(b"\x02" * 100), {})
    damage(newest)
    with pytest.raises(CorruptCheckpoint, match=reason):
        ckpts.verify(newest)
    restored = ckpts.newest_good()
    assert restored.checkpoint is not None and restored.checkpoint.step == 1
    assert restored.skipped and restored.skipped[0][0] == newest and reason in restored.skipped[0][1]


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main")

    def boom(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpts.save(1, boom, {})
    assert ckpts.steps() == [] and list((tmp_path / "main").iterdir()) == []
    assert ckpts.newest_good().checkpoint is None


def _relist(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrite a checkpoint's manifest with `edit` applied to its file table (as a forger would)."""
    manifest = json.loads((path / "MANIFEST.json").read_text())
    edit(manifest["files"])
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def _entry(file: Path) -> dict[str, object]:
    return {"size": file.stat().st_size, "sha256": sha256_file(file)}


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main")
    ckpts.save(1, _writer(b"\x01" * 100), {})
    newest = ckpts.save(2, _writer(b"\x02" * 100), {})
    (newest / "sub" / "extra.pt").write_bytes(b"planted")
    with pytest.raises(CorruptCheckpoint, match=r"sub/extra\.pt is not listed"):
        ckpts.verify(newest)
    restored = ckpts.newest_good()
    assert restored.checkpoint is not None and restored.checkpoint.step == 1
    assert "sub/extra.pt" in restored.skipped[0][1]


@pytest.mark.parametrize("rel", ["../outside.bin", "sub/../../outside.bin", "OUTSIDE", "./meta.txt", "sub//state.bin"])
def test_a_manifest_entry_outside_the_checkpoint_is_refused(tmp_path: Path, rel: str) -> None:
    ckpts = CheckpointDir(tmp_path / "main")
    newest = ckpts.save(1, _writer(b"\x01" * 100), {})
    outside = tmp_path / "main" / "outside.bin"
    outside.write_bytes(b"secret")
    if rel == "OUTSIDE":
        rel = str(outside)  # absolute
    target = outside if "outside" in rel else newest / "meta.txt" if "meta" in rel else newest / "sub" / "state.bin"
    _relist(newest, lambda files: files.update({rel: _entry(target)}))
    with pytest.raises(CorruptCheckpoint, match="not a plain relative path inside the checkpoint") as err:
        ckpts.verify(newest)
    assert repr(rel) in str(err.value)


def test_a_symlink_inside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main")
    newest = ckpts.save(1, _writer(b"\x01" * 100), {})
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"\x01" * 100)  # same bytes: only the link gives it away
    (newest / "sub" / "state.bin").unlink()
    (newest / "sub" / "state.bin").symlink_to(elsewhere)
    with pytest.raises(CorruptCheckpoint, match=r"sub/state\.bin is a symbolic link"):
        ckpts.verify(newest)


def test_a_checkpoint_lacking_a_required_file_is_refused(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main", required=["meta.txt"])
    ckpts.save(1, _writer(b"\x01" * 100), {})
    newest = ckpts.save(2, _writer(b"\x02" * 100), {})
    (newest / "meta.txt").unlink()
    _relist(newest, lambda files: files.pop("meta.txt"))
    with pytest.raises(CorruptCheckpoint, match=r"meta\.txt is missing"):
        ckpts.verify(newest)
    assert ckpts.newest_good().checkpoint.step == 1  # type: ignore[union-attr]


def test_an_old_pickled_checkpoint_is_refused_without_being_read(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main")
    old = tmp_path / "main" / "step-5"
    old.mkdir(parents=True)
    (old / "learner_state.pt").write_bytes(b"\x80\x04N.")
    manifest = {"format": "diprl-learner-checkpoint/1", "step": 5, "meta": {}, "files": {}}
    manifest["files"]["learner_state.pt"] = _entry(old / "learner_state.pt")
    (old / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpoint, match=r"old pickled checkpoint format.*not loaded"):
        ckpts.verify(old)
    assert ckpts.newest_good().checkpoint is None


def test_the_manifest_is_fsynced_before_the_checkpoint_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []  # inodes, in the order they were fsynced
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.fstat(fd).st_ino)

    def rename(src: str | Path, dst: str | Path) -> None:
        if Path(dst).name == "step-1":
            manifest, directory = (Path(src) / "MANIFEST.json").stat().st_ino, Path(src).stat().st_ino
            assert manifest in synced, "manifest bytes not on disk before the rename"
            assert directory in synced[synced.index(manifest) :], "manifest's directory entry not on disk"
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    CheckpointDir(tmp_path / "main").save(1, _writer(b"\x01" * 100), {})
    assert synced[-1] == (tmp_path / "main").stat().st_ino  # the rename itself is flushed last


def _state_writer(value: int):  # type: ignore[no-untyped-def]
    def write(tmp: Path) -> None:
        from diprl.learn.state_files import write_state

        write_state(tmp, "learner", {"step": value, "w": torch.full((2,), float(value))})

    return write


def _nest_deeply(path: Path, rel: str, depth: int) -> None:
    """Nest `rel`'s `step` value `depth` levels deep and rewrite the manifest to match (as a forger would)."""
    file = path / rel
    file.write_text(file.read_text().replace('"step": 2', '"step": ' + "[" * depth + "2" + "]" * depth))
    _relist(path, lambda files: files.update({rel: _entry(file)}))


@pytest.mark.parametrize("depth", [600, 100_000])
def test_a_deeply_nested_state_file_is_refused_and_the_previous_checkpoint_restored(tmp_path: Path, depth: int) -> None:
    """Found by review (N5): a state file nested a few hundred levels deep (its manifest rewritten to match)
    verified, then escaped the restore as a `RecursionError`; it is a bad checkpoint, and the one before
    it is restored."""
    ckpts = CheckpointDir(tmp_path / "main", required=["learner.json", "learner.safetensors"])
    ckpts.save(1, _state_writer(1), {})
    newest = ckpts.save(2, _state_writer(2), {})
    _nest_deeply(newest, "learner.json", depth)
    with pytest.raises(CorruptCheckpoint, match=r"learner\.json.*nested"):
        ckpts.verify(newest)
    restored = ckpts.newest_good()
    assert restored.checkpoint is not None and restored.checkpoint.step == 1
    assert restored.skipped[0][0] == newest and "nested" in restored.skipped[0][1]


def test_a_deeply_nested_manifest_is_refused_and_the_previous_checkpoint_restored(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "main")
    ckpts.save(1, _writer(b"\x01" * 100), {})
    newest = ckpts.save(2, _writer(b"\x02" * 100), {})
    (newest / "MANIFEST.json").write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    restored = ckpts.newest_good()
    assert restored.checkpoint is not None and restored.checkpoint.step == 1
    assert "MANIFEST.json" in restored.skipped[0][1]
