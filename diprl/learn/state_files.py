"""Nested state (optimizer state dicts, counters, RNG states) as JSON plus safetensors: nothing pickled.

A checkpoint must never be able to run code when it is read: whoever can write into a run
directory (or hands one over to be resumed) would otherwise own the learner. `torch.save` and
`torch.load(weights_only=False)` are pickle, so learner state is split instead:

- `<name>.json` holds the structure and every plain value (ints, floats, strings, lists, dicts,
  tuples and non-string dict keys tagged so they come back as they went in), with each tensor
  replaced by a reference `{"$tensor": key}`;
- `<name>.safetensors` holds those tensors, read back with `safetensors` (no code, only bytes).

Anything else in the tree (a numpy array, an object) is a `TypeError` on write, naming where it is,
so nothing is silently turned into a string that would not load back. A tree nested deeper than
`MAX_DEPTH` is refused both ways: on write (a `ValueError`) and on read (a `StateFileError`, never the
`RecursionError` a forged file nested a few hundred levels deep would otherwise raise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

FORMAT = "diprl-state/1"
_TENSOR, _TUPLE, _ITEMS = "$tensor", "$tuple", "$items"
_TAGS = frozenset({_TENSOR, _TUPLE, _ITEMS})
MAX_DEPTH = 64
"""Containers (lists, dicts, tuples) inside one another, at most: learner state is a handful deep."""


class StateFileError(ValueError):
    """A state file pair that does not decode: malformed JSON, a dangling or unused tensor reference."""


def _child(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if depth > MAX_DEPTH:
        raise ValueError(f"{path or '/'}: nested deeper than {MAX_DEPTH} levels, more than a reader takes")
    depth += 1
    if isinstance(obj, torch.Tensor):
        key = path if path not in tensors else f"{path}#{len(tensors)}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, _child(path, i), tensors, depth) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, _child(path, i), tensors, depth) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, _child(path, k), tensors, depth) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, bool | int | float | str)):
                raise TypeError(f"{path or '/'}: dict key {k!r} of type {type(k).__name__} cannot be stored")
            items.append([k, _encode(v, _child(path, k), tensors, depth)])
        return {_ITEMS: items}
    raise TypeError(
        f"{path or '/'}: {type(obj).__name__} cannot be stored without pickle (use a tensor or plain values)"
    )


def _loads(text: str | bytes, where: str) -> Any:
    """JSON, nested at most `MAX_DEPTH` levels; `StateFileError` otherwise (never a `RecursionError`)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise StateFileError(
            f"{where}: nested too deeply to decode (a state holds at most {MAX_DEPTH} levels)"
        ) from None
    except ValueError as err:
        raise StateFileError(f"{where}: unreadable ({err})") from None
    return doc


def _decode(obj: Any, tensors: Mapping[str, Any], used: set[str], where: str, depth: int = 0) -> Any:
    if not isinstance(obj, list | dict):
        return obj
    if depth > MAX_DEPTH:
        raise StateFileError(f"{where}: nested deeper than {MAX_DEPTH} levels (not a state this code writes)")
    depth += 1
    if isinstance(obj, list):
        return [_decode(v, tensors, used, where, depth) for v in obj]
    tags = _TAGS.intersection(obj)
    if not tags:
        return {k: _decode(v, tensors, used, where, depth) for k, v in obj.items()}
    if len(obj) != 1:
        raise StateFileError(f"{where}: malformed entry {sorted(obj)[:4]} (a tag must stand alone)")
    (tag,) = tags
    value = obj[tag]
    if tag == _TENSOR:
        if not isinstance(value, str) or value not in tensors:
            raise StateFileError(f"{where}: refers to tensor {value!r}, which the .safetensors file lacks")
        used.add(value)
        return tensors[value]
    if not isinstance(value, list):
        raise StateFileError(f"{where}: {tag} must hold a list")
    if tag == _TUPLE:
        return tuple(_decode(v, tensors, used, where, depth) for v in value)
    out: dict[Any, Any] = {}
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], list | dict):
            raise StateFileError(f"{where}: malformed {_ITEMS} entry {str(pair)[:80]}")
        out[pair[0]] = _decode(pair[1], tensors, used, where, depth)
    return out


