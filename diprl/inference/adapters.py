"""Immutable, verified LoRA adapter versions (`<policy>@v<N>`) and how they reach a replica.

The learner publishes, the league refers to versions by name, and every `PolicyServer` replica
loads them on first use. Names arrive in requests from rollout workers, so a name is parsed by
exactly one function (`parse_policy_ref`) into a policy and a version number, and paths are only
ever built from those validated parts: no request can name a file.

Layout of a store (the directory is the source of truth; `index.json` is a convenience):

    root/index.json                           every policy's versions, rewritten atomically
    root/<policy>/v<N>/adapter_config.json    PEFT files, copied byte for byte, read-only
    root/<policy>/v<N>/adapter_model.safetensors
    root/<policy>/v<N>/DIPRL_MANIFEST.json    size + sha256 of each file, rank, alpha, modules, base
    root/<policy>/.tmp-<uuid>/                a publish in progress (never listed)

Publishing writes a complete version into a temp directory, fsyncs it, and claims the next number
with one `rename`: Linux refuses to rename a directory onto a non-empty one, so two concurrent
publishers can never share a number and a reader never sees half a version. Versions are never
rewritten; a crashed publish leaves only a temp directory that no listing shows.

Clusters without a shared filesystem ship versions through Ray's object store instead:
`pack_adapter` turns a version into `{file name: bytes}`, and `materialize` writes such a bundle
into a replica's local cache after checking every hash, with the same temp-and-rename discipline.
Every failure is an `AdapterError` (a `ValueError`) that names the adapter and the file, so a
serving replica can reject one request and keep running.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from diprl.atomic_io import fsync_dir

BASE = "base"
"""The PolicyRef of the bare base model: no adapter, and never a valid policy name."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FILE = "DIPRL_MANIFEST.json"
INDEX_FILE = "index.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""The only files a version holds besides its manifest: what vLLM and `PeftModel.from_pretrained` read."""

MANIFEST_FORMAT = "diprl-adapter/1"
INDEX_FORMAT = "diprl-adapter-index/1"
MAX_VERSION = 999_999_999
_TMP_PREFIX = ".tmp-"
_STALE_TMP_AGE_S = 24 * 3600.0
_CHUNK = 1 << 20
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024

_POLICY_PATTERN = r"[a-z][a-z0-9_-]{0,47}"
_VERSION_PATTERN = r"[1-9][0-9]{0,8}"
_NAME_RE = re.compile(rf"(?P<policy>{_POLICY_PATTERN})@v(?P<version>{_VERSION_PATTERN})", re.ASCII)
_VERSION_DIR_RE = re.compile(rf"v(?P<version>{_VERSION_PATTERN})", re.ASCII)
_NAME_HELP = (
    "a valid name is 'base' or '<policy>@v<N>': policy is 1-48 characters of lowercase ASCII letters, digits, "
    "'_' or '-' starting with a letter, and N is a version number from 1 without leading zeros (e.g. 'main@v3')"
)


class AdapterError(ValueError):
    """Anything wrong with an adapter name or version; the request fails, the replica stays up."""


class InvalidAdapterName(AdapterError):
    """The string is not `base` or `<policy>@v<N>` (paths, traversal, whitespace, case...)."""


class UnknownAdapter(AdapterError):
    """A well-formed name the store (or the transport) does not hold."""


class CorruptAdapter(AdapterError):
    """Files that do not match their manifest, or that are not a readable PEFT LoRA adapter."""


class IncompatibleAdapter(AdapterError):
    """A sound adapter this server cannot apply: rank above its max, another base model, other modules."""


@dataclass(frozen=True, order=True)
class AdapterRef:
    """A validated adapter name; build it through `parse_policy_ref` or `AdapterRef.of`."""

    policy: str
    version: int

    def __post_init__(self) -> None:
        # Direct construction gets the same check as parsing: paths are built from these fields.
        if not isinstance(self.version, int) or isinstance(self.version, bool):
            raise InvalidAdapterName(f"adapter version must be an int, got {self.version!r}; {_NAME_HELP}")
        ref = parse_policy_ref(f"{self.policy}@v{self.version}") if isinstance(self.policy, str) else None
        if ref is None:
            raise InvalidAdapterName(f"invalid adapter {self.policy!r}@v{self.version!r}; {_NAME_HELP}")

    @property
    def name(self) -> str:
        return f"{self.policy}@v{self.version}"

    def __str__(self) -> str:
        return self.name


