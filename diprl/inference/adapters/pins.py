"""Pins: each version's fingerprint, recorded once when it is published, away from its files.

A manifest sits beside the files it describes, so whatever rewrites the files (a tool that
"repairs" a version, a copy of other weights into `v3`) can rewrite the manifest to match, and a
check against the manifest alone then passes. The pin is a second record of the fingerprint (the
SHA-256 over every file's name, size and hash), written by the publisher into the store root's
`.pins/` directory before the version becomes visible, and never by anything that edits a version.
Reading a version compares its manifest (already checked against the bytes) with the pin: a version
changed after publishing is refused by name, whatever its manifest now says.

Layout: `root/.pins/<policy>@v<N>` holds the fingerprint as 64 hex digits and a newline. The name
comes from a validated `AdapterRef`, so a pin path can never leave `.pins/`.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path

from diprl.atomic_io import fsync_dir
from diprl.inference.adapters import _fs
from diprl.inference.adapters.manifest import AdapterVersion
from diprl.inference.adapters.names import AdapterRef, CorruptAdapter

PINS_DIR = ".pins"
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}\n?", re.ASCII)
_MAX_PIN_BYTES = 128


def pin_path(root: Path, ref: AdapterRef) -> Path:
    return root / PINS_DIR / ref.name


def write_pin(root: Path, ref: AdapterRef, fingerprint: str) -> None:
    """Record `fingerprint` as the pin of `ref`, atomically (temp file, fsync, rename).

    Only a publisher calls this, for a number no complete version holds yet (it holds the store's
    publish lock), so replacing an existing pin only ever replaces one a crashed publish left.
    """
    if not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise ValueError(f"not a fingerprint: {fingerprint!r}")
    pins = root / PINS_DIR
    if pins.is_symlink():
        raise CorruptAdapter(f"{pins} is a symlink: the store refuses to write pins through it")
    _fs.make_dirs(pins)
    target = pin_path(root, ref)
    tmp = pins / f"{_fs.TMP_PREFIX}{ref.name}-{uuid.uuid4().hex}"
    try:
        _fs.write_bytes(tmp, f"{fingerprint}\n".encode())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(pins)


def read_pin(root: Path, ref: AdapterRef) -> str | None:
    """The pinned fingerprint of `ref`, or None when there is no pin; `CorruptAdapter` when it is unreadable."""
    path = pin_path(root, ref)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CorruptAdapter(f"{ref.name}: cannot read its pin {path} ({err.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(_MAX_PIN_BYTES + 1)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if len(raw) > _MAX_PIN_BYTES or not _FINGERPRINT_RE.fullmatch(text):
        raise CorruptAdapter(f"{ref.name}: its pin {path} is not a fingerprint (64 hex digits)")
    return text.strip()


def check_pin(root: Path, version: AdapterVersion) -> None:
    """Refuse `version` unless its fingerprint equals the one pinned when it was published."""
    pinned = read_pin(root, version.ref)
    if pinned is None:
        raise CorruptAdapter(
            f"{version.name}: no pin in {root / PINS_DIR} (every version is pinned when it is published; "
            "one without a pin was not published by this store, or its pin was removed): publish it again"
        )
    if pinned != version.fingerprint:
        raise CorruptAdapter(
            f"{version.name}: its files do not match the fingerprint pinned when it was published "
            f"({pin_path(root, version.ref)}); the version was changed afterwards, manifest included"
        )
