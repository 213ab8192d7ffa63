"""`AdapterStore`: immutable, verified adapter versions under one directory.

Layout of a store (the directory is the source of truth; `index.json` is a convenience):

    root/index.json                           every policy's versions, rewritten atomically
    root/<policy>/v<N>/adapter_config.json    PEFT files, copied byte for byte, read-only for the owner alone
    root/<policy>/v<N>/adapter_model.safetensors
    root/<policy>/v<N>/canary.json            optional: the weights' canary completions (`diprl.inference.canary`)
root/<policy>/v<N>/DIPRL_MANIFEST.json    size + sha256 of each file, rank, alpha, modules, base
    root/<policy>/.tmp-<uuid>/                a publish in progress (never listed)
    root/.pins/<policy>@v<N>                  the version's pin (a MAC of its fingerprint, `pins`), made at publish
    root/<policy>/best.json                   optional: the alias `<policy>@best`, the version a run found best

Publishing writes a complete version into a temp directory, fsyncs it, pins its fingerprint, and
claims the next number with one `rename` (under the store's publish lock, so the pin written for a
number is that publisher's): Linux refuses to rename a directory onto a non-empty one, so two
publishers can never share a number and a reader never sees half a version, nor one without its
pin. Versions are never rewritten; a crashed publish leaves only a temp directory that no listing
shows (and perhaps a pin for a number no version holds, replaced by the next publish). Numbers come
from complete versions only, so a stray `v999999999` directory cannot exhaust them.

Nothing under the root may be a symlink: a linked policy or version directory could point outside
the store (or at files an attacker controls), so it is refused as unknown rather than served.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from diprl.adapter_files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from diprl.atomic_io import fsync_dir
from diprl.inference.adapters import _fs
from diprl.inference.adapters.files import (
    CANARY_FILE,
    MANIFEST_FILE,
    adapter_shape,
    check_compatible,
    check_finite_weights,
    check_weights_fit_base,
    read_config,
    tensor_specs_of_file,
)
from diprl.inference.adapters.manifest import (
    AdapterFile,
    AdapterVersion,
    fingerprint,
    manifest_dict,
    version_from_manifest,
)
from diprl.inference.adapters.names import (
    BASE,
    MAX_VERSION,
    POLICY_PATTERN,
    VERSION_DIR_RE,
    AdapterError,
    CorruptAdapter,
    InvalidAdapterName,
    UnknownAdapter,
    model_ref,
    require_adapter,
    validate_policy_name,
)
from diprl.inference.adapters.pins import check_pin, write_pin
from diprl.messages import PolicyRef

BEST = "best"
ALIASES = (BEST,)
"""Names a store may point at one of a policy's versions: `<policy>@best` is the best version a run's league
found (`LeagueManager.observe_evaluation`), marked by the training driver. An alias is a pointer, not a copy:
the version it names is verified (manifest, pin) like any other when it is loaded."""
ALIAS_FORMAT = "diprl-adapter-alias/1"
_ALIAS_RE = re.compile(rf"(?P<policy>{POLICY_PATTERN})@(?P<alias>{'|'.join(ALIASES)})", re.ASCII)
_ALIAS_MAX_BYTES = 4096
INDEX_FILE = "index.json"
INDEX_FORMAT = "diprl-adapter-index/1"
PUBLISH_LOCK = ".publish.lock"


class SavesPretrained(Protocol):
    """A PEFT model (or anything) that writes `adapter_config.json` + safetensors weights."""

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any: ...


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def version_numbers(policy_dir: Path) -> list[int]:
    """Numbers of the complete versions under `policy_dir`: real `v<N>` directories holding a manifest.

    Anything else (a stray empty `v999999999`, a file, a symlink) is ignored for listing and for
    numbering; a publish that collides with one simply takes the next number.
    """
    if not _fs.is_real_dir(policy_dir):
        return []
    try:
        entries = list(os.scandir(policy_dir))
    except OSError:
        return []
    numbers = []
    for entry in entries:
        match = VERSION_DIR_RE.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        manifest = Path(entry.path, MANIFEST_FILE)
        if manifest.is_file() and not manifest.is_symlink():
            numbers.append(int(match["version"]))
    return sorted(numbers)


class AdapterStore:
    """Adapter versions under one root directory (local disk or a shared mount).

    Read operations never write, so replicas can mount the root read-only. `resolve` hashes every
    file each time it is called: it is called when a replica loads a version into its engine, and a
    cache keyed on file metadata would trust a byte flipped with its mtime restored.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AdapterStore({str(self.root)!r})"

    check_compatible = staticmethod(check_compatible)

    # ---- listing ------------------------------------------------------------------------

    def versions(self, policy: str) -> list[PolicyRef]:
        """Complete versions of `policy`, oldest first (read from the directory, not the index)."""
        validate_policy_name(policy)
        return [PolicyRef.adapter(policy, n) for n in version_numbers(self.root / policy)]

    def latest(self, policy: str) -> PolicyRef | None:
        refs = self.versions(policy)
        return refs[-1] if refs else None

    def policies(self) -> list[str]:
        """Policies with at least one complete version, sorted (symlinked policy directories excluded)."""
        try:
            entries = sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [
            name
            for name in entries
            if re.fullmatch(POLICY_PATTERN, name, re.ASCII) and name != BASE and version_numbers(self.root / name)
        ]

    def __contains__(self, name: object) -> bool:
        try:
            ref = model_ref(name)
        except InvalidAdapterName:
            return False
        return ref.is_adapter and ref.version in version_numbers(self.root / ref.policy)

    # ---- index ----------------------------------------------------------------------------

    def index(self) -> dict[str, Any]:
        """The store's contents as `index.json` should say, computed from the directory."""
        return {
            "format": INDEX_FORMAT,
            "policies": {p: [r.version for r in self.versions(p)] for p in self.policies()},
        }

    def refresh_index(self) -> bool:
        """Rewrite `index.json` if it is missing or disagrees with the directory; True if it was.

        Called after every publish; tools may call it too. Holds a lock so two publishers cannot
        interleave scan and write and drop each other's new version.
        """
        _fs.make_dirs(self.root)
        _fs.sweep_stale_tmp(self.root)
        with _fs.locked(self.root / ".index.lock"):
            current = self.index()
            try:
                on_disk = json.loads((self.root / INDEX_FILE).read_text())
                if isinstance(on_disk, dict) and on_disk.get("policies") == current["policies"]:
                    return False
            except (OSError, ValueError, RecursionError):
                pass
            _fs.write_json_atomic(self.root / INDEX_FILE, {**current, "updated": now()})
            return True

    # ---- aliases ----------------------------------------------------------------------------

    def set_alias(self, policy: str, alias: str, version: str, **meta: Any) -> None:
        """Point `<policy>@<alias>` at `version`, one of `policy`'s complete versions (`root/<policy>/<alias>.json`,
        replaced atomically); `meta` (the step, the score) is kept beside it for whoever reads the file."""
        validate_policy_name(policy)
        if alias not in ALIASES:
            raise InvalidAdapterName(f"unknown alias {alias!r} (known: {', '.join(ALIASES)})")
        ref = require_adapter(version)
        if ref.policy != policy or version not in self:
            raise UnknownAdapter(f"{policy}@{alias} cannot name {version}: not a published version of {policy!r}")
        record = {"format": ALIAS_FORMAT, "alias": alias, "version": str(ref), "updated": now(), **meta}
        _fs.write_json_atomic(self.root / policy / f"{alias}.json", record)

    def alias(self, policy: str, alias: str) -> PolicyRef | None:
        """The version `<policy>@<alias>` names, or None when no version was marked; `CorruptAdapter` for a file
        that is not an alias of this policy (malformed, too large, a symlink, another policy's version)."""
        validate_policy_name(policy)
        path = self.root / policy / f"{alias}.json"
        try:
            raw = _fs.read_bytes(path, _ALIAS_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as err:  # a symlink (O_NOFOLLOW: ELOOP) or unreadable
            raise CorruptAdapter(f"{policy}@{alias}: cannot read {path}: {err}") from None
        try:
            if len(raw) > _ALIAS_MAX_BYTES:
                raise ValueError(f"larger than {_ALIAS_MAX_BYTES} bytes")
            record = json.loads(raw)
            if not isinstance(record, dict) or record.get("format") != ALIAS_FORMAT or record.get("alias") != alias:
                raise ValueError(f"not a {ALIAS_FORMAT} record for {alias!r}")
            named = record.get("version")
            if not isinstance(named, str):
                raise ValueError(f"its version is {named!r}, not a version name")
            ref = require_adapter(named)
            if ref.policy != policy:
                raise ValueError(f"it names {ref}, a version of another policy")
        except (ValueError, RecursionError, AdapterError) as err:
            raise CorruptAdapter(f"{policy}@{alias}: {path} is not a valid alias: {err}") from None
        return ref

    def resolve_alias(self, text: str) -> str:
        """`<policy>@<alias>` (`main@best`) as the version it names (`main@v12`); any other text unchanged.
        `UnknownAdapter` when no version of the policy was marked."""
        match = _ALIAS_RE.fullmatch(text)
        if match is None:
            return text
        ref = self.alias(match["policy"], match["alias"])
        if ref is None:
            raise UnknownAdapter(
                f"{text}: no version of {match['policy']!r} is marked {match['alias']!r} in {self.root} (a training "
                "run marks main's best version after an evaluation finds it)"
            )
        return str(ref)

    # ---- publishing -------------------------------------------------------------------------

    def publish(
        self,
        policy: str,
        source: Path | str | SavesPretrained,
        base_model: str | None = None,
        canary: bytes | None = None,
    ) -> PolicyRef:
        """Store a new immutable version of `policy` and return its ref (`policy@v<N>`, N = latest + 1).

        `source` is a directory written by PEFT's `save_pretrained` (safetensors) or a PEFT model,
        which is saved here. `base_model` overrides the config's `base_model_name_or_path`, which
        is empty for models built in memory. The files are validated before a number is claimed
        (config, safetensors header, dtypes, and, when the base model is a local directory, every
        module's shapes against its weights), so a bad adapter never becomes a version. `canary` is the
        weights' canary (`diprl.inference.canary`), stored as `canary.json` and fingerprinted with them;
        one that does not parse is refused here, before a number is claimed.
        """
        validate_policy_name(policy)
        if base_model is not None and (not isinstance(base_model, str) or not base_model.strip()):
            raise AdapterError(f"base_model must be a non-empty string or None, got {base_model!r}")
        policy_dir = self.root / policy
        if policy_dir.is_symlink() or (policy_dir.exists() and not _fs.is_real_dir(policy_dir)):
            raise CorruptAdapter(f"{policy_dir} is a symlink or not a directory: the store refuses to publish there")
        if not policy_dir.is_dir():
            _fs.make_dirs(self.root)
            _fs.make_dir(policy_dir, exist_ok=True)
            fsync_dir(self.root)
        _fs.sweep_stale_tmp(policy_dir)
        tmp = policy_dir / f"{_fs.TMP_PREFIX}{uuid.uuid4().hex}"
        _fs.make_dir(tmp)
        try:
            if isinstance(source, str | Path):
                ref = self._publish_from(Path(source), tmp, policy, base_model, canary)
            else:
                with tempfile.TemporaryDirectory(prefix=_fs.TMP_PREFIX, dir=policy_dir) as saved:
                    source.save_pretrained(saved, safe_serialization=True)
                    ref = self._publish_from(Path(saved), tmp, policy, base_model, canary)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.refresh_index()
        return ref

    def _publish_from(
        self, src: Path, tmp: Path, policy: str, base_model: str | None, canary: bytes | None
    ) -> PolicyRef:
        where = f"publishing {policy} from {src}"
        if canary is not None:
            from diprl.inference.canary import Canary  # the canary module imports this package

            Canary.from_bytes(canary, where)
        for name in ADAPTER_FILES:
            if not (src / name).is_file():
                hint = " (save with safe_serialization=True)" if (src / "adapter_model.bin").exists() else ""
                raise CorruptAdapter(f"{where}: {name} is missing{hint}")
        files = [AdapterFile(name, *_fs.copy_hashing(src / name, tmp / name)) for name in ADAPTER_FILES]
        if canary is not None:
            _fs.write_bytes(tmp / CANARY_FILE, canary)
            files.append(AdapterFile(CANARY_FILE, len(canary), hashlib.sha256(canary).hexdigest()))
        config = read_config((tmp / CONFIG_FILE).read_bytes(), where)
        specs = tensor_specs_of_file(tmp / WEIGHTS_FILE, where)
        shape = adapter_shape(config, specs, where, base_model)
        if shape.base_model is not None:
            check_weights_fit_base(specs, shape.base_model, where)
        check_finite_weights(tmp / WEIGHTS_FILE, where)  # the bytes that would be stored, after the cheap checks
        created = now()
        # One publisher at a time claims a number, so the pin written for it before the rename can
        # only replace a pin that a crashed publish left (no complete version holds that number).
        with _fs.locked(self.root / PUBLISH_LOCK):
            number = max(version_numbers(tmp.parent), default=0) + 1
            while True:
                if number > MAX_VERSION:
                    raise AdapterError(f"{where}: policy {policy!r} has run out of version numbers")
                ref = PolicyRef.adapter(policy, number)
                # The manifest names the version, so it is rewritten whenever a race moves the number.
                _fs.write_bytes(
                    tmp / MANIFEST_FILE, json.dumps(manifest_dict(ref, shape, files, created), indent=1).encode()
                )
                _fs.freeze(tmp)
                fsync_dir(tmp)
                target = tmp.parent / f"v{number}"
                try:
                    if target.is_symlink() or (target.exists() and not target.is_dir()):
                        raise FileExistsError(errno.EEXIST, "not a directory", str(target))
                    if number in version_numbers(tmp.parent):  # a publisher that takes no lock (older code)
                        raise FileExistsError(errno.EEXIST, "a complete version", str(target))
                    # Pinned before it is visible: a reader never finds a version without its pin.
                    write_pin(self.root, ref, fingerprint(files))
                    os.rename(tmp, target)
                except OSError as err:
                    if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                        raise
                    (tmp / MANIFEST_FILE).chmod(_fs.FILE_MODE)
                    number = max([number, *version_numbers(tmp.parent)]) + 1
                    continue
                fsync_dir(tmp.parent)
                return ref

    # ---- retention ---------------------------------------------------------------------------

    def prune(self, policy: str, keep: Iterable[str] = (), keep_last: int = 1) -> list[PolicyRef]:
        """Delete `policy`'s versions that are neither named in `keep` nor among its newest `keep_last`.

        Returns the refs removed, oldest first. `keep` may hold any PolicyRefs (`bot:...`, `base`,
        other policies' versions): only this policy's versions count. Each version leaves in one
        `rename` to a temp name (never listed, never resolvable) before its files are deleted, so a
        reader sees a whole version or none; one that has already copied or loaded it is unaffected.
        The newest version is always kept, so version numbers are never reused.
        """
        validate_policy_name(policy)
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1 (the newest version is always kept), got {keep_last!r}")
        if isinstance(keep, str):
            raise TypeError("keep must be a collection of PolicyRef strings, not one string")
        refs = self.versions(policy)
        protected = {ref.version for ref in refs[-keep_last:]}
        for name in keep:
            try:
                kept = model_ref(name)
            except InvalidAdapterName:
                continue  # a bot, or not a version at all: nothing of this store
            if kept.policy == policy:
                protected.add(kept.version)
        policy_dir = self.root / policy
        removed = []
        for ref in refs:
            if ref.version in protected:
                continue
            trash = policy_dir / f"{_fs.TMP_PREFIX}pruned-v{ref.version}-{uuid.uuid4().hex}"
            try:
                os.rename(policy_dir / f"v{ref.version}", trash)
            except FileNotFoundError:
                continue  # pruned by someone else meanwhile
            _fs.rmtree_frozen(trash)
            removed.append(ref)
        if removed:
            fsync_dir(policy_dir)
            self.refresh_index()
        return removed

    # ---- reading -----------------------------------------------------------------------------

    def resolve(self, name: str) -> AdapterVersion:
        """The verified version `name` names, ready to load.

        Every file's size and SHA-256 are checked against the manifest on every call, and nothing on
        the way (policy directory, version directory, files) may be a symlink, so a truncated,
        bit-flipped or swapped file is reported here, naming the file, rather than loaded. The
        manifest's fingerprint must then equal the version's pin (`pins`): a version whose files
        were changed after publishing and its manifest rewritten to match is refused too.
        """
        ref = require_adapter(name)
        policy_dir = self.root / ref.policy
        path = policy_dir / f"v{ref.version}"
        manifest = path / MANIFEST_FILE
        if not (_fs.is_real_dir(policy_dir) and _fs.is_real_dir(path)) or manifest.is_symlink():
            known = ", ".join(str(r) for r in self.versions(ref.policy)) or "none"
            hint = " (symlinks in the store are refused)" if policy_dir.is_symlink() or path.is_symlink() else ""
            raise UnknownAdapter(f"unknown adapter {ref} in {self.root} (versions of {ref.policy!r}: {known}){hint}")
        try:
            raw = manifest.read_bytes()
        except FileNotFoundError:
            known = ", ".join(str(r) for r in self.versions(ref.policy)) or "none"
            raise UnknownAdapter(
                f"unknown adapter {ref} in {self.root} (versions of {ref.policy!r}: {known})"
            ) from None
        except OSError as err:
            raise CorruptAdapter(f"{ref}: cannot read {manifest}: {err}") from None
        version = version_from_manifest(raw, path, f"{ref} at {path}")
        if version.ref != ref:
            raise CorruptAdapter(f"{ref}: {manifest} describes {version.ref}; the directory was copied or renamed")
        self._check_files(version)
        check_pin(self.root, version)
        return version

    def _check_files(self, version: AdapterVersion) -> None:
        for f in version.files:
            path = version.path / f.name
            try:
                st = path.lstat()
            except OSError as err:
                raise CorruptAdapter(f"{version.ref}: {path} is unreadable or missing ({err.strerror})") from None
            if path.is_symlink():
                raise CorruptAdapter(f"{version.ref}: {path} is a symlink; the store refuses to follow it")
            if st.st_size != f.size:
                raise CorruptAdapter(f"{version.ref}: {path} has {st.st_size} bytes, its manifest says {f.size}")
            try:
                digest = _fs.sha256_file(path)
            except OSError as err:
                raise CorruptAdapter(f"{version.ref}: cannot read {path} ({err.strerror})") from None
            if digest != f.sha256:
                raise CorruptAdapter(f"{version.ref}: {path} does not match the sha256 in its manifest")
