"""Two runs on one Ray cluster: a second `serve_policy` never takes over (nor deletes) another run's server.

Serve itself is replaced by a stand-in that records what it was asked to do; the same refusal on a
real cluster is tested in test_server.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diprl.inference import server as server_module
from diprl.inference.config import ServerConfig


@dataclass
class _Overview:
    status: str = "RUNNING"


@dataclass
class _Call:
    value: Any

    def result(self, timeout_s: float) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


@dataclass
class FakeServe:
    """The Serve calls `serve_policy` and `stop_serving` make, over a dict of running applications."""

    apps: dict[str, Any] = field(default_factory=dict)  # name -> identity() answer (or an exception)
    calls: list[str] = field(default_factory=list)

    def status(self) -> Any:
        return type("Status", (), {"applications": {name: _Overview() for name in self.apps}})()

    def get_app_handle(self, name: str) -> Any:
        answer = self.apps[name]
        identity = type("Method", (), {"remote": staticmethod(lambda: _Call(answer))})()
        return type("Handle", (), {"identity": identity})()

    def start(self, **kwargs: Any) -> None:
        self.calls.append("start")

    def run(self, *args: Any, name: str, **kwargs: Any) -> str:
        self.calls.append(f"run {name}")
        return name

    def delete(self, name: str) -> None:
        self.calls.append(f"delete {name}")


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeServe:
    fake = FakeServe()
    for name in ("status", "get_app_handle", "start", "run", "delete"):
        monkeypatch.setattr(server_module.serve, name, getattr(fake, name))
    monkeypatch.setattr(server_module, "_serve_running", lambda: True)
    monkeypatch.setattr(server_module, "resolve_model", lambda config: (str(tmp_path / "model"), "float32"))
    return fake


def config(tmp_path: Path, root: str, name: str = "policy") -> ServerConfig:
    return ServerConfig(adapter_root=str(tmp_path / root), adapter_cache=str(tmp_path / "cache"), name=name)


def test_a_second_run_is_refused_before_its_server_repoints_the_first_one(
    tmp_path: Path, fake_serve: FakeServe
) -> None:
    fake_serve.apps["policy"] = {"adapter_root": str(tmp_path / "run-a")}
    with pytest.raises(server_module.ServeConflict, match=r"'policy' already serves adapters from .*run-a"):
        server_module.serve_policy(config(tmp_path, "run-b"))
    assert fake_serve.calls == []  # nothing deployed, nothing started
    server_module.stop_serving("policy", adapter_root=tmp_path / "run-b")  # the refused run's cleanup
    assert fake_serve.calls == []  # ... leaves the first run's server alone
    assert server_module.serve_policy(config(tmp_path, "run-b", name="policy-b")) == "policy-b"  # its own app
    assert server_module.serve_policy(config(tmp_path, "run-a")) == "policy"  # the same store: an update
    server_module.stop_serving("policy", adapter_root=tmp_path / "run-a")
    assert fake_serve.calls[-1] == "delete policy"


def test_an_application_that_cannot_say_whose_it_is_is_neither_replaced_nor_deleted(
    tmp_path: Path, fake_serve: FakeServe
) -> None:
    fake_serve.apps["policy"] = AttributeError("'ChatApp' has no method 'identity'")
    with pytest.raises(server_module.ServeConflict, match="did not say which adapter store it serves"):
        server_module.serve_policy(config(tmp_path, "run-a"))
    server_module.stop_serving("policy", adapter_root=tmp_path / "run-a")
    assert fake_serve.calls == []
    server_module.stop_serving("policy")  # by name alone: the caller knows it is theirs
    assert fake_serve.calls == ["delete policy"]
