"""A second PolicyServer must not start "ready" while another process holds its HTTP port (issue 13)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from diprl.inference import deploy
from diprl.inference.config import ServerConfig
from diprl.ports import free_port, port_in_use


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_port_in_use_sees_a_listener(busy_port: int) -> None:
    assert port_in_use("127.0.0.1", busy_port)
    free = free_port("127.0.0.1")
    assert not port_in_use("127.0.0.1", free)


def test_serve_policy_fails_fast_on_a_port_another_process_holds(
    busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deploy, "_serve_running", lambda: False)
    started: list[object] = []
    monkeypatch.setattr(deploy.serve, "start", lambda **kwargs: started.append(kwargs))
    with pytest.raises(OSError, match=f"127.0.0.1:{busy_port}: the port is already in use"):
        deploy.serve_policy(ServerConfig(port=busy_port))
    assert started == []  # refused before Serve was asked to bind anything


def test_one_loopback_test_for_every_server_and_the_audit() -> None:
    from diprl.ports import is_loopback

    for host in ("localhost", "127.0.0.1", "127.3.4.5", "::1", "[::1]", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "::ffff:10.0.0.1", "example.com", "", "localhost.example"):
        assert not is_loopback(host), host
