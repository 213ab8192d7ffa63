"""Ray stand-ins for driver-side tests: actors whose calls answer at once, refs that `ray.get` reads back.

`use_stand_in_ray(monkeypatch)` makes `ray.get` read a `Ref` (and `ray.wait` find it ready); `Actor(obj)`
turns `obj.method(...)` into `handle.method.remote(...)`, as a Ray actor handle is called.
"""

from __future__ import annotations

from typing import Any

import pytest


class Ref:
    """An object ref stand-in (hashable, like Ray's): `ray.get` returns its value. `name`: what it answers,
    for a test that logs the order of its gets."""

    def __init__(self, value: Any, name: str = "") -> None:
        self.value, self.name = value, name


class Remote:
    """A Ray method stand-in: `.remote(...)` returns a ref to what `answer` gives."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> Ref:
        return Ref(self.answer(*args))


class Actor:
    """A Ray actor stand-in around a local object: `handle.method.remote(...)` is a ref to its answer."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Remote:
        return Remote(getattr(self.obj, name))


def use_stand_in_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray.get` of a `Ref` is its value; `ray.wait` finds every `Ref` ready (its call has already run)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda ref: ref.value)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, **_: (refs[:num_returns], refs[num_returns:]))
