"""Atomic learner checkpoints with a manifest, so a partial, corrupt or tampered one is detected and skipped.

Layout: `<run_dir>/checkpoints/<policy>/step-<N>/` holding whatever the learner writes (its state as
safetensors + JSON, see `state_files`; the adapter in PEFT form) and `MANIFEST.json`, written last
(atomically, fsynced), with the size and SHA-256 of every file. The directory is built under a
temporary name and renamed into place, so a kill at any moment leaves either the previous set of
checkpoints or the new complete one.

Reading trusts nothing but the manifest: every file present must be listed in it, every entry must
be a plain relative path inside the checkpoint (no `..`, no absolute path, no symlink anywhere), and
every file must match its size and hash, and every state file pair (`<name>.json` beside
`<name>.safetensors`, see `state_files`) must decode, checked without reading its tensors, so a
forged one (nested too deeply, a dangling reference) is a bad checkpoint rather than a failed restore.
The newest checkpoint that verifies wins; each one skipped
is reported with the reason, naming the file. Checkpoints of the first format (pickled `.pt` files,
which could run code when loaded) are refused, never read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from diprl.atomic_io import fsync_dir, sha256_file, write_file_atomic

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "diprl-learner-checkpoint/2"
PICKLED_FORMAT = "diprl-learner-checkpoint/1"
"""The first format: `learner_state.pt` and DeepSpeed's own `.pt` files, all pickle. Refused, never read."""
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class CorruptCheckpoint(ValueError):
    """A checkpoint directory that does not match its manifest (or has none), or is of a refused format."""


def _walk(directory: Path) -> list[str]:
    """Relative POSIX paths of every regular file under `directory` (the manifest aside), never following links.

    A symlink or any other non-regular entry is a `CorruptCheckpoint`: a link could point anywhere.
    """
    out: list[str] = []

    def unreadable(err: OSError) -> None:
        raise CorruptCheckpoint(f"{directory}: cannot list {err.filename} ({err.strerror})")

    for root, dirs, files in os.walk(directory, onerror=unreadable, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise CorruptCheckpoint(f"{directory}: {rel} is a symbolic link (a checkpoint holds only plain files)")
            if stat.S_ISREG(mode):
                if rel != MANIFEST:
                    out.append(rel)
            elif not stat.S_ISDIR(mode):
                raise CorruptCheckpoint(f"{directory}: {rel} is not a regular file")
    return sorted(out)


def _check_state_files(path: Path, listed: Iterable[str]) -> None:
    """Every state file pair in the checkpoint decodes (`state_files.check_state`); `CorruptCheckpoint` if not."""
    names = set(listed)
    pairs = sorted(
        rel[: -len(".json")] for rel in names if rel.endswith(".json") and f"{rel[:-5]}.safetensors" in names
    )
    if not pairs:
        return
    from diprl.learn.state_files import StateFileError, check_state

    for rel in pairs:
        try:
            check_state(path, rel)
        except StateFileError as err:
            raise CorruptCheckpoint(f"{path}: a bad state file: {err}") from None


def _fsync_files(directory: Path, files: Iterable[str]) -> None:
    rels = list(files)
    for rel in rels:
        with (directory / rel).open("rb") as fh:
            os.fsync(fh.fileno())
    parents = {(directory / rel).parent for rel in rels} | {directory}
    for sub in sorted(parents, key=lambda p: -len(p.parts)):
        fsync_dir(sub)


def _safe_relative(rel: object) -> bool:
    """A manifest entry names a file inside the checkpoint: relative, normalised, no `..` or `.` parts."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        return False
    parts = PurePosixPath(rel).parts
    return (
        not PurePosixPath(rel).is_absolute()
        and "/".join(parts) == rel
        and all(part not in ("", ".", "..") for part in parts)
        and rel != MANIFEST
    )


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
    """The checkpoints of one policy: write atomically, find the newest good one, keep the last few.

    `required`: files every checkpoint must hold (what the reader opens by name); one lacking any is
    refused like a corrupt one, so a reader never meets a verified checkpoint it cannot load.
    """

    def __init__(self, root: Path | str, keep: int = 3, required: Iterable[str] = ()) -> None:
        self.root = Path(root)
        self.keep = keep
        self.required = tuple(required)

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
            written = _walk(tmp)
            lacking = [name for name in self.required if name not in written]
            if lacking:
                raise RuntimeError(f"checkpoint writer left out {lacking}")
            files = {rel: {"size": (tmp / rel).stat().st_size, "sha256": sha256_file(tmp / rel)} for rel in written}
            _fsync_files(tmp, written)
            manifest = {"format": FORMAT, "step": step, "meta": meta, "files": files}
            write_file_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
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
        """The checkpoint at `path` if it is exactly what its manifest lists; `CorruptCheckpoint` says what is not."""
        if path.is_symlink():
            raise CorruptCheckpoint(f"{path}: the checkpoint directory is a symbolic link")
        manifest_path = path / MANIFEST
        if manifest_path.is_symlink():
            raise CorruptCheckpoint(f"{path}: {MANIFEST} is a symbolic link")
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: no {MANIFEST} (a partial write)") from None
        except (OSError, ValueError) as err:
            raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST} ({err})") from None
        except RecursionError:
            raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST} (nested too deeply to decode)") from None
        if isinstance(manifest, dict) and (
            manifest.get("format") == PICKLED_FORMAT or "learner_state.pt" in (manifest.get("files") or {})
        ):
            raise CorruptCheckpoint(
                f"{path}: written in the old pickled checkpoint format ({PICKLED_FORMAT}, .pt files); it is "
                "refused and not loaded, because unpickling a file can run arbitrary code. Resume it with the "
                "diprl release that wrote it, or start a new run"
            )
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("files"), dict)
            or not isinstance(manifest.get("step"), int)
        ):
            raise CorruptCheckpoint(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
        listed: dict[str, Any] = manifest["files"]
        for rel in listed:
            if not _safe_relative(rel):
                raise CorruptCheckpoint(
                    f"{path}: manifest entry {rel!r} is not a plain relative path inside the checkpoint"
                )
        try:
            present = _walk(path)
        except OSError as err:
            raise CorruptCheckpoint(f"{path}: cannot list its files ({err})") from None
        unlisted = [rel for rel in present if rel not in listed]
        if unlisted:
            raise CorruptCheckpoint(f"{path}: {unlisted[0]} is not listed in {MANIFEST} (a file nobody vouches for)")
        for rel in self.required:
            if rel not in listed:
                raise CorruptCheckpoint(f"{path}: {rel} is missing (not in {MANIFEST})")
        for rel, meta in sorted(listed.items()):
            file = path / rel
            if not isinstance(meta, dict) or not _SHA256_RE.fullmatch(str(meta.get("sha256"))):
                raise CorruptCheckpoint(f"{path}: {MANIFEST} entry for {rel} has no SHA-256")
            if rel not in present:
                raise CorruptCheckpoint(f"{path}: {rel} is missing")
            size = file.stat().st_size
            if size != meta.get("size"):
                raise CorruptCheckpoint(f"{path}: {rel} has {size} bytes, the manifest says {meta.get('size')}")
            if sha256_file(file) != meta["sha256"]:
                raise CorruptCheckpoint(f"{path}: {rel} does not match the SHA-256 in the manifest")
        _check_state_files(path, listed)
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
