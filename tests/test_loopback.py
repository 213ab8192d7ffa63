"""Nothing but loopback: every connection a diprl command makes stays on this machine.

The audit (`diprl.netaudit`) runs a command in a network namespace with only loopback and traces
`connect()`: nothing can leave, and every attempt to is listed. In CI the tools are installed by
`make install`; elsewhere (no root, no strace) the traced tests skip, the parser's tests always run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from diprl import netaudit
from diprl.netaudit import Attempt, parse_trace, unix_sockets

if TYPE_CHECKING:
    from tests.conftest import SmokeSweep

REPO = Path(__file__).resolve().parents[1]

# A hand-made strace log: a shell that runs python, which forks a dashboard process; the dashboard
# tries the cloud metadata service and a DNS server, python talks to itself over loopback and IPv6
# loopback, and a Unix socket is no network at all.
TRACE = textwrap.dedent("""\
    10    execve("/bin/sh", ["sh", "-c", "python run.py"], 0x7ffd /* 30 vars */) = 0
    10    clone(child_stack=NULL, flags=CLONE_CHILD_SETTID|SIGCHLD) = 11
    11    execve("/usr/bin/python", ["python", "run.py"], 0x55 /* 30 vars */) = 0
    11    connect(3, {sa_family=AF_INET, sin_port=htons(6379), sin_addr=inet_addr("127.0.0.1")}, 16) = 0
    11    clone3({flags=CLONE_VM, exit_signal=SIGCHLD, stack=NULL}, 88 <unfinished ...>
    11    <... clone3 resumed>) = 12
    12    execve("/usr/bin/python", ["python", "dashboard.py", "--host=127.0.0.1"], 0x55 /* 30 vars */) = 0
    12    clone(child_stack=0x7f, flags=CLONE_VM|CLONE_THREAD) = 13
    13    connect(7, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")}, 16 <unfinished ...>
    13    connect(8, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, 16) = 0
    11    connect(4, {sa_family=AF_INET6, sin6_port=htons(8000), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0
    11    connect(5, {sa_family=AF_INET6, sin6_port=htons(8000), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 0
    11    connect(6, {sa_family=AF_UNIX, sun_path="/tmp/ray/session/sockets/raylet"}, 110) = 0
    11    connect(9, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "2606:4700::1", &sin6_addr), sin6_scope_id=0}, 28) = -1 ENETUNREACH
    """)


def test_the_parser_finds_each_attempt_off_loopback_and_names_its_program() -> None:
    attempts = parse_trace(TRACE)
    assert attempts == [
        Attempt(pid=13, process="python dashboard.py --host=127.0.0.1", address="169.254.169.254", port=80),
        Attempt(pid=13, process="python dashboard.py --host=127.0.0.1", address="10.255.255.53", port=53),
        Attempt(pid=11, process="python run.py", address="2606:4700::1", port=443),
    ]
    assert str(attempts[1]).startswith("DNS query to 10.255.255.53:53 by pid 13")


def test_a_dns_query_to_a_loopback_resolver_still_counts() -> None:
    line = '5 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.53")}, 16) = 0'
    assert [a.address for a in parse_trace(line)] == ["127.0.0.53"]


UDP_AND_UNIX = textwrap.dedent("""\
    20    execve("/usr/bin/python", ["python", "resolve.py"], 0x55 /* 30 vars */) = 0
    20    sendto(5, "\\x12\\x34\\x01", 29, MSG_NOSIGNAL, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.2")}, 16) = -1 ENETUNREACH
    20    sendto(6, "ping", 4, 0, {sa_family=AF_INET, sin_port=htons(9999), sin_addr=inet_addr("127.0.0.1")}, 16) = 4
    20    sendto(7, "x", 1, 0, NULL, 0) = 1
    20    sendmsg(8, {msg_name={sa_family=AF_INET6, sin6_port=htons(123), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "2001:db8::7", &sin6_addr), sin6_scope_id=0}, msg_namelen=28, msg_iov=[{iov_base="x", iov_len=1}], msg_iovlen=1, msg_controllen=0, msg_flags=0}, 0) = -1 ENETUNREACH
    20    sendmmsg(9, [{msg_hdr={msg_name={sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.3")}, msg_namelen=16, msg_iov=[{iov_base="q", iov_len=1}], msg_iovlen=1, msg_controllen=0, msg_flags=0}, msg_len=1}], 1, MSG_NOSIGNAL) = -1 ENETUNREACH
    20    connect(3, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT (No such file or directory)
    20    connect(4, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT (No such file or directory)
    20    connect(10, {sa_family=AF_UNIX, sun_path=@"/tmp/.X11-unix/X0"}, 20) = -1 ECONNREFUSED
    20    sendto(11, "<14>hi", 6, 0, {sa_family=AF_UNIX, sun_path="/dev/log"}, 110) = 6
    """)


def test_udp_sent_without_connect_is_an_attempt_too() -> None:
    """Found by review (N10): only `connect()` was traced, so a datagram sent with `sendto`/`sendmsg` to an
    address (UDP without connect, as some resolvers do) went unseen."""
    attempts = parse_trace(UDP_AND_UNIX)
    assert [(a.call, a.address, a.port) for a in attempts] == [
        ("sendto", "10.0.0.2", 53),
        ("sendmsg", "2001:db8::7", 123),
        ("sendmmsg", "10.0.0.3", 53),
    ]
    assert str(attempts[0]) == "DNS query to 10.0.0.2:53 by pid 20 (python resolve.py) (sendto)"


def test_the_unix_sockets_reached_are_reported_with_their_counts() -> None:
    """Found by review (N10): Unix sockets were skipped, though one is a way off the machine (nscd, the
    name service cache, resolves names for whoever asks). Each path is listed with how often it was tried."""
    reached = unix_sockets(UDP_AND_UNIX)
    assert [(u.path, u.count) for u in reached] == [
        ("/var/run/nscd/socket", 2),
        ("/dev/log", 1),
        ("@/tmp/.X11-unix/X0", 1),
    ]
    assert reached[0].processes == ("python resolve.py",) and reached[0].name_service
    assert not reached[1].name_service
    assert unix_sockets(TRACE)[0].path == "/tmp/ray/session/sockets/raylet"


def _need_audit_tools() -> None:
    missing = netaudit.missing_tools()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the network audit; missing {missing} (make install installs them)")
        pytest.skip(f"the network audit needs {missing}")


def _audit(command: list[str], tmp_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> list[Attempt]:
    trace = tmp_path / "connect.trace"
    old = dict(os.environ)
    try:
        if env:
            os.environ.update(env)
        code = netaudit.audit(command, trace, cwd=REPO, timeout_s=timeout_s)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert code == 0, f"the audited command failed ({code})"
    return parse_trace(trace.read_text())


def test_the_audit_sees_an_attempt_to_leave(tmp_path: Path) -> None:
    """The detector works end to end: a program that tries the metadata service is caught and named."""
    _need_audit_tools()
    script = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(1)\n"
        "try:\n"
        "    s.connect(('169.254.169.254', 80))\n"
        "except OSError:\n"
        "    pass\n"
    )
    attempts = _audit([sys.executable, "-c", script], tmp_path, timeout_s=60)
    assert [(a.address, a.port) for a in attempts] == [("169.254.169.254", 80)]
    assert "python" in attempts[0].process


LOCAL_HEAD = """
import json, os, sys
import ray
from diprl.raysession import ray_session
with ray_session(address="local", num_cpus=1, dashboard=True) as info:
    @ray.remote
    def where():
        return ray.util.get_node_ip_address()
    from ray._raylet import AuthenticationMode, get_authentication_mode
    print(json.dumps({
        "task_node": ray.get(where.remote()),
        "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
        "token_auth": get_authentication_mode() == AuthenticationMode.TOKEN,
        "dashboard": info.dashboard_url,
        "home": os.environ["HOME"],
    }))
"""


def test_a_local_head_stays_on_loopback_with_token_auth_and_leaves_home_alone(tmp_path: Path) -> None:
    """A local Ray with its dashboard: no address tried off this machine, token auth on, $HOME untouched.

    Run with the variables a careless shell might have: Ray's cluster switch on (it would bind the
    routable address) and no usage-stats opt-out; `diprl.raysession` must not depend on them.
    """
    _need_audit_tools()
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "PYTHONPATH": str(REPO)}
    env |= {"RAY_USAGE_STATS_ENABLED": "1", "DIPRL_CACHE_DIR": str(tmp_path / "cache")}
    script = tmp_path / "head.py"
    script.write_text(LOCAL_HEAD)
    out = tmp_path / "out.json"
    command = [
        "sh",
        "-c",
        f"env -u RAY_AUTH_TOKEN_PATH -u RAY_AUTH_MODE -u RAY_ADDRESS {sys.executable} {script} > {out}",
    ]
    attempts = _audit(command, tmp_path, timeout_s=180, env=env)
    assert attempts == [], "\n".join(map(str, attempts))
    facts = json.loads(out.read_text().strip().splitlines()[-1])
    assert facts["task_node"] == "127.0.0.1" and set(facts["nodes"]) == {"127.0.0.1"}
    assert facts["token_auth"] is True
    assert facts["dashboard"].startswith("127.0.0.1:")
    assert facts["home"] == str(home), "the driver's HOME is restored after the head starts"
    assert list(home.iterdir()) == [], "nothing is written into the user's home"
    assert (tmp_path / "cache" / "ray" / "auth_token").stat().st_mode & 0o077 == 0, "the token is private"


def test_a_local_head_binds_loopback_even_when_the_environment_asks_for_the_network(tmp_path: Path) -> None:
    """Outside any namespace, where this machine has a routable interface: the head still binds 127.0.0.1.

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported; the script imports Ray first, with
    the variable at 1, exactly as a user's own program might.
    """
    script = tmp_path / "head.py"
    script.write_text(LOCAL_HEAD)
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", PYTHONPATH=str(REPO), HOME=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["task_node"] == "127.0.0.1" and set(facts["nodes"]) == {"127.0.0.1"}


@pytest.mark.slow
def test_the_smoke_experiment_tries_nothing_but_loopback(request: pytest.FixtureRequest) -> None:
    """The whole system (Ray head and dashboard, web app, PolicyServer, rollouts, learner, league, evaluator),
    run as the trained point of tests/conftest.py's `smoke_sweep` (the sweep and rollback tests read it too)."""
    _need_audit_tools()
    sweep: SmokeSweep = request.getfixturevalue("smoke_sweep")  # after the check: untraced, it proves nothing here
    assert sweep.attempts is not None, "the sweep ran untraced"
    assert sweep.attempts == [], "\n".join(map(str, sweep.attempts))
    trained = sweep.sweep_dir / "0"
    assert (trained / "metrics.jsonl").is_file(), sweep.output[-3000:]
    assert any((trained / "adapters").rglob("*.safetensors"))


def test_the_audit_command_line_reports_and_exits_nonzero_on_a_leak(tmp_path: Path) -> None:
    _need_audit_tools()
    script = (
        "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=1)\nexcept OSError:\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "diprl.netaudit", "--trace", str(tmp_path / "t"), "--", sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 1
    assert "LEAK connect to 192.0.2.1:80" in result.stdout
    assert "attempts_off_loopback=1" in result.stdout


def test_the_audit_traces_datagrams_and_lists_unix_sockets(tmp_path: Path) -> None:
    """N10 end to end: a UDP datagram sent without connect is caught, and the Unix sockets are listed."""
    _need_audit_tools()
    script = (
        "import socket\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n    u.sendto(b'x', ('192.0.2.7', 53))\nexcept OSError:\n    pass\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect('/nonexistent/diprl-audit.sock')\nexcept OSError:\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "diprl.netaudit", "--trace", str(tmp_path / "t"), "--", sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "LEAK DNS query to 192.0.2.7:53" in result.stdout and "(sendto)" in result.stdout
    assert "UNIX /nonexistent/diprl-audit.sock x1" in result.stdout
    assert "unix_sockets=" in result.stdout
