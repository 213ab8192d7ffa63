"""No code in diprl reads a file with pickle: a checkpoint, adapter or data file must not be able to run code.

Checked on the syntax tree (calls, not words in docstrings): `torch.load`, `pickle.load(s)`,
`joblib.load`, `yaml.load`/`unsafe_load`, `pandas.read_pickle`, DeepSpeed's `load_checkpoint` (it
unpickles with `weights_only=False`), torch.distributed's `*_object` collectives (they unpickle what
another rank sends: whatever joins a learner group's rendezvous could run code), and any call passing
`weights_only=False` or `allow_pickle=True`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import diprl

_UNSAFE_CALLS = {
    ("torch", "load"),
    ("pickle", "load"),
    ("pickle", "loads"),
    ("cloudpickle", "load"),
    ("cloudpickle", "loads"),
    ("dill", "load"),
    ("joblib", "load"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
    ("pd", "read_pickle"),
    ("pandas", "read_pickle"),
}
_UNSAFE_METHODS = {
    "load_checkpoint",
    "read_pickle",
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "recv_object_list",
}
_UNSAFE_KEYWORDS = {("weights_only", False), ("allow_pickle", True)}


def _unsafe(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name) and (func.value.id, func.attr) in _UNSAFE_CALLS:
            return f"{func.value.id}.{func.attr}"
        if func.attr in _UNSAFE_METHODS:
            return func.attr
    for kw in call.keywords:
        if isinstance(kw.value, ast.Constant) and (kw.arg, kw.value.value) in _UNSAFE_KEYWORDS:
            return f"{kw.arg}={kw.value.value}"
    return None


def test_no_module_unpickles_or_calls_a_pickling_loader() -> None:
    root = Path(diprl.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and (what := _unsafe(node)):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {what}")
    assert found == [], "pickle-based loading found:\n" + "\n".join(found)