def parse_policy_ref(name: str) -> AdapterRef | None:
    """Parse a PolicyRef naming a model: `None` for `base`, an `AdapterRef` for `<policy>@v<N>`.

    This is the one gate between request strings and the filesystem; every other function here
    goes through it. Versions start at 1 and have no leading zeros so each version has exactly one
    spelling (`p@v01` and `p@v1` cannot become two cache entries for one adapter).
    """
    if not isinstance(name, str):
        raise InvalidAdapterName(f"adapter name must be a string, got {type(name).__name__}; {_NAME_HELP}")
    if name == BASE:
        return None
    match = _NAME_RE.fullmatch(name)
    if match is None or match["policy"] == BASE:
        raise InvalidAdapterName(f"invalid adapter name {name[:80]!r}; {_NAME_HELP}")
    ref = object.__new__(AdapterRef)  # fields already validated; skip __post_init__'s re-parse
    object.__setattr__(ref, "policy", match["policy"])
    object.__setattr__(ref, "version", int(match["version"]))
    return ref


def validate_policy_name(policy: str) -> str:
    """Return `policy` if it can name adapter versions (checked by `parse_policy_ref` itself)."""
    if not isinstance(policy, str) or "@" in policy:
        raise InvalidAdapterName(f"invalid policy name {policy!r}; {_NAME_HELP}")
    try:
        parse_policy_ref(f"{policy}@v1")
    except InvalidAdapterName:
        raise InvalidAdapterName(f"invalid policy name {policy[:80]!r}; {_NAME_HELP}") from None
    if policy == BASE:
        raise InvalidAdapterName(f"{BASE!r} is the base model and cannot be a policy name; {_NAME_HELP}")
    return policy


def _require_adapter(name: str) -> AdapterRef:
    ref = parse_policy_ref(name)
    if ref is None:
        raise UnknownAdapter(f"{BASE!r} is the bare base model: it has no adapter files to load")
    return ref


@dataclass(frozen=True)
class AdapterFile:
    """One file of a version as its manifest records it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class AdapterVersion:
    """A verified version on local disk: what a replica hands to vLLM (`path`) and checks (`rank`...)."""

    ref: AdapterRef
    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    files: tuple[AdapterFile, ...]
    created: str

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the file hashes: equal fingerprints mean byte-identical adapters."""
        digest = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.name):
            digest.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
        return digest.hexdigest()


class SavesPretrained(Protocol):
    """A PEFT model (or anything) that writes `adapter_config.json` + safetensors weights."""

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any: ...


# --------------------------------------------------------------------------------------------
# Base model identity


def base_model_key(name_or_path: str) -> str:
    """What identifies a base model across machines, for comparing an adapter's base with a server's.

    The learner and the replicas may see one model under different paths: a hub snapshot lives at
    `.../models--Qwen--Qwen3-8B/snapshots/<rev>` (key `Qwen/Qwen3-8B`), and the tiny model's
    directory name `tiny-qwen3-<hash>` already fingerprints its spec. Anything else compares as
    written, minus trailing slashes.
    """
    text = name_or_path.strip().rstrip("/")
    parts = Path(text).parts
    for part in parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return "/".join(part.split("--")[1:])
    if parts and parts[-1].startswith("tiny-qwen3-"):
        return parts[-1]
    return text


def same_base_model(a: str, b: str) -> bool:
    return base_model_key(a) == base_model_key(b)


