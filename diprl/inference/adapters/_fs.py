"""Durable, symlink-refusing file operations the store and the replica cache share.

Everything they write is their owner's alone, whatever the umask: directories 0700 (`make_dir`), files
created 0600 (`write_bytes`, `copy_hashing`, lock files) and a published version's files 0400 (`freeze`).
A run's trained weights are not for every user of the machine to copy; the PolicyServer, the learner and
the web app read them as the same user.
"""

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
DIR_MODE = 0o700
FILE_MODE = 0o600
FROZEN_MODE = 0o400


def _create(path: Path) -> int:
    """A new or truncated file for writing, 0600 from the start, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # a file that existed keeps its mode through O_CREAT
    return fd


def make_dir(path: Path, exist_ok: bool = False) -> None:
    """`path.mkdir`, 0700 (its parents must exist); an existing directory is left as it is."""
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not exist_ok or not path.is_dir():
            raise
        return
    path.chmod(DIR_MODE)  # mkdir's mode is masked by the umask; this one is not


def make_dirs(path: Path) -> None:
    """`path` and any missing parents, each one created here 0700 (those that exist are left as they are)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        make_dir(directory, exist_ok=True)


def write_bytes(path: Path, data: bytes) -> None:
    with os.fdopen(_create(path), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy `src` to `dst` durably; (size, sha256) of the bytes written."""
    digest = hashlib.sha256()
    size = 0
    with src.open("rb") as fin, os.fdopen(_create(dst), "wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


def read_bytes(path: Path, limit: int = -1) -> bytes:
    """The bytes of a regular file (at most `limit` of them), opened without following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit)


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
    """Files read-only, for their owner alone (0400), directory 0700: versions are never edited."""
    for entry in directory.iterdir():
        entry.chmod(FROZEN_MODE)
    directory.chmod(DIR_MODE)


def rmtree_frozen(path: Path) -> None:
    if is_real_dir(path):
        path.chmod(DIR_MODE)
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

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "r+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
