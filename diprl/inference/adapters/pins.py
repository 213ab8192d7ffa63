"""Pins: each version's fingerprint, recorded once when it is published, away from its files.

A manifest sits beside the files it describes, so whatever rewrites the files (a tool that
"repairs" a version, a copy of other weights into `v3`) can rewrite the manifest to match, and a
check against the manifest alone then passes. The pin is a second record of the fingerprint (the
SHA-256 over every file's name, size and hash), written by the publisher into the store root's
`.pins/` directory before the version becomes visible, and never by anything that edits a version.
Reading a version compares its manifest (already checked against the bytes) with the pin: a version
changed after publishing is refused by name, whatever its manifest now says.

A writer that can rewrite a version's files and its manifest can rewrite its pin too: all three are
in the store. So a pin is a keyed MAC, `hmac-sha256:<64 hex digits>` over the version's name and
fingerprint, under a key kept outside every store: `$DIPRL_PIN_KEY_FILE`, else `<diprl cache>/pin.key`
(mode 0600, made by the first publish that needs it). Without the key a forged pin cannot be made. The
stores this machine keyed are recorded beside the key (`<cache>/keyed-stores/<hash of the path>`), and a
plain fingerprint in one of them is refused. A store made before keyed pins (plain pins, not recorded)
keeps plain pins: keying it would refuse every version it holds.

Nodes that read one store on a shared filesystem need the same key. A training run carries it: its driver
reads (or makes) the key of its own machine once (`load_key`) and hands it, as a `PinKey`, to every actor
that writes or checks pins, which installs it for its process (`use_key`); an installed key takes
precedence over the file, so no other node needs one. The driver's own process holds it only while the run
lasts (`key_installed`): what that process does after the run reads the file again. A tool run outside a
training run (evaluation, a server of its own) reads the file, on each node: point `DIPRL_PIN_KEY_FILE` at a
copy on each (a replica that finds a MAC and no key refuses it).

Layout: `root/.pins/<policy>@v<N>` holds the pin and a newline. The name comes from a parsed
`PolicyRef` (an adapter version), so a pin path can never leave `.pins/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from diprl.atomic_io import fsync_dir
from diprl.inference.adapters import _fs
from diprl.inference.adapters.manifest import AdapterVersion
from diprl.inference.adapters.names import CorruptAdapter
from diprl.messages import PolicyRef

PINS_DIR = ".pins"
KEY_ENV = "DIPRL_PIN_KEY_FILE"
MAC_PREFIX = "hmac-sha256:"
_FINGERPRINT_RE = re.compile(r"(hmac-sha256:)?[0-9a-f]{64}\n?", re.ASCII)
_KEY_RE = re.compile(rb"[0-9a-f]{64}\n?", re.ASCII)
_MAX_PIN_BYTES = 128


@dataclass(frozen=True)
class PinKey:
    """A pin key in memory, as a run's driver hands it to its actors (Ray pickles it into their constructor
    arguments). Its repr shows no digit of the key, so a config, a log line or a traceback that prints
    the object prints nothing secret; never write `secret` anywhere."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.secret, bytes) and _KEY_RE.fullmatch(self.secret) and len(self.secret) == 64):
            raise ValueError("a pin key is 64 lowercase hex digits")

    def digest(self) -> str:
        """Which key this is, safe to write down: a one-way digest that tells two keys apart and reveals
        nothing of either (a run directory records it to refuse a resume under another key)."""
        return hashlib.sha256(b"diprl pin key id\n" + self.secret).hexdigest()[:32]


_installed: PinKey | None = None  # this process's key, handed by a training run's driver (`use_key`)


def use_key(key: PinKey | None) -> None:
    """Sign and check pins in this process with `key` from now on, whatever `key_path()` holds; None installs
    nothing (the file stays in charge). An actor of a training run calls this with the key its driver handed
    it before it touches a store: then its node needs no key file."""
    global _installed
    if key is not None:
        _installed = key


@contextlib.contextmanager
def key_installed(key: PinKey) -> Iterator[PinKey]:
    """Sign and check pins in this process with `key` while the block runs, then put back the key installed
    before it (or none). A training run's driver holds its key this way: the driver may be a process that goes
    on after the run (a sweep of runs, a test, a notebook), and a finished run's key must not outlive it and
    sign or accept versions of the next store it touches."""
    global _installed
    previous, _installed = _installed, key
    try:
        yield key
    finally:
        _installed = previous


def load_key() -> PinKey:
    """This machine's key (`key_path()`), made there when there is none: what a training run's driver reads
    once and hands to its actors."""
    path = key_path()
    secret = _read_key(path) or _new_key(path)
    if secret is None:  # made and gone at once (removed by someone else): nothing to sign with
        raise CorruptAdapter(f"the pin key {path} vanished as it was made")
    return PinKey(secret)


def _key_home() -> Path:
    from diprl.cache import cache_root

    return cache_root()


def key_path() -> Path:
    """Where this machine's pin key lives: `$DIPRL_PIN_KEY_FILE`, else the diprl cache (outside every store).
    A key installed with `use_key` is used instead."""
    named = os.environ.get(KEY_ENV)
    return Path(named).expanduser() if named else _key_home() / "pin.key"


def _marker(root: Path) -> Path:
    digest = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:32]
    return _key_home() / "keyed-stores" / digest


