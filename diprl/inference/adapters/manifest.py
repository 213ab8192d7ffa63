"""A version's manifest (`DIPRL_MANIFEST.json`): its name, shape and the size + SHA-256 of each file.

The manifest is what makes a version verifiable: a replica compares the bytes it is about to load
with it. It is untrusted input (anyone who can write the store can write it), so it is parsed
defensively here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diprl.adapter_files import ADAPTER_FILES
from diprl.inference.adapters.files import (
    CANARY_FILE,
    MANIFEST_FILE,
    OPTIONAL_FILES,
    AdapterShape,
    positive_number,
)
from diprl.inference.adapters.names import (
    CorruptAdapter,
    InvalidAdapterName,
    UnknownAdapter,
    require_adapter,
)
from diprl.messages import PolicyRef

MANIFEST_FORMAT = "diprl-adapter/1"
_MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class AdapterFile:
    """One file of a version as its manifest records it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class AdapterVersion:
    """A verified version on local disk: what a replica hands to vLLM (`path`) and checks (`rank`...)."""

    ref: PolicyRef
    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    files: tuple[AdapterFile, ...]
    created: str

    @property
    def canary_file(self) -> AdapterFile | None:
        """The version's canary as its manifest records it; None for a version published without one."""
        return next((f for f in self.files if f.name == CANARY_FILE), None)

    @property
    def name(self) -> str:
        return str(self.ref)

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the file hashes: equal fingerprints mean byte-identical adapters."""
        return fingerprint(self.files)


def fingerprint(files: Iterable[AdapterFile]) -> str:
    """SHA-256 over each file's name, size and hash: what a publisher pins and a reader checks."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        digest.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
    return digest.hexdigest()


def manifest_dict(ref: PolicyRef, shape: AdapterShape, files: list[AdapterFile], created: str) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "name": str(ref),
        "policy": ref.policy,
        "version": ref.version,
        "created": created,
        "rank": shape.rank,
        "alpha": shape.alpha,
        "target_modules": list(shape.target_modules),
        "base_model": shape.base_model,
        "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in files},
    }


def version_from_manifest(raw: bytes, path: Path, where: str) -> AdapterVersion:
    """An `AdapterVersion` from manifest bytes; its name goes through `require_adapter` and its file
    list must be exactly the PEFT files, plus optional ones (the canary): a manifest can never make us
    read or write anything else."""
    try:
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"{len(raw)} bytes is far more than a manifest needs")
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
        ref = require_adapter(manifest["name"])
        files_raw = manifest["files"]
        if (
            not isinstance(files_raw, dict)
            or not set(ADAPTER_FILES) <= set(files_raw)
            or not set(files_raw) <= {*ADAPTER_FILES, *OPTIONAL_FILES}
        ):
            raise ValueError(f"must list exactly {list(ADAPTER_FILES)}, and optionally {list(OPTIONAL_FILES)}")
        files = []
        for name in (*ADAPTER_FILES, *(n for n in OPTIONAL_FILES if n in files_raw)):
            size, sha = files_raw[name]["size"], files_raw[name]["sha256"]
            if (
                not isinstance(size, int)
                or isinstance(size, bool)
                or size < 0
                or not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha))
            ):
                raise ValueError(f"bad size or sha256 for {name}")
            files.append(AdapterFile(name, size, sha))
        rank, alpha, modules = manifest["rank"], manifest["alpha"], manifest["target_modules"]
        base = manifest["base_model"]
        if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 and positive_number(alpha)):
            raise ValueError("bad rank or alpha")
        if not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise ValueError("bad target_modules")
        if base is not None and not isinstance(base, str):
            raise ValueError("bad base_model")
    except (InvalidAdapterName, UnknownAdapter, ValueError, KeyError, TypeError, RecursionError) as err:
        raise CorruptAdapter(f"{where}: {MANIFEST_FILE} is invalid ({type(err).__name__}: {err})") from None
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
