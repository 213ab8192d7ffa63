"""Two runs on one Ray cluster: a second `serve_policy` never takes over (nor deletes) another run's server.

Serve itself is replaced by a stand-in that records what it was asked to do; the same refusal on a
real cluster is tested in test_server.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diprl.inference import deploy
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
        monkeypatch.setattr(deploy.serve, name, getattr(fake, name))
    monkeypatch.setattr(deploy, "_serve_running", lambda: True)
    monkeypatch.setattr(deploy, "resolve_model", lambda config: (str(tmp_path / "model"), "float32"))
    return fake


def config(tmp_path: Path, root: str, name: str = "policy") -> ServerConfig:
    return ServerConfig(adapter_root=str(tmp_path / root), name=name)


def test_a_second_run_is_refused_before_its_server_repoints_the_first_one(
    tmp_path: Path, fake_serve: FakeServe
) -> None:
    fake_serve.apps["policy"] = {"adapter_root": str(tmp_path / "run-a")}
    with pytest.raises(deploy.ServeConflict, match=r"'policy' already serves adapters from .*run-a"):
        deploy.serve_policy(config(tmp_path, "run-b"))
    assert fake_serve.calls == []  # nothing deployed, nothing started
    deploy.stop_serving("policy", adapter_root=tmp_path / "run-b")  # the refused run's cleanup
    assert fake_serve.calls == []  # ... leaves the first run's server alone
    assert deploy.serve_policy(config(tmp_path, "run-b", name="policy-b")) == "policy-b"  # its own app
    assert deploy.serve_policy(config(tmp_path, "run-a")) == "policy"  # the same store: an update
    deploy.stop_serving("policy", adapter_root=tmp_path / "run-a")
    assert fake_serve.calls[-1] == "delete policy"


def test_an_application_that_cannot_say_whose_it_is_is_neither_replaced_nor_deleted(
    tmp_path: Path, fake_serve: FakeServe
) -> None:
    fake_serve.apps["policy"] = AttributeError("'ChatApp' has no method 'identity'")
    with pytest.raises(deploy.ServeConflict, match="did not say which adapter store it serves"):
        deploy.serve_policy(config(tmp_path, "run-a"))
    deploy.stop_serving("policy", adapter_root=tmp_path / "run-a")
    assert fake_serve.calls == []
    deploy.stop_serving("policy")  # by name alone: the caller knows it is theirs
    assert fake_serve.calls == ["delete policy"]


def test_deploying_runs_the_block_while_the_replicas_start_and_deletes_only_what_it_deployed(
    tmp_path: Path, fake_serve: FakeServe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training run creates its actors while its PolicyServer deploys: the block runs before the
    deployment call returns, `.result()` waits for it, and the server is deleted only after that call
    returned (however the block ended), never when the deployment itself was refused."""
    replicas_up = threading.Event()

    def run(*args: Any, name: str, **kwargs: Any) -> str:
        assert replicas_up.wait(10), "the block did not run while the replicas were starting"
        fake_serve.apps[name] = {"adapter_root": str(tmp_path / "run-a")}
        return fake_serve.run(*args, name=name, **kwargs)

    monkeypatch.setattr(deploy.serve, "run", run)
    with deploy.deploying(config(tmp_path, "run-a")) as deployment:
        assert not deployment.done()
        replicas_up.set()
        assert deployment.result(timeout=10) == "policy"
    assert fake_serve.calls == ["start", "run policy", "delete policy"]

    # The block fails while the replicas start: the server is deleted once its deployment returned.
    replicas_up.clear()
    fake_serve.calls.clear()
    with pytest.raises(RuntimeError, match="an actor failed"), deploy.deploying(config(tmp_path, "run-a")):
        threading.Timer(0.2, replicas_up.set).start()
        raise RuntimeError("an actor failed")
    assert fake_serve.calls == ["start", "run policy", "delete policy"]

    # Refused (another run's store): its error reaches the caller, and the other run's server stays.
    fake_serve.calls.clear()
    refused = pytest.raises(deploy.ServeConflict, match="already serves adapters from")
    with refused, deploy.deploying(config(tmp_path, "run-b")) as deployment:
        deployment.result(timeout=10)
    assert fake_serve.calls == []


def test_a_serve_client_gets_its_handle_at_the_first_call_not_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollout workers and the evaluator make their client in their constructors, which a training run
    calls while its PolicyServer is still deploying: asking Serve for the handle then could fail."""
    from ray import serve

    from diprl.rollout.clients import ServeClient

    asked: list[tuple[str, str]] = []

    def get_deployment_handle(deployment: str, app_name: str) -> Any:
        asked.append((deployment, app_name))
        remote = staticmethod(lambda requests: _Call([f"answer to {len(requests)}"]))
        return type("Handle", (), {"generate": type("Method", (), {"remote": remote})()})()

    monkeypatch.setattr(serve, "get_deployment_handle", get_deployment_handle)
    client = ServeClient(app_name="policy-server-run-x")
    assert asked == []
    assert client.generate([]) == ["answer to 0"] and client.generate([]) == ["answer to 0"]
    assert asked == [("policy-server-run-x", "policy-server-run-x")]  # once, by the application's name
