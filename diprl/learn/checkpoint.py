"""Atomic learner checkpoints with a manifest, so a partial or corrupt one is detected and skipped.

Layout: `<run_dir>/checkpoints/<policy>/step-<N>/` holding whatever the learner writes (DeepSpeed's
own checkpoint of the LoRA weights and ZeRO optimiser partitions, the adapter in PEFT form, the
learner state) and `MANIFEST.json`, written last, with the size and SHA-256 of every file. The
directory is built under a temporary name and renamed into place, so a kill at any moment leaves
either the previous set of checkpoints or the new complete one. Reading verifies every file
against the manifest; the newest checkpoint that verifies wins, and each one skipped is reported
with the reason (missing manifest, file missing, size or hash mismatch).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.atomic_io import fsync_dir, sha256_file

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "diprl-learner-checkpoint/1"
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0


class CorruptCheckpoint(ValueError):
    """A checkpoint directory that does not match its manifest (or has none)."""


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_tree(directory: Path) -> None:
    for path in _files(directory):
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
    for sub in sorted({p.parent for p in _files(directory)} | {directory}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]


@dataclass
class Restored:
    """The checkpoint to resume from (None: none verified) and the newer ones skipped, with reasons."""

    checkpoint: Checkpoint | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


class CheckpointDir:
    """The checkpoints of one policy: write atomically, find the newest good one, keep the last few."""

    def __init__(self, root: Path | str, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def steps(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step-N` directory, oldest first (verified or not)."""
        if not self.root.is_dir():
            return []
        out = []
        for entry in self.root.iterdir():
            m = _STEP_RE.fullmatch(entry.name)
            if m and entry.is_dir():
                out.append((int(m.group(1)), entry))
        return sorted(out)

    def save(self, step: int, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
        """Write `step-<step>` atomically: `write(tmp_dir)` fills it, then the manifest, fsync, rename."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_tmp()
        tmp = self.root / f"{_TMP_PREFIX}step-{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in _files(tmp)}
            manifest = {"format": FORMAT, "step": step, "meta": meta, "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_tree(tmp)
            target = self.root / f"step-{step}"
            trash = None
            if target.exists():  # a re-run of the same step after a restore: the new one replaces it
                trash = self.root / f"{_TMP_PREFIX}old-{uuid.uuid4().hex[:8]}"
                os.rename(target, trash)
            os.rename(tmp, target)
            fsync_dir(self.root)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._retain()
        return target

    def verify(self, path: Path) -> Checkpoint:
        """The checkpoint at `path` if every file matches its manifest; `CorruptCheckpoint` says what does not."""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: no {MANIFEST} (a partial write)") from None
        except (OSError, ValueError) as err:
            raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST} ({err})") from None
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("files"), dict)
        ):
            raise CorruptCheckpoint(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
        for rel, meta in manifest["files"].items():
            file = path / rel
            try:
                size = file.stat().st_size
            except OSError:
                raise CorruptCheckpoint(f"{path}: {rel} is missing") from None
            if size != meta.get("size"):
                raise CorruptCheckpoint(f"{path}: {rel} has {size} bytes, the manifest says {meta.get('size')}")
            if sha256_file(file) != meta.get("sha256"):
                raise CorruptCheckpoint(f"{path}: {rel} does not match the SHA-256 in the manifest")
        return Checkpoint(path, int(manifest["step"]), dict(manifest.get("meta") or {}))

    def newest_good(self) -> Restored:
        """The newest checkpoint that verifies; every newer one that does not is logged and listed."""
        restored = Restored(None)
        for _, path in reversed(self.steps()):
            try:
                restored.checkpoint = self.verify(path)
                break
            except CorruptCheckpoint as err:
                logger.warning("skipping checkpoint: %s; falling back to the previous one", err)
                restored.skipped.append((path, str(err)))
        return restored

    def _retain(self) -> None:
        """Delete the oldest checkpoints beyond `keep` (corrupt ones count too: they are never restored)."""
        steps = self.steps()
        for _, path in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)

    def _sweep_tmp(self) -> None:
        now = time.time()
        for entry in self.root.glob(f"{_TMP_PREFIX}*"):
            try:
                if now - entry.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(entry, ignore_errors=True)
            except OSError:
                continue
