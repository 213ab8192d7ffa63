"""Teacher data on disk: JSONL shards with a manifest, cached under `diprl.cache` by a fingerprint.

Fifty thousand decisions take minutes to play and tokenize, and a training run, a sweep or the
learning benchmark wants the same data again. So the data live in the cache like the tokenizers
(`<cache>/imitation/teacher/<teacher>-<key>/`), built with the same primitive
(`diprl.policy.tokenizer.build_cached_dir`): written into a temporary directory, stamped with the
size and SHA-256 of every file, renamed into place; a directory whose stamp does not verify (a
killed build, an edited shard) is rebuilt, never half read. The key hashes what decides the data:
the teacher settings, the tokenizer's vocabulary, and the code that plays and writes the games (game
layer, bots, prompt, teacher; its syntax tree, so a reformatted file or an edited comment or docstring
keeps the data while a changed bot or prompt never serves stale data).
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_file_atomic
from diprl.cache import cache_root
from diprl.imitation.data import SPLITS, TeacherConfig, TeacherData, generate
from diprl.imitation.teacher import TeacherError, TeacherExample, teacher_bot
from diprl.policy.vocab import TokenTable

MANIFEST = "manifest.json"
SHARD_FORMAT = 2
DATA_RECIPE = 1
"""Bump when the data change in a way neither the settings nor the hashed sources show."""

_SOURCES = ("game", "bots", "policy/prompt.py", "imitation/teacher.py", "imitation/data.py", "imitation/strata.py")
"""The code that decides what a teacher example holds, relative to the diprl package."""


def write_shards(data: TeacherData, directory: Path | str, shard_size: int = 4096) -> Path:
    """Write `<directory>/<split>-<NNNNN>.jsonl` and a manifest (written last: its presence means every
    shard is complete). Shards of one split follow the examples' order: a game's states stay together."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.jsonl"):
        stale.unlink()
    (directory / MANIFEST).unlink(missing_ok=True)
    shards: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        examples = data.split(split)
        shards[split] = []
        for n, start in enumerate(range(0, len(examples), shard_size)):
            chunk = examples[start : start + shard_size]
            name = f"{split}-{n:05d}.jsonl"
            write_file_atomic(directory / name, "".join(json.dumps(asdict(e)) + "\n" for e in chunk).encode())
            shards[split].append({"file": name, "examples": len(chunk)})
    manifest = {"format": SHARD_FORMAT, "shards": shards, **data.summary}
    write_file_atomic(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return directory


def read_shards(directory: Path | str) -> TeacherData:
    """Read back what `write_shards` wrote; a missing manifest or shard, a count that does not match
    the manifest or a malformed line is a clear error (a killed write is never read as a smaller set)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise TeacherError(f"no teacher data in {directory} (no {MANIFEST})") from None
    except json.JSONDecodeError as exc:
        raise TeacherError(f"{directory / MANIFEST} is not JSON: {exc}") from None
    if manifest.get("format") != SHARD_FORMAT:
        raise TeacherError(f"{directory / MANIFEST}: unsupported format {manifest.get('format')!r}")
    out: dict[str, list[TeacherExample]] = {}
    for split in SPLITS:
        out[split] = []
        for shard in manifest["shards"][split]:
            path = directory / shard["file"]
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                raise TeacherError(f"teacher shard {path} is missing") from None
            if len(lines) != shard["examples"]:
                raise TeacherError(
                    f"teacher shard {path} has {len(lines)} examples, the manifest says {shard['examples']}"
                )
            for number, line in enumerate(lines, 1):
                try:
                    out[split].append(TeacherExample.from_dict(json.loads(line)))
                except (json.JSONDecodeError, TypeError) as exc:
                    raise TeacherError(f"teacher shard {path} line {number} is malformed: {exc}") from None
    summary = {k: v for k, v in manifest.items() if k not in ("format", "shards")}
    return TeacherData(train=out["train"], heldout=out["heldout"], summary=summary)


def _code(source: str) -> str:
    """A module's code without its formatting, comments and docstrings: what it does, not how it reads."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            del body[0]
    return ast.dump(tree)


def _source_digest() -> str:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _SOURCES:
        path = package / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            code = _code(file.read_text(encoding="utf-8"))
            digest.update(f"{file.relative_to(package)}\0{code}\0".encode())
    return digest.hexdigest()


def tokenizer_digest(tokenizer: Any, table: TokenTable) -> str:
    """The vocabulary as the examples spell it: the tokenizer's full definition, the EOS id and the logits width."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{spec}\0{table.eos_id}\0{table.vocab_size}".encode()).hexdigest()


def data_key(config: TeacherConfig, tokenizer: Any, table: TokenTable) -> str:
    from diprl.policy.tokenizer import fingerprint

    return fingerprint(
        {
            "recipe": DATA_RECIPE,
            "format": SHARD_FORMAT,
            "config": config.content(),
            "tokenizer": tokenizer_digest(tokenizer, table),
            "sources": _source_digest(),
        }
    )


def cached_teacher_data(
    config: TeacherConfig,
    tokenizer: Any,
    table: TokenTable,
    root: Path | None = None,
    progress: Callable[[int], Any] | None = None,
) -> tuple[TeacherData, Path, bool]:
    """(the data, their directory, whether they were generated now) for `config` and this tokenizer.

    A verified cached copy is read back; otherwise the games are played and the shards written.
    """
    from diprl.policy.tokenizer import build_cached_dir

    key = data_key(config, tokenizer, table)
    root = root if root is not None else cache_root()
    target = root / "imitation" / "teacher" / f"{teacher_bot(config.teacher)}-{key[:16]}"
    made: list[TeacherData] = []

    def build(tmp: Path) -> None:
        data = generate(config, tokenizer, table, progress)
        write_shards(data, tmp, config.shard_size)
        made.append(data)

    directory = build_cached_dir(target, key, build)
    if made:
        return made[0], directory, True
    return read_shards(directory), directory, False
