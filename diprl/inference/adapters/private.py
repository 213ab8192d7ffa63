"""A replica's private copies of verified versions: the only adapter paths it ever gives vLLM.

vLLM reads a LoRA from the path in its `LoRARequest` when the adapter is added, and again whenever
its own CPU cache has evicted it and a request needs it back. Handing it the store's path would let
bytes that changed after our check (or after the pin check of a later load) reach the engine. So a
replica copies each version it loads into a directory only it can write, checking every byte it
copies against the hashes that matched the version's pin, and vLLM reads that copy.

Copies are content-addressed (`<root>/<fingerprint>/`): two names for identical bytes share one,
and each copy is counted per user and removed when the last loaded adapter using it is unloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from collections import Counter
from pathlib import Path

from diprl.inference.adapters import _fs
from diprl.inference.adapters.manifest import AdapterVersion
from diprl.inference.adapters.names import CorruptAdapter


class PrivateCopies:
    """Content-addressed copies of verified versions under a directory private to this process.

    `acquire` is called from worker threads (copying is file work, kept off the event loop), and
    `release` from the loop; one lock guards the counts, never the copying itself, so copies of
    different adapters proceed side by side.
    """

    def __init__(self, root: Path | str | None = None) -> None:
        if root is None:
            self.root = Path(tempfile.mkdtemp(prefix="diprl-loras-"))
        else:
            self.root = Path(root)
            _fs.make_dirs(self.root)
        self.root.chmod(0o700)
        self._users: Counter[str] = Counter()
        self._guard = threading.Lock()

    def acquire(self, version: AdapterVersion) -> Path:
        """The private copy of `version` (made now if this process has none); count one more user.

        Every byte copied is hashed and compared with the version's file hashes (those its pin
        fingerprints), so the copy is exactly what was verified even if the source changes meanwhile.
        """
        key = version.fingerprint
        target = self.root / key
        with self._guard:
            self._users[key] += 1
            if _fs.is_real_dir(target):
                return target
        try:
            tmp = self.root / f"{_fs.TMP_PREFIX}{uuid.uuid4().hex}"
            _fs.make_dir(tmp)
            try:
                for f in version.files:
                    source = version.path / f.name
                    try:
                        data = _fs.read_bytes(source)
                    except OSError as err:
                        raise CorruptAdapter(f"{version.name}: cannot read {source} ({err.strerror})") from None
                    if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
                        raise CorruptAdapter(f"{version.name}: {source} changed while it was being loaded")
                    _fs.write_bytes(tmp / f.name, data)
                _fs.freeze(tmp)
                with self._guard:
                    if not _fs.is_real_dir(target):
                        os.rename(tmp, target)
            finally:
                if tmp.exists():
                    _fs.rmtree_frozen(tmp)
        except BaseException:
            self.release(key)
            raise
        return target

    def release(self, fingerprint: str) -> None:
        """One user fewer; the copy is removed once no loaded adapter uses it."""
        with self._guard:
            self._users[fingerprint] -= 1
            if self._users[fingerprint] > 0:
                return
            del self._users[fingerprint]
            target = self.root / fingerprint
            if not _fs.is_real_dir(target):
                return
            trash = self.root / f"{_fs.TMP_PREFIX}gone-{uuid.uuid4().hex}"
            os.rename(target, trash)
        _fs.rmtree_frozen(trash)

    def users(self, fingerprint: str) -> int:
        with self._guard:
            return self._users[fingerprint]

    def close(self) -> None:
        """Remove every copy (the replica is shutting down)."""
        with self._guard:
            self._users.clear()
        with contextlib.suppress(OSError):
            for entry in self.root.iterdir():
                with contextlib.suppress(OSError):
                    entry.chmod(_fs.DIR_MODE)
            shutil.rmtree(self.root, ignore_errors=True)