def _read_small(path: Path, limit: int, cannot: str) -> bytes | None:
    """Up to `limit` bytes of `path` (a link is not followed), None when it is missing; `CorruptAdapter`
    saying `cannot` (what could not be read) when it is unreadable."""
    try:
        return _fs.read_bytes(path, limit)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CorruptAdapter(f"{cannot} {path} ({err.strerror})") from None


def _read_key(path: Path) -> bytes | None:
    raw = _read_small(path, 129, "cannot read the pin key")
    if raw is None:
        return None
    if not _KEY_RE.fullmatch(raw):
        raise CorruptAdapter(f"the pin key {path} is not a key (64 hex digits)")
    return raw.strip()


def _current_key() -> bytes | None:
    """The key pins are checked with: the installed one, else the file's (None: neither)."""
    return _installed.secret if _installed is not None else _read_key(key_path())


def _legacy(root: Path) -> bool:
    """A store made before keyed pins: not recorded as keyed, and holding a plain pin."""
    if _marker(root).exists():
        return False
    try:
        entries = [e for e in os.scandir(root / PINS_DIR) if not e.name.startswith(_fs.TMP_PREFIX)]
    except OSError:
        return False
    for entry in entries:
        with contextlib.suppress(OSError), open(entry.path, "rb") as fh:
            if not fh.read(len(MAC_PREFIX)).startswith(MAC_PREFIX.encode()):
                return True
    return False


def _new_key(path: Path) -> bytes | None:
    _fs.make_dirs(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another publisher made it meanwhile
        return _read_key(path)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_hex(32).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)
    return _read_key(path)


def publishing_key(root: Path) -> bytes | None:
    """The key a publisher into `root` signs pins with (made if needed, and the store recorded as keyed);
    None for a store made before keyed pins."""
    if _legacy(root):
        return None
    key = _current_key() or _new_key(key_path())
    marker = _marker(root)
    if not marker.exists():
        _fs.make_dirs(marker.parent)
        _fs.write_bytes(marker, f"{Path(root).resolve()}\n".encode())
    return key


def _mac(key: bytes, ref: PolicyRef, fingerprint: str) -> str:
    return MAC_PREFIX + hmac.new(key, f"{ref}\n{fingerprint}".encode(), hashlib.sha256).hexdigest()


def pin_path(root: Path, ref: PolicyRef) -> Path:
    return root / PINS_DIR / str(ref)


def write_pin(root: Path, ref: PolicyRef, fingerprint: str) -> None:
    """Record `fingerprint` as the pin of `ref`, atomically (temp file, fsync, rename).

    Only a publisher calls this, for a number no complete version holds yet (it holds the store's
    publish lock), so replacing an existing pin only ever replaces one a crashed publish left.
    """
    if not _FINGERPRINT_RE.fullmatch(fingerprint) or fingerprint.startswith(MAC_PREFIX):
        raise ValueError(f"not a fingerprint: {fingerprint!r}")
    key = publishing_key(root)
    pin = _mac(key, ref, fingerprint) if key is not None else fingerprint
    pins = root / PINS_DIR
    if pins.is_symlink():
        raise CorruptAdapter(f"{pins} is a symlink: the store refuses to write pins through it")
    _fs.make_dirs(pins)
    target = pin_path(root, ref)
    tmp = pins / f"{_fs.TMP_PREFIX}{ref}-{uuid.uuid4().hex}"
    try:
        _fs.write_bytes(tmp, f"{pin}\n".encode())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(pins)


def read_pin(root: Path, ref: PolicyRef) -> str | None:
    """The pin of `ref` (a MAC, or a plain fingerprint in a store made before keyed pins), or None when there
    is none; `CorruptAdapter` when it is unreadable."""
    path = pin_path(root, ref)
    raw = _read_small(path, _MAX_PIN_BYTES + 1, f"{ref}: cannot read its pin")
    if raw is None:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if len(raw) > _MAX_PIN_BYTES or not _FINGERPRINT_RE.fullmatch(text):
        raise CorruptAdapter(f"{ref}: its pin {path} is not a fingerprint (64 hex digits)")
    return text.strip()


def check_pin(root: Path, version: AdapterVersion) -> None:
    """Refuse `version` unless its fingerprint equals the one pinned when it was published."""
    pinned = read_pin(root, version.ref)
    if pinned is None:
        raise CorruptAdapter(
            f"{version.name}: no pin in {root / PINS_DIR} (every version is pinned when it is published; "
            "one without a pin was not published by this store, or its pin was removed): publish it again"
        )
    if pinned.startswith(MAC_PREFIX):
        key = _current_key()
        if key is None:
            raise CorruptAdapter(
                f"{version.name}: its pin is keyed and this process has no pin key: none was handed to it (a "
                f"training run's driver hands its key to its actors) and {key_path()} does not exist (outside a "
                f"run, nodes that share one store need the same key file: set {KEY_ENV})"
            )
        expected = _mac(key, version.ref, version.fingerprint)
    elif _marker(root).exists():
        raise CorruptAdapter(
            f"{version.name}: its pin ({pin_path(root, version.ref)}) is a plain fingerprint in a store whose pins "
            "are keyed: it was not written by this store's publisher"
        )
    else:
        expected = version.fingerprint
    if not hmac.compare_digest(pinned, expected):
        raise CorruptAdapter(
            f"{version.name}: its files do not match the fingerprint pinned when it was published "
            f"({pin_path(root, version.ref)}); the version was changed afterwards, manifest included, or pinned "
            "under another pin key than this process's"
        )
