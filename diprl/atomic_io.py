"""Durable writes and file digests: what atomic publishing (adapters, cached tokenizers and models,
checkpoints) relies on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename into it) to disk, so a crash cannot undo a publish."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks: what manifests of cached builds and checkpoints record."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once: write a temp file beside it, fsync, rename, fsync the directory.

    A reader (or a crash) sees the old file or the new one, never a torn write; once this returns
    the new bytes and the rename that published them are on disk.
    """
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


def replace_dir_atomic(target: Path, write: Callable[[Path], None]) -> Path:
    """Replace directory `target` with what `write(tmp)` puts in a fresh temporary sibling, all at once.

    The old directory is moved aside before the new one is renamed in and removed after, so a kill at
    any point leaves the old directory, the new one, or (between the two renames) a `.<name>.old-*`
    sibling holding the old one: never half a directory under `target`.
    """
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with path.open("rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if target.exists():
            os.rename(target, trash)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return target


def write_json_atomic(path: Path, obj: Any, indent: int | None = None) -> Path:
    """`obj` as JSON at `path`, all at once (`write_file_atomic`); the parent directory is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, (json.dumps(obj, indent=indent, default=str) + "\n").encode())
    return path


def move_jsonl_records(path: Path, moved_to: Path, drop: Callable[[dict[str, Any]], bool]) -> int:
    """Move the records of a JSONL file for which `drop` is true to the end of `moved_to`; their number.

    For metrics a resumed or restarted learner superseded: the records it will write again leave the
    file (kept beside it, not deleted), so the file holds every step once. The moved records are
    appended and fsynced before the file is replaced atomically: a crash in between leaves them in
    both files, never in neither. Torn lines (a killed writer) are dropped; everything else stays.
    """
    if not path.is_file():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        (moved if isinstance(record, dict) and drop(record) else kept).append(line)
    if not moved:
        return 0
    with moved_to.open("a") as fh:
        fh.write("".join(f"{line}\n" for line in moved))
        fh.flush()
        os.fsync(fh.fileno())
    write_file_atomic(path, "".join(f"{line}\n" for line in kept).encode())
    return len(moved)
