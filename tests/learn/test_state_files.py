"""Learner state as JSON + safetensors: exact round trips, clear refusals, and nothing is ever unpickled."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diprl.learn.state_files import (
    StateFileError,
    read_state,
    state_bytes,
    state_from_bytes,
    state_paths,
    write_state,
)
from diprl.learn.train_state import restore_rng_state, rng_state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_a_nested_state_comes_back_exactly(tmp_path: Path) -> None:
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}, 1: {}},  # int keys, as torch has
        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "foreach": None, "params": [0, 1], "amsgrad": False}],
        "odd": {"$tensor": "a key that looks like a tag"},
        "floats": [float("nan"), float("inf"), -0.0, 1 / 3],
        "dtypes": [torch.arange(5, dtype=torch.uint8), torch.ones(3, dtype=torch.bfloat16), torch.zeros(0, 7)],
        "same_path": {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}},  # two tensors whose paths collide
        "view": torch.arange(10.0)[2:5],
    }
    write_state(tmp_path, "s", tree)
    back = read_state(tmp_path, "s")
    assert _same(back, tree)
    assert json.loads((tmp_path / "s.json").read_text())["tree"]["param_groups"][0]["lr"] == 1e-4  # readable


@pytest.mark.parametrize(
    ("value", "where"), [(np.zeros(3), "x/0: ndarray"), (object(), "x/0: object"), ({(1, 2): 0}, "x/0: dict key")]
)
def test_what_would_need_pickle_is_refused_on_write_naming_where_it_is(tmp_path: Path, value: Any, where: str) -> None:
    with pytest.raises(TypeError, match=where):
        write_state(tmp_path, "s", {"x": [value]})


def _break_json(tmp_path: Path, edit: Any) -> None:
    path = tmp_path / "s.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: _break_json(p, lambda d: d["tree"].update(w={"$tensor": "nope"})), "refers to tensor 'nope'"),
        (lambda p: _break_json(p, lambda d: d["tree"].pop("w")), r"tensors \['w'\] are not referenced"),
        (lambda p: _break_json(p, lambda d: d.update(format="other")), "not a diprl-state/1 state file"),
        (lambda p: _break_json(p, lambda d: d["tree"].update(t={"$tuple": 1})), r"\$tuple must hold a list"),
        (lambda p: (p / "s.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{broken}"), "s.safetensors: unreadable"),
        (lambda p: (p / "s.json").write_text("{"), "s.json: unreadable"),
    ],
)
def test_a_damaged_state_pair_is_refused_naming_the_file(tmp_path: Path, damage: Any, message: str) -> None:
    write_state(tmp_path, "s", {"w": torch.ones(2), "n": 1})
    damage(tmp_path)
    with pytest.raises(StateFileError, match=message):
        read_state(tmp_path, "s")


class _Planted:
    """Unpickling this creates `marker`: the stand-in for whatever code a forged file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_pickle_in_place_of_the_tensors_is_refused_and_never_run(tmp_path: Path) -> None:
    write_state(tmp_path, "s", {"w": torch.ones(2)})
    marker = tmp_path / "code-ran"
    _, tensors = state_paths(tmp_path, "s")
    torch.save({"w": _Planted(marker)}, tensors)
    with pytest.raises(StateFileError, match=r"s\.safetensors: unreadable"):
        read_state(tmp_path, "s")
    assert not marker.exists()


def test_rng_states_round_trip_through_the_files(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in the Python generator's state
    np.random.standard_normal()
    write_state(tmp_path, "rng", rng_state())
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(read_state(tmp_path, "rng"))
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    assert expected[:4] == again[:4] and torch.equal(expected[4], again[4])


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("depth", [600, 100_000])  # decodes as JSON but not as a tree; not even as JSON
def test_a_deeply_nested_state_is_refused_as_a_bad_state_file_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    """Found by review (N5): a state file nested a few hundred levels deep escaped the restore as a
    `RecursionError` (from `json.loads` or from decoding the tree) instead of a refused state file."""
    write_state(tmp_path, "s", {"w": torch.ones(2), "n": 1})
    json_path, _ = state_paths(tmp_path, "s")
    json_path.write_text(json_path.read_text().replace('"n": 1', f'"n": {_nested(depth)}'))
    with pytest.raises(StateFileError, match=r"s\.json: .*nested"):
        read_state(tmp_path, "s")
    data = state_bytes({"n": 1})
    skeleton = data[8 : 8 + int.from_bytes(data[:8], "little")].replace(b'"n": 1', f'"n": {_nested(depth)}'.encode())
    forged = len(skeleton).to_bytes(8, "little") + skeleton + data[8 + int.from_bytes(data[:8], "little") :]
    with pytest.raises(StateFileError, match="nested"):
        state_from_bytes(forged)


def test_a_state_nested_deeper_than_a_reader_takes_is_refused_on_write(tmp_path: Path) -> None:
    tree: Any = 1
    for _ in range(200):
        tree = [tree]
    with pytest.raises(ValueError, match="nested"):
        write_state(tmp_path, "s", {"deep": tree})
