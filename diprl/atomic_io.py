"""Durable writes: what atomic publishing (adapters, cached tokenizers and models) relies on."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename into it) to disk, so a crash cannot undo a publish."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