def check_compatible(
    version: AdapterVersion,
    max_rank: int,
    base_model: str | None = None,
    allowed_modules: set[str] | None = None,
) -> None:
    """Raise `IncompatibleAdapter` unless a server with these limits can apply `version`.

    Checked before loading, because vLLM reports a too-large rank or a foreign module as an engine
    error, and an adapter trained on another base model would load silently and play nonsense.
    An adapter that records no base model is rejected when the server names its base: it cannot
    be shown to fit.
    """
    problems = []
    if version.rank > max_rank:
        problems.append(f"rank {version.rank} exceeds the server's max LoRA rank {max_rank}")
    if base_model is not None:
        if version.base_model is None:
            problems.append(f"it records no base model, the server runs {base_model!r}")
        elif not same_base_model(version.base_model, base_model):
            problems.append(f"it was trained on base model {version.base_model!r}, the server runs {base_model!r}")
    if allowed_modules is not None:
        extra = sorted(set(version.target_modules) - set(allowed_modules))
        if extra:
            problems.append(
                f"it targets modules {extra} the server does not support (allowed: {sorted(allowed_modules)})"
            )
    if problems:
        raise IncompatibleAdapter(f"adapter {version.name} is incompatible: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# Validating PEFT files


@dataclass(frozen=True)
class _AdapterShape:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _read_config(data: bytes, where: str) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise IncompatibleAdapter(f"{where}: peft_type {peft_type!r} is not supported (only LoRA adapters are served)")
    if config.get("use_dora"):
        raise IncompatibleAdapter(f"{where}: DoRA adapters are not supported (vLLM serves plain LoRA)")
    if not isinstance(config.get("r"), int) or isinstance(config.get("r"), bool) or config["r"] <= 0:
        raise CorruptAdapter(
            f"{where}: {CONFIG_FILE} needs a positive integer 'r' (LoRA rank), got {config.get('r')!r}"
        )
    if not _positive_number(config.get("lora_alpha")):
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} needs a positive 'lora_alpha', got {config.get('lora_alpha')!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(_positive_number(v) for v in pattern.values()):
            raise CorruptAdapter(f"{where}: {CONFIG_FILE} '{key}' must map module names to positive numbers")
    return config


def _safetensors_header(read: Callable[[int, int], bytes], size: int, where: str) -> dict[str, Any]:
    """Parse and bounds-check a safetensors header without loading tensors (or torch).

    `read(offset, n)` returns bytes of the file. Truncation, a mangled header, and tensors that
    overlap or leave gaps all fail here, at publish time, instead of inside a replica's loader.
    """
    name = f"{where}/{WEIGHTS_FILE}"
    if size < 8:
        raise CorruptAdapter(f"{name}: {size} bytes is too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", read(0, 8))
    if header_len > min(size - 8, _MAX_SAFETENSORS_HEADER):
        raise CorruptAdapter(f"{name}: header length {header_len} does not fit in a {size}-byte file (truncated?)")
    try:
        header = json.loads(read(8, header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptAdapter(f"{name}: safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CorruptAdapter(f"{name}: safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for key, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise CorruptAdapter(f"{name}: tensor {key!r} has a malformed header entry")
        spans.append((offsets[0], offsets[1], key))
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position or end < begin:
            raise CorruptAdapter(f"{name}: tensor {key!r} data is misplaced in the file")
        position = end
    if 8 + header_len + position != size:
        raise CorruptAdapter(
            f"{name}: tensors need {8 + header_len + position} bytes, the file has {size} (truncated?)"
        )
    return header


def _module_of(key: str) -> str:
    """Leaf module a weight key belongs to (`...mlp.down_proj.lora_A.weight` -> `down_proj`)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.startswith(("lora_", "modules_to_save", "trainable_tokens")) and i > 0:
            return parts[i - 1]
    return parts[-2] if len(parts) >= 2 else key


def _adapter_shape(config: dict[str, Any], header: dict[str, Any], where: str, base_model: str | None) -> _AdapterShape:
    """Rank, alpha and modules as the weights show them, cross-checked with the config.

    The modules come from the tensor names, not from `target_modules` (which may be a regex), so
    a server's allow-list is checked against what will actually be applied.
    """
    weight_ranks = []
    modules = set()
    for key, info in header.items():
        modules.add(_module_of(key))
        shape = info["shape"]
        if ".lora_A." in key and len(shape) == 2:
            weight_ranks.append(shape[0])
        elif ".lora_B." in key and len(shape) == 2:
            weight_ranks.append(shape[1])
    if not weight_ranks:
        raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: no LoRA weights (lora_A / lora_B tensors) found")
    declared = max([int(config["r"]), *(int(v) for v in (config.get("rank_pattern") or {}).values())])
    if max(weight_ranks) > declared:
        raise CorruptAdapter(
            f"{where}: weights have rank {max(weight_ranks)} but {CONFIG_FILE} declares at most {declared}"
        )
    recorded = base_model if base_model is not None else config.get("base_model_name_or_path")
    return _AdapterShape(
        rank=declared,
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(modules)),
        base_model=str(recorded) if recorded else None,
    )


def _file_reader(path: Path) -> Callable[[int, int], bytes]:
    def read(offset: int, n: int) -> bytes:
        with path.open("rb") as fh:
            fh.seek(offset)
            return fh.read(n)

    return read


def _bytes_reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, n: data[offset : offset + n]


# --------------------------------------------------------------------------------------------
# Durable filesystem helpers


def _write_bytes(path: Path, data: bytes) -> None:
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _copy_hashing(src: Path, dst: Path) -> AdapterFile:
    digest = hashlib.sha256()
    size = 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return AdapterFile(dst.name, size, digest.hexdigest())


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    try:
        _write_bytes(tmp, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


def _freeze(directory: Path) -> None:
    """Files read-only for everyone, directory world-readable: versions are shared and never edited."""
    for entry in directory.iterdir():
        entry.chmod(0o444)
    directory.chmod(0o755)


def _sweep_stale_tmp(directory: Path) -> None:
    """Remove temp directories of publishes killed long ago (fresh ones may belong to a live publisher)."""
    now = time.time()
    for entry in directory.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - entry.lstat().st_mtime > _STALE_TMP_AGE_S:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
        except OSError:
            continue


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An advisory inter-process lock, so concurrent index rewrites do not lose each other's versions."""
    import fcntl

    with path.open("a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _version_numbers(policy_dir: Path, complete_only: bool) -> list[int]:
    """Version numbers under `policy_dir`; with `complete_only`, those holding a manifest.

    Claiming a number counts every `v<N>` entry, complete or not, so a stray file can never be
    overwritten; listing counts only complete versions.
    """
    try:
        entries = list(os.scandir(policy_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    numbers = []
    for entry in entries:
        match = _VERSION_DIR_RE.fullmatch(entry.name)
        if match is None:
            continue
        if complete_only and not (entry.is_dir(follow_symlinks=False) and Path(entry.path, MANIFEST_FILE).is_file()):
            continue
        numbers.append(int(match["version"]))
    return sorted(numbers)


# --------------------------------------------------------------------------------------------
# Manifests


def _manifest(ref: AdapterRef, shape: _AdapterShape, files: list[AdapterFile], created: str) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "name": ref.name,
        "policy": ref.policy,
        "version": ref.version,
        "created": created,
        "rank": shape.rank,
        "alpha": shape.alpha,
        "target_modules": list(shape.target_modules),
        "base_model": shape.base_model,
        "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in files},
    }


def _version_from_manifest(raw: bytes, path: Path, where: str) -> AdapterVersion:
    """An `AdapterVersion` from manifest bytes; the manifest is untrusted input (it may come off
    the wire), so its name goes through `parse_policy_ref` and its file list must be exactly the
    PEFT files: it can never make us read or write anything else."""
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
        ref = _require_adapter(manifest["name"])
        files_raw = manifest["files"]
        if not isinstance(files_raw, dict) or sorted(files_raw) != sorted(ADAPTER_FILES):
            raise ValueError(f"must list exactly {list(ADAPTER_FILES)}")
        files = []
        for name in ADAPTER_FILES:
            size, sha = files_raw[name]["size"], files_raw[name]["sha256"]
            if (
                not isinstance(size, int)
                or size < 0
                or not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha))
            ):
                raise ValueError(f"bad size or sha256 for {name}")
            files.append(AdapterFile(name, size, sha))
        rank, alpha, modules = manifest["rank"], manifest["alpha"], manifest["target_modules"]
        base = manifest["base_model"]
        if not (isinstance(rank, int) and rank > 0 and _positive_number(alpha)):
            raise ValueError("bad rank or alpha")
        if not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise ValueError("bad target_modules")
        if base is not None and not isinstance(base, str):
            raise ValueError("bad base_model")
    except (InvalidAdapterName, UnknownAdapter, ValueError, KeyError, TypeError) as err:
        raise CorruptAdapter(f"{where}: {MANIFEST_FILE} is invalid ({err})") from None
    return AdapterVersion(
        ref=ref,
        path=path,
        rank=rank,
        alpha=float(alpha),
        target_modules=tuple(modules),
        base_model=base,
        files=tuple(files),
        created=str(manifest.get("created", "")),
    )


# --------------------------------------------------------------------------------------------
# The store


class AdapterStore:
    """Adapter versions under one root directory (local disk or a shared mount).

    Read operations never write, so replicas can mount the root read-only. Hash checks are cached
    per file identity (path, inode, size, mtime), so resolving a hot version on every request costs
    a few `stat` calls.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._verified: dict[tuple[str, int, int, int], str] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AdapterStore({str(self.root)!r})"

    check_compatible = staticmethod(check_compatible)

    # ---- listing ------------------------------------------------------------------------

    def versions(self, policy: str) -> list[AdapterRef]:
        """Complete versions of `policy`, oldest first (read from the directory, not the index)."""
        validate_policy_name(policy)
        return [AdapterRef(policy, n) for n in _version_numbers(self.root / policy, complete_only=True)]

    def latest(self, policy: str) -> AdapterRef | None:
        refs = self.versions(policy)
        return refs[-1] if refs else None

    def policies(self) -> list[str]:
        """Policies with at least one complete version, sorted."""
        try:
            entries = sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        return [
            name
            for name in entries
            if re.fullmatch(_POLICY_PATTERN, name, re.ASCII)
            and name != BASE
            and _version_numbers(self.root / name, complete_only=True)
        ]

    def __contains__(self, name: object) -> bool:
        try:
            ref = parse_policy_ref(name)  # type: ignore[arg-type]
        except InvalidAdapterName:
            return False
        return ref is not None and (self.root / ref.policy / f"v{ref.version}" / MANIFEST_FILE).is_file()

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
        self.root.mkdir(parents=True, exist_ok=True)
        _sweep_stale_tmp(self.root)
        with _locked(self.root / ".index.lock"):
            current = self.index()
            try:
                on_disk = json.loads((self.root / INDEX_FILE).read_text())
                if isinstance(on_disk, dict) and on_disk.get("policies") == current["policies"]:
                    return False
            except (OSError, ValueError):
                pass
            _write_json_atomic(self.root / INDEX_FILE, {**current, "updated": _now()})
            return True

    # ---- publishing -------------------------------------------------------------------------

    def publish(self, policy: str, source: Path | str | SavesPretrained, base_model: str | None = None) -> AdapterRef:
        """Store a new immutable version of `policy` and return its ref (`policy@v<N>`, N = latest + 1).

        `source` is a directory written by PEFT's `save_pretrained` (safetensors) or a PEFT model,
        which is saved here. `base_model` overrides the config's `base_model_name_or_path`, which
        is empty for models built in memory. The files are validated before a number is claimed,
        so a bad adapter never becomes a version.
        """
        validate_policy_name(policy)
        policy_dir = self.root / policy
        if not policy_dir.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            policy_dir.mkdir(exist_ok=True)
            fsync_dir(self.root)
        _sweep_stale_tmp(policy_dir)
        tmp = policy_dir / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            if isinstance(source, str | Path):
                src_dir = Path(source)
                ref = self._publish_from(src_dir, tmp, policy, base_model)
            else:
                with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX, dir=policy_dir) as saved:
                    source.save_pretrained(saved, safe_serialization=True)
                    ref = self._publish_from(Path(saved), tmp, policy, base_model)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.refresh_index()
        return ref

    def _publish_from(self, src: Path, tmp: Path, policy: str, base_model: str | None) -> AdapterRef:
        where = f"publishing {policy} from {src}"
        for name in ADAPTER_FILES:
            if not (src / name).is_file():
                hint = " (save with safe_serialization=True)" if (src / "adapter_model.bin").exists() else ""
                raise CorruptAdapter(f"{where}: {name} is missing{hint}")
        files = [_copy_hashing(src / name, tmp / name) for name in ADAPTER_FILES]
        config = _read_config((tmp / CONFIG_FILE).read_bytes(), where)
        weights = tmp / WEIGHTS_FILE
        header = _safetensors_header(_file_reader(weights), weights.stat().st_size, where)
        shape = _adapter_shape(config, header, where, base_model)
        created = _now()
        number = max(_version_numbers(tmp.parent, complete_only=False), default=0) + 1
        while True:
            if number > MAX_VERSION:
                raise AdapterError(f"{where}: policy {policy!r} has run out of version numbers")
            ref = AdapterRef(policy, number)
            # The manifest names the version, so it is rewritten whenever a race moves the number.
            _write_bytes(tmp / MANIFEST_FILE, json.dumps(_manifest(ref, shape, files, created), indent=1).encode())
            _freeze(tmp)
            fsync_dir(tmp)
            try:
                os.rename(tmp, tmp.parent / f"v{number}")
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
                (tmp / MANIFEST_FILE).chmod(0o644)
                number = max([number, *_version_numbers(tmp.parent, complete_only=False)]) + 1
                continue
            fsync_dir(tmp.parent)
            return ref

    # ---- reading -----------------------------------------------------------------------------

    def resolve(self, name: str, verify: bool = True) -> AdapterVersion:
        """The verified version `name` names, ready to load.

        Sizes are always checked; with `verify` every file's SHA-256 too (cached while the file's
        inode, size and mtime are unchanged), so a truncated or bit-flipped file is reported here,
        naming the file, rather than crashing the engine that loads it.
        """
        ref = _require_adapter(name)
        path = self.root / ref.policy / f"v{ref.version}"
        manifest = path / MANIFEST_FILE
        if not manifest.is_file() or path.is_symlink():
            known = ", ".join(r.name for r in self.versions(ref.policy)) or "none"
            raise UnknownAdapter(f"unknown adapter {ref.name} in {self.root} (versions of {ref.policy!r}: {known})")
        try:
            raw = manifest.read_bytes()
        except OSError as err:
            raise CorruptAdapter(f"{ref.name}: cannot read {manifest}: {err}") from None
        version = _version_from_manifest(raw, path, f"{ref.name} at {path}")
        if version.ref != ref:
            raise CorruptAdapter(
                f"{ref.name}: {manifest} describes {version.name}; the directory was copied or renamed"
            )
        self._check_files(version, verify)
        return version

    def _check_files(self, version: AdapterVersion, verify: bool) -> None:
        for f in version.files:
            path = version.path / f.name
            try:
                st = path.stat()
            except OSError as err:
                raise CorruptAdapter(f"{version.name}: {path} is unreadable or missing ({err.strerror})") from None
            if st.st_size != f.size:
                raise CorruptAdapter(f"{version.name}: {path} has {st.st_size} bytes, its manifest says {f.size}")
            if not verify:
                continue
            key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                known = self._verified.get(key)
            if known is None:
                try:
                    known = _sha256_file(path)
                except OSError as err:
                    raise CorruptAdapter(f"{version.name}: cannot read {path} ({err.strerror})") from None
                with self._lock:
                    self._verified[key] = known
            if known != f.sha256:
                raise CorruptAdapter(f"{version.name}: {path} does not match the sha256 in its manifest")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------------------------
# Transport (Ray object store or any byte channel)


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


def _check_packed(packed: Mapping[str, bytes]) -> AdapterVersion:
    """The version a bundle claims to be, after checking every byte; raises before anything is written."""
    if not isinstance(packed, Mapping) or not all(isinstance(v, bytes) for v in packed.values()):
        raise CorruptAdapter("packed adapter must be a mapping of file names to bytes")
    if MANIFEST_FILE not in packed:
        raise CorruptAdapter(f"packed adapter has no {MANIFEST_FILE}")
    version = _version_from_manifest(packed[MANIFEST_FILE], Path(), "packed adapter")
    where = f"packed adapter {version.name}"
    if set(packed) != {*ADAPTER_FILES, MANIFEST_FILE}:
        raise CorruptAdapter(f"{where}: expected files {sorted({*ADAPTER_FILES, MANIFEST_FILE})}, got {sorted(packed)}")
    for f in version.files:
        data = packed[f.name]
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise CorruptAdapter(f"{where}: {f.name} does not match the sha256 in its manifest")
    config = _read_config(packed[CONFIG_FILE], where)
    header = _safetensors_header(_bytes_reader(packed[WEIGHTS_FILE]), len(packed[WEIGHTS_FILE]), where)
    shape = _adapter_shape(config, header, where, version.base_model)
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
    claimed = _check_packed(packed)
    cache = AdapterStore(cache_root)
    target = cache.root / claimed.ref.policy / f"v{claimed.ref.version}"
    existing = _cached(cache, claimed)
    if existing is not None:
        return existing
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(target.parent)
    tmp = target.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    trash: Path | None = None
    tmp.mkdir()
    try:
        for name, data in packed.items():
            _write_bytes(tmp / name, data)
        _freeze(tmp)
        fsync_dir(tmp)
        if target.exists() or target.is_symlink():
            if _cached(cache, claimed) is not None:
                return cache.resolve(claimed.name)
            trash = target.parent / f"{_TMP_PREFIX}old-{uuid.uuid4().hex}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, trash)
        try:
            os.rename(tmp, target)
        except OSError:
            if _cached(cache, claimed) is None:  # a concurrent materialize won; it must be ours
                raise
        fsync_dir(target.parent)
    finally:
        for leftover in (tmp, trash):
            if leftover is not None and leftover.exists():
                _rmtree_frozen(leftover)
    return cache.resolve(claimed.name)


def _cached(cache: AdapterStore, claimed: AdapterVersion) -> AdapterVersion | None:
    try:
        version = cache.resolve(claimed.name)
    except AdapterError:
        return None
    return version if version.fingerprint == claimed.fingerprint else None


def _rmtree_frozen(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


Fetch = Callable[[str], Mapping[str, bytes]]
"""Returns the packed bytes of a version by name (e.g. `ray.get` of an object ref); raises
`UnknownAdapter` for a name it does not have."""


class LocalAdapterCache:
    """Where a replica gets a local, verified copy of a version on first use.

    The shared store is preferred (no copy at all); otherwise the version is fetched once as
    packed bytes and materialized under `cache_root`, and later calls find it there. One lock per
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
        ref = _require_adapter(name)
        with self._guard:
            lock = self._locks.setdefault(ref.name, threading.Lock())
        with lock:
            return self._get(ref)

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


def object_store_fetch(refs: Mapping[str, Any]) -> Fetch:
    """A `Fetch` over a mapping `name -> ObjectRef` of packed versions (kept current by whoever
    publishes); unknown names raise `UnknownAdapter` listing what the mapping holds."""

    def fetch(name: str) -> Mapping[str, bytes]:
        import ray

        ref = _require_adapter(name)
        if ref.name not in refs:
            raise UnknownAdapter(
                f"unknown adapter {ref.name} (object store holds: {', '.join(sorted(refs)) or 'none'})"
            )
        packed = ray.get(refs[ref.name])
        if not isinstance(packed, Mapping):
            raise CorruptAdapter(f"object store entry for {ref.name} is a {type(packed).__name__}, not packed files")
        return packed

    return fetch
