"""Durable writes and file digests: what atomic publishing (adapters, cached tokenizers and models,
checkpoints) relies on."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path


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
