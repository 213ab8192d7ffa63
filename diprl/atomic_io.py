"""Durable writes and file digests: what atomic publishing (adapters, cached tokenizers and models,
checkpoints) relies on."""

from __future__ import annotations

import hashlib
import os
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
