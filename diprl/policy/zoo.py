"""The model zoo: policies shipped in the repository, addressed as `zoo:<name>`.

A zoo entry is a directory `zoo/<name>/` whose `manifest.json` says which model preset the policy plays
on (`model`, a `conf/model/` preset, whose base may itself be shipped under `zoo/bases/`), whether it adds
a LoRA adapter (`adapter`, a subdirectory in PEFT's format) or is that preset's base alone, the one
command that reproduces it from a fresh checkout (`recipe`), its budget, the commit it was trained at and
its measured figures. `files` fingerprints every file the policy needs, the base's included, by SHA-256:
an entry is used only after every file has been hashed and matched, so a weight changed by hand, a file
truncated by a bad checkout or a base retrained under the same preset is refused with the file named,
never served. `zoo/zoo.json` names the strongest entry (`best`), so `zoo:best` follows the newest result.

Pure file reading and hashing: no torch, no Ray.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.adapter_files import ADAPTER_FILES, WEIGHTS_FILE
from diprl.atomic_io import sha256_file
from diprl.messages import PolicyRef, UnknownPolicyRef
from diprl.policy.models import CONF_DIR, load_preset

ZOO_ROOT = CONF_DIR.parent / "zoo"
MANIFEST = "manifest.json"
INDEX = "zoo.json"
_FILE_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


class ZooError(UnknownPolicyRef):
    """An unknown zoo entry, or one whose files do not match its manifest."""


@dataclass(frozen=True)
class ZooEntry:
    """One verified entry. `files` maps paths relative to the zoo root to their SHA-256."""

    name: str
    model: str
    recipe: str
    budget: str
    commit: str
    adapter: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    root: Path = field(default_factory=lambda: ZOO_ROOT)

    @property
    def ref(self) -> str:
        return f"zoo:{self.name}"

    @property
    def adapter_dir(self) -> Path | None:
        """The PEFT adapter directory, or None for a base-only entry."""
        return self.root / self.name / self.adapter if self.adapter else None


def warm_start_dir(ref: str, model: str, root: Path | None = None) -> Path | None:
    """What a learner on preset `model` starts from for `learner.init_adapter=zoo:<name>`: the entry's
    adapter directory, or None (a fresh LoRA) for a base-only entry; `ZooError` for an entry of another model."""
    entry = load_entry(ref, root)
    if entry.model != model:
        raise ZooError(f"{ref} plays on model {entry.model!r}, the learner trains {model!r}: set model={entry.model}")
    return entry.adapter_dir


def entry_name(ref: str, root: Path | None = None) -> str:
    """The entry `zoo:<name>` names, aliases (`best`) followed through `zoo.json`."""
    root = root if root is not None else ZOO_ROOT
    parsed = PolicyRef.parse(ref)
    if not parsed.is_zoo:
        raise ZooError(f"{ref!r} is not a zoo reference (zoo:<name>)")
    aliases = _index(root).get("aliases", {})
    name = aliases.get(parsed.name, parsed.name)
    if not isinstance(name, str) or PolicyRef.parse(f"zoo:{name}").name != name:
        raise ZooError(f"{root / INDEX}: alias {parsed.name!r} names {name!r}, not an entry")
    return name


def known_entries(root: Path | None = None) -> list[str]:
    """Entry names (directories holding a manifest) and aliases, sorted."""
    root = root if root is not None else ZOO_ROOT
    names = {p.parent.name for p in root.glob(f"*/{MANIFEST}")} if root.is_dir() else set()
    return sorted(names | set(_index(root).get("aliases", {})))


def load_entry(ref: str, root: Path | None = None, conf_dir: Path | None = None) -> ZooEntry:
    """The verified entry `ref` (`zoo:<name>`) names; `ZooError` naming the problem otherwise."""
    root = root if root is not None else ZOO_ROOT
    name = entry_name(ref, root)
    manifest = root / name / MANIFEST
    if not manifest.is_file():
        raise ZooError(f"unknown zoo entry {ref!r} (known: {', '.join(known_entries(root)) or 'none'}; in {root})")
    try:
        raw = json.loads(manifest.read_text())
        entry = ZooEntry(
            name=name,
            model=str(raw["model"]),
            recipe=str(raw["recipe"]),
            budget=str(raw["budget"]),
            commit=str(raw["commit"]),
            adapter=raw.get("adapter") or None,
            figures=dict(raw.get("figures", {})),
            files={str(k): str(v) for k, v in raw["files"].items()},
            root=root,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ZooError(f"{manifest}: not a zoo manifest ({type(err).__name__}: {err})") from None
    if raw.get("name") != name:
        raise ZooError(f"{manifest} describes {raw.get('name')!r}, not {name!r}: the directory was copied or renamed")
    try:
        load_preset(entry.model, conf_dir)
    except (KeyError, ValueError) as err:
        raise ZooError(f"zoo entry {name!r} plays on model {entry.model!r}, which is not usable: {err}") from None
    verify_files(entry)
    return entry


def verify_files(entry: ZooEntry) -> None:
    """Every file of the entry is present, inside the zoo, a regular file, and matches its SHA-256; and every
    file of its adapter directory is listed (an extra file could change what PEFT loads)."""
    root = entry.root.resolve()
    if not entry.files:
        raise ZooError(f"zoo entry {entry.name!r} lists no files")
    for rel, digest in sorted(entry.files.items()):
        path = entry.root / rel
        if _FILE_RE.fullmatch(rel) is None or ".." in rel.split("/") or not path.resolve().is_relative_to(root):
            raise ZooError(f"zoo entry {entry.name!r}: {rel!r} is not a path inside the zoo")
        if path.is_symlink() or not path.is_file():
            raise ZooError(f"zoo entry {entry.name!r}: {path} is missing or not a regular file")
        if sha256_file(path) != digest:
            raise ZooError(f"zoo entry {entry.name!r}: {path} does not match the SHA-256 in its manifest")
    if entry.adapter_dir is not None:
        listed = {entry.root / rel for rel in entry.files}
        unlisted = sorted(str(p) for p in entry.adapter_dir.rglob("*") if p.is_file() and p not in listed)
        if unlisted or (entry.adapter_dir / WEIGHTS_FILE) not in listed:
            raise ZooError(f"zoo entry {entry.name!r}: adapter files not in its manifest: {unlisted or 'weights'}")


def fingerprints(root: Path, paths: list[Path]) -> dict[str, str]:
    """`files` for a manifest: each path (files, or directories taken whole) relative to `root`, hashed."""
    out: dict[str, str] = {}
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and not file.name.startswith("."):
                out[file.relative_to(root).as_posix()] = sha256_file(file)
    return out


def _json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object `path` holds; `ZooError` naming the file when it is unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ZooError(f"{path}: unreadable {what} ({err})") from None
    if not isinstance(value, dict):
        raise ZooError(f"{path}: the {what} must be a JSON object, got {type(value).__name__}")
    return value


def _index(root: Path) -> dict[str, Any]:
    path = root / INDEX
    return _json_object(path, "zoo index") if path.is_file() else {}


def add_entry(
    name: str,
    model: str,
    recipe: str,
    budget: str,
    commit: str,
    figures: dict[str, Any],
    adapter: Path | None = None,
    best: bool = False,
    root: Path | None = None,
    conf_dir: Path | None = None,
) -> ZooEntry:
    """Write `zoo/<name>/` (the adapter copied in, when given) and its manifest, fingerprinting the entry's
    files and its model's shipped base; `best` points `zoo:best` at it. Returns the entry, verified.

    Everything is checked before anything is written (`ZooError` naming the problem), so a bad call
    leaves the zoo as it was."""
    import shutil

    from diprl.policy.models import repo_path

    root = root if root is not None else ZOO_ROOT
    PolicyRef.parse(f"zoo:{name}")  # the name's grammar
    try:
        preset = load_preset(model, conf_dir)
    except (KeyError, ValueError) as err:
        raise ZooError(f"model {model!r} is not usable: {err}") from None
    if adapter is not None:
        missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
        if missing:
            raise ZooError(f"adapter {adapter} is not a PEFT adapter directory: no {', '.join(missing)}")
    paths: list[Path] = []
    if preset.path:
        base = repo_path(preset.path).resolve()
        if not base.is_relative_to(root.resolve()):
            raise ZooError(f"model {model!r}'s base {base} is not in the zoo ({root}): ship it under zoo/bases/")
        paths.append(base)
    elif adapter is None:
        raise ZooError(
            f"an entry without an adapter is its model's base alone, and {model!r} ships no base (zoo/bases/)"
        )
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    if adapter is not None:
        shutil.rmtree(directory / "adapter", ignore_errors=True)
        shutil.copytree(adapter, directory / "adapter")
        paths.append(directory / "adapter")
    manifest = {
        "name": name,
        "model": model,
        "adapter": "adapter" if adapter is not None else None,
        "recipe": recipe,
        "budget": budget,
        "commit": commit,
        "figures": figures,
        "files": fingerprints(root.resolve(), [p.resolve() for p in paths]),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if best:
        index = _index(root)
        index.setdefault("aliases", {})["best"] = name
        (root / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return load_entry(f"zoo:{name}", root, conf_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diprl.policy.zoo", description="The model zoo (docs/zoo.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser(
        "add", help="add or replace an entry: copy its adapter in, fingerprint its files, write its manifest"
    )
    add.add_argument("name", help="the entry, played as zoo:<name>")
    add.add_argument("--model", required=True, help="the conf/model/ preset it plays on (its base under zoo/bases/)")
    add.add_argument(
        "--adapter", type=Path, default=None, help="its PEFT adapter directory; none: the preset's base alone"
    )
    add.add_argument("--recipe", required=True, help="the one command that reproduces it from a fresh checkout")
    add.add_argument("--budget", required=True, help="what that command took, and on what machine")
    add.add_argument("--commit", required=True, help="the commit it was trained at")
    add.add_argument("--figures", type=Path, default=None, help="a JSON file of what bench strength measured")
    add.add_argument("--best", action="store_true", help="point zoo:best at it")
    add.add_argument("--root", type=Path, default=ZOO_ROOT, help="the zoo directory (default: the repository's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        figures = _json_object(args.figures, "figures file") if args.figures is not None else {}
        entry = add_entry(
            args.name, args.model, args.recipe, args.budget, args.commit, figures, args.adapter, args.best, args.root
        )
    except UnknownPolicyRef as err:  # ZooError included
        parser.error(str(err))
    print(f"{entry.ref}: {len(entry.files)} files fingerprinted in {entry.root / entry.name / MANIFEST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
