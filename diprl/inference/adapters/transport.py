"""How a version reaches a replica without a shared disk: packed bytes, a verified local cache, Ray's object store.

`pack_adapter` turns a version into `{file name: bytes}`, and `materialize` writes such a bundle
into a replica's local cache after checking every hash, with the store's temp-and-rename
discipline. `LocalAdapterCache` is what a replica asks for a version: the shared store when it has
it, else its own cache, else a fetch. Every failure is an `AdapterError` naming the adapter and the
file, so a serving replica rejects one request and keeps running.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diprl.atomic_io import fsync_dir
from diprl.inference.adapters import _fs
from diprl.inference.adapters.files import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    adapter_shape,
    read_config,
    tensor_specs_of_bytes,
)
from diprl.inference.adapters.manifest import AdapterVersion, version_from_manifest
from diprl.inference.adapters.names import (
    AdapterError,
    AdapterRef,
    CorruptAdapter,
    UnknownAdapter,
    require_adapter,
)
from diprl.inference.adapters.pins import write_pin
from diprl.inference.adapters.store import AdapterStore


def pack_adapter(version: AdapterVersion) -> dict[str, bytes]:
    """`{file name: bytes}` of a version, manifest included, for `ray.put` or any byte transport.

    The bytes are checked against the manifest while read, so corruption on the publisher's disk
    is caught here rather than shipped to every replica.
    """
    packed = {}
    for f in version.files:
        data = (version.path / f.name).read_bytes()
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise CorruptAdapter(f"{version.name}: {version.path / f.name} does not match its manifest")
        packed[f.name] = data
    packed[MANIFEST_FILE] = (version.path / MANIFEST_FILE).read_bytes()
    return packed


def check_packed(packed: Mapping[str, bytes]) -> AdapterVersion:
    """The version a bundle claims to be, after checking every byte; raises before anything is written."""
    if not isinstance(packed, Mapping) or not all(isinstance(v, bytes) for v in packed.values()):
        raise CorruptAdapter("packed adapter must be a mapping of file names to bytes")
    if MANIFEST_FILE not in packed:
        raise CorruptAdapter(f"packed adapter has no {MANIFEST_FILE}")
    version = version_from_manifest(packed[MANIFEST_FILE], Path(), "packed adapter")
    where = f"packed adapter {version.name}"
    expected = {*(f.name for f in version.files), MANIFEST_FILE}  # the PEFT files, perhaps the canary
    if set(packed) != expected:
        raise CorruptAdapter(f"{where}: expected files {sorted(expected)}, got {sorted(packed)}")
    for f in version.files:
        data = packed[f.name]
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise CorruptAdapter(f"{where}: {f.name} does not match the sha256 in its manifest")
    config = read_config(packed[CONFIG_FILE], where)
    specs = tensor_specs_of_bytes(packed[WEIGHTS_FILE], where)
    shape = adapter_shape(config, specs, where, version.base_model)
    if shape.rank != version.rank or shape.target_modules != version.target_modules:
        raise CorruptAdapter(f"{where}: manifest rank/modules disagree with the adapter files")
    return version


def materialize(packed: Mapping[str, bytes], cache_root: Path | str) -> AdapterVersion:
    """Write a packed version to `cache_root/<policy>/v<N>` and return it, verified.

    Idempotent: an intact copy with the same hashes is reused. A cached copy that is damaged, or
    that holds different bytes under the same name (a cache shared with another store), is moved
    aside and replaced; cache entries are disposable, store versions are not. Nothing is written
    unless every hash in the bundle checks out.
    """
    claimed = check_packed(packed)
    cache = AdapterStore(cache_root)
    target = cache.root / claimed.ref.policy / f"v{claimed.ref.version}"
    existing = _cached(cache, claimed)
    if existing is not None:
        return existing
    if target.parent.is_symlink():
        raise CorruptAdapter(f"{target.parent} is a symlink: the replica cache refuses to write through it")
    _fs.make_dirs(target.parent)
    _fs.sweep_stale_tmp(target.parent)
    tmp = target.parent / f"{_fs.TMP_PREFIX}{uuid.uuid4().hex}"
    trash: Path | None = None
    _fs.make_dir(tmp)
    try:
        for name, data in packed.items():
            _fs.write_bytes(tmp / name, data)
        _fs.freeze(tmp)
        fsync_dir(tmp)
        if target.exists() or target.is_symlink():
            if _cached(cache, claimed) is not None:
                return cache.resolve(claimed.name)
            trash = target.parent / f"{_fs.TMP_PREFIX}old-{uuid.uuid4().hex}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, trash)
        # The cache pins what it verified, as a publisher does, so a later edit of the copy is refused.
        write_pin(cache.root, claimed.ref, claimed.fingerprint)
        try:
            os.rename(tmp, target)
        except OSError:
            if _cached(cache, claimed) is None:  # a concurrent materialize won; it must be ours
                raise
        fsync_dir(target.parent)
    finally:
        for leftover in (tmp, trash):
            if leftover is not None and (leftover.exists() or leftover.is_symlink()):
                _fs.rmtree_frozen(leftover)
    return cache.resolve(claimed.name)


def _cached(cache: AdapterStore, claimed: AdapterVersion) -> AdapterVersion | None:
    try:
        version = cache.resolve(claimed.name)
    except AdapterError:
        return None
    return version if version.fingerprint == claimed.fingerprint else None


Fetch = Callable[[str], Mapping[str, bytes]]
"""Returns the packed bytes of a version by name (e.g. `ray.get` of an object ref); raises
`UnknownAdapter` for a name it does not have."""


class LocalAdapterCache:
    """Where a replica gets a local, verified copy of a version on first use.

    The shared store is preferred (no copy at all); otherwise the version is fetched once as
    packed bytes and materialized under `cache_root`, and later calls find it there. Every `get`
    re-hashes the files it returns (it is called when the engine loads a version). One lock per
    name, so concurrent first requests for a version fetch it once. Names are unique within one
    store only, so give each store (each run) its own `cache_root`.
    """

    def __init__(self, cache_root: Path | str, fetch: Fetch | None = None, store: AdapterStore | None = None) -> None:
        if fetch is None and store is None:
            raise ValueError("LocalAdapterCache needs a shared store, a fetch function, or both")
        self.cache = AdapterStore(cache_root)
        self.fetch = fetch
        self.store = store
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, name: str) -> AdapterVersion:
        """A verified local copy of `name`; raises `AdapterError` (never anything that kills a replica)."""
        ref = require_adapter(name)
        with self._guard:
            lock = self._locks.setdefault(ref.name, threading.Lock())
        with lock:
            try:
                return self._get(ref)
            except AdapterError:
                raise
            except (OSError, RecursionError, MemoryError) as err:
                raise AdapterError(f"cannot read adapter {ref.name}: {type(err).__name__}: {err}") from err

    def _get(self, ref: AdapterRef) -> AdapterVersion:
        shared_error: AdapterError | None = None
        if self.store is not None:
            try:
                return self.store.resolve(ref.name)
            except (UnknownAdapter, CorruptAdapter) as err:
                if self.fetch is None:
                    raise
                shared_error = err
        try:
            return self.cache.resolve(ref.name)
        except AdapterError:
            pass
        assert self.fetch is not None
        detail = f" (shared store: {shared_error})" if shared_error is not None else ""
        try:
            packed = self.fetch(ref.name)
        except AdapterError:
            raise
        except KeyError as err:
            if isinstance(shared_error, CorruptAdapter):  # the shared copy exists but is damaged: say so
                raise CorruptAdapter(f"{shared_error} (and the fetch source does not have {ref.name})") from err
            raise UnknownAdapter(f"unknown adapter {ref.name}: the fetch source does not have it{detail}") from err
        except Exception as err:  # a transport failure must fail this request only
            raise AdapterError(f"cannot fetch adapter {ref.name}: {type(err).__name__}: {err}{detail}") from err
        try:
            version = materialize(packed, self.cache.root)
        except OSError as err:
            raise AdapterError(f"cannot write adapter {ref.name} into {self.cache.root}: {err}") from err
        if version.ref != ref:
            raise CorruptAdapter(f"fetched bytes for {ref.name} are adapter {version.name}")
        return version


def put_adapter(version: AdapterVersion) -> Any:
    """`ray.put` of the packed version: an ObjectRef to hand to replicas (Ray imported lazily)."""
    import ray

    return ray.put(pack_adapter(version))


def object_store_fetch(refs: Mapping[str, Any], timeout_s: float = 120.0) -> Fetch:
    """A `Fetch` over a mapping `name -> ObjectRef` of packed versions (kept current by whoever
    publishes); unknown names raise `UnknownAdapter` listing what the mapping holds."""

    def fetch(name: str) -> Mapping[str, bytes]:
        import ray

        ref = require_adapter(name)
        if ref.name not in refs:
            raise UnknownAdapter(
                f"unknown adapter {ref.name} (object store holds: {', '.join(sorted(refs)) or 'none'})"
            )
        packed = ray.get(refs[ref.name], timeout=timeout_s)
        if not isinstance(packed, Mapping):
            raise CorruptAdapter(f"object store entry for {ref.name} is a {type(packed).__name__}, not packed files")
        return packed

    return fetch