def state_paths(directory: Path, name: str) -> tuple[Path, Path]:
    """The JSON and safetensors files that hold state `name` in `directory`."""
    return directory / f"{name}.json", directory / f"{name}.safetensors"


def write_state(directory: Path, name: str, tree: Any) -> None:
    """Write `tree` as `<name>.json` + `<name>.safetensors` (durability is the caller's: see `checkpoint`)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, "", tensors)
    json_path, tensor_path = state_paths(directory, name)
    save_file(tensors, str(tensor_path), metadata={"format": FORMAT})
    json_path.write_text(json.dumps({"format": FORMAT, "tree": skeleton}, indent=1, allow_nan=True) + "\n")


def state_bytes(tree: Any) -> bytes:
    """`tree` as one byte string in the same format (for messages between processes): nothing pickled.

    Layout: the JSON skeleton's length (8 bytes, little-endian), the JSON, then a safetensors blob.
    """
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps({"format": FORMAT, "tree": _encode(tree, "", tensors)}, allow_nan=True).encode()
    return len(skeleton).to_bytes(8, "little") + skeleton + save(tensors, metadata={"format": FORMAT})


def state_from_bytes(data: bytes, where: str = "message") -> Any:
    """The tree `state_bytes` encoded; `StateFileError` if the bytes do not decode exactly."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if size < 0 or 8 + size > len(data):
        raise StateFileError(f"{where}: truncated ({len(data)} bytes)")
    doc = _loads(data[8 : 8 + size], where)
    try:
        tensors = load(bytes(data[8 + size :]))
    except (ValueError, SafetensorError) as err:
        raise StateFileError(f"{where}: undecodable ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "tree" not in doc:
        raise StateFileError(f"{where}: not {FORMAT} data")
    used: set[str] = set()
    tree = _decode(doc["tree"], tensors, used, where)
    if set(tensors) - used:
        raise StateFileError(f"{where}: tensors {sorted(set(tensors) - used)[:3]} are not referenced")
    return tree


def _read_pair(directory: Path, name: str, load_tensors: bool) -> Any:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    json_path, tensor_path = state_paths(directory, name)
    try:
        text = json_path.read_text()
    except (OSError, ValueError) as err:
        raise StateFileError(f"{json_path}: unreadable ({err})") from None
    doc = _loads(text, str(json_path))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "tree" not in doc:
        raise StateFileError(f"{json_path}: not a {FORMAT} state file")
    tensors: Mapping[str, Any]
    try:
        if load_tensors:
            tensors = load_file(str(tensor_path))
        else:  # the header's names only: no tensor is read
            with safe_open(str(tensor_path), framework="pt") as fh:
                tensors = dict.fromkeys(fh.keys())
    except (OSError, SafetensorError) as err:
        raise StateFileError(f"{tensor_path}: unreadable ({err})") from None
    used: set[str] = set()
    tree = _decode(doc["tree"], tensors, used, str(json_path))
    unused = sorted(set(tensors) - used)
    if unused:
        raise StateFileError(f"{tensor_path}: tensors {unused[:3]} are not referenced by {json_path.name}")
    return tree


def read_state(directory: Path, name: str) -> Any:
    """The tree `write_state` wrote; `StateFileError` (naming the file) if the pair does not decode exactly."""
    return _read_pair(directory, name, load_tensors=True)


def check_state(directory: Path, name: str) -> None:
    """`StateFileError` unless `read_state(directory, name)` would decode the pair: the JSON tree and its
    references are checked against the safetensors header, without reading a tensor (what a checkpoint's
    verification does, so a bad state file is a bad checkpoint and the previous one is restored)."""
    _read_pair(directory, name, load_tensors=False)
