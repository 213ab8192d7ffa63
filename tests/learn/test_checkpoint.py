"""Checkpoints are atomic, verified against their manifest, fall back past corrupt ones, and are retained."""

from __future__ import annotations

from pathlib import Path

import pytest

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
