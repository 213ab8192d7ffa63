"""Durable, symlink-refusing file operations the store and the replica cache share."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diprl.atomic_io import fsync_dir

TMP_PREFIX = ".tmp-"
_STALE_TMP_AGE_S = 24 * 3600.0
_CHUNK = 1 << 20


def write_bytes(path: Path, data: bytes) -> None:
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy `src` to `dst` durably; (size, sha256) of the bytes written."""
    digest = hashlib.sha256()
    size = 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 of a regular file, opened without following a symlink (a link swapped in is an error)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_real_dir(path: Path) -> bool:
    """A directory that is not a symlink (the store never follows links: a link could point anywhere)."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    try:
        write_bytes(tmp, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


def freeze(directory: Path) -> None:
    """Files read-only for everyone, directory world-readable: versions are shared and never edited."""
    for entry in directory.iterdir():
        entry.chmod(0o444)
    directory.chmod(0o755)


def rmtree_frozen(path: Path) -> None:
    if is_real_dir(path):
        path.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def sweep_stale_tmp(directory: Path) -> None:
    """Remove temp directories of publishes killed long ago (fresh ones may belong to a live publisher)."""
    now = time.time()
    for entry in directory.glob(f"{TMP_PREFIX}*"):
        try:
            if now - entry.lstat().st_mtime > _STALE_TMP_AGE_S:
                if is_real_dir(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
        except OSError:
            continue


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An advisory inter-process lock, so concurrent index rewrites do not lose each other's versions."""
    import fcntl

    with path.open("a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
