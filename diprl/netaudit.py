"""`python -m diprl.netaudit [-- command ...]`: run a command where nothing can leave, and list every try.

The command runs in a network namespace of its own with only the loopback interface up (`unshare -n`),
under `strace` tracing `connect()` and the calls that send a datagram to an address without connecting
first (`sendto`, `sendmsg`, `sendmmsg`: UDP as some resolvers send it), with `--seccomp-bpf`, so untraced
calls run at full speed. Nothing can reach another machine from there, so the audit is safe to run
anywhere; what it shows is every attempt the command *would* have made: an address outside 127.0.0.0/8
and ::1, or a DNS query (port 53, which means some library tried to resolve a name that is not in
/etc/hosts).

Unix sockets are listed too, each path with how often it was reached (`UNIX <path> x<n>`): they stay on
this machine, but one can lead off it. The name service cache (`nscd`, `/var/run/nscd/socket`) and
systemd-resolved's socket resolve names for whoever asks, so a program that reaches them is looking a
name up; they are marked `name service`. They do not fail the audit (Ray's own processes talk over
dozens of Unix sockets); read the list.

Without a command it audits the `smoke` training experiment, the whole system in a minute or two: a
local Ray head with its dashboard, the PolicyServer (vLLM), rollout workers, the learner (DeepSpeed),
the league and the evaluator. It exits 1 and names process and address for each attempt, 0 when every
connection stayed on this machine. Needs root (for the namespace), `unshare`, `ip` and `strace`
(Debian: `util-linux`, `iproute2`, `strace`; `make install` installs them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from diprl.ports import is_loopback

TOOLS = ("unshare", "ip", "strace")
_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<call>\w+)\((?P<args>.*)$")
_INET = re.compile(r'sa_family=AF_INET,\s*sin_port=htons\((?P<port>\d+)\),\s*sin_addr=inet_addr\("(?P<addr>[^"]+)"\)')
_INET6 = re.compile(
    r'sa_family=AF_INET6,\s*sin6_port=htons\((?P<port>\d+)\).*?inet_pton\(AF_INET6,\s*"(?P<addr>[^"]+)"'
)
_UNIX = re.compile(r'sa_family=AF_UNIX,\s*sun_path=(?P<abstract>@?)"(?P<path>(?:[^"\\]|\\.)*)"')
_EXEC = re.compile(r'^"(?P<path>[^"]*)",\s*\[(?P<argv>[^\]]*)\]')
_CLONE_RESULT = re.compile(r"=\s*(?P<child>\d+)\s*$")


SEND_CALLS = ("sendto", "sendmsg", "sendmmsg")
"""Calls that carry their destination address: a datagram sent to it without a `connect` first."""
NAME_SERVICE_SOCKETS = ("/var/run/nscd/socket", "/run/nscd/socket", "/run/systemd/resolve/io.systemd.Resolve")
"""Unix sockets that resolve names for their callers: reaching one means a name lookup (that may leave)."""


@dataclass(frozen=True)
class Attempt:
    """One `connect()` to, or datagram sent to, somewhere other than this machine (or a DNS server)."""

    pid: int
    process: str  # the command line of the program that made it
    address: str
    port: int
    call: str = "connect"

    def __str__(self) -> str:
        what = "DNS query to" if self.port == 53 else "connect to" if self.call == "connect" else "datagram to"
        via = "" if self.call == "connect" else f" ({self.call})"
        return f"{what} {self.address}:{self.port} by pid {self.pid} ({self.process}){via}"


@dataclass(frozen=True)
class UnixReach:
    """A Unix socket path the command connected or sent to (`@` starts an abstract name), how often, by whom."""

    path: str
    count: int
    processes: tuple[str, ...]

    @property
    def name_service(self) -> bool:
        return self.path in NAME_SERVICE_SOCKETS

    def __str__(self) -> str:
        what = " (name service: a name lookup)" if self.name_service else ""
        return f"{self.path} x{self.count}{what} by {', '.join(self.processes)[:200]}"


def missing_tools() -> list[str]:
    """What the audit needs and this machine lacks (root included)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (for unshare -n)")
    return missing


def _short(argv: str) -> str:
    words = re.findall(r'"((?:[^"\\]|\\.)*)"', argv)
    return " ".join(words)[:160] or argv[:160]


def _calls(text: str) -> Iterator[tuple[int, str, str, str]]:
    """(pid, call, arguments, program) for each address-carrying call of an strace log, in order.

    Each is named by the last program its process (or the nearest ancestor that ran one) executed, so a
    Ray worker reads as `default_worker.py`, the dashboard as `dashboard.py`.
    """
    program: dict[int, str] = {}
    parent: dict[int, int] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, call, args = int(match["pid"]), match["call"], match["args"]
        if call == "execve":
            exe = _EXEC.match(args)
            if exe is not None and not args.rstrip().endswith("ENOENT (No such file or directory)"):
                program[pid] = _short(exe["argv"])
        elif call in ("clone", "clone3", "fork", "vfork"):
            child = _CLONE_RESULT.search(args)
            if child is not None:
                parent[int(child["child"])] = pid
        elif call == "connect" or call in SEND_CALLS:
            yield pid, call, args, _program_of(pid, program, parent)


def parse_trace(text: str) -> list[Attempt]:
    """The attempts to leave this machine in an `strace -f -e trace=connect,sendto,...,execve,clone...` log."""
    attempts: list[Attempt] = []
    for pid, call, args, process in _calls(text):
        for inet in [*_INET.finditer(args), *_INET6.finditer(args)]:
            address, port = inet["addr"], int(inet["port"])
            if is_loopback(address) and port != 53:
                continue
            if address in ("0.0.0.0", "::") and port == 0:
                continue  # a UDP socket being disconnected (AF_UNSPEC-style reset)
            attempts.append(Attempt(pid, process, address, port, call))
    return attempts


def unix_sockets(text: str) -> list[UnixReach]:
    """Every Unix socket path connected or sent to in an strace log, most reached first (then by path)."""
    counts: dict[str, int] = {}
    processes: dict[str, list[str]] = {}
    for _, _, args, process in _calls(text):
        for unix in _UNIX.finditer(args):
            path = unix["abstract"] + unix["path"]
            counts[path] = counts.get(path, 0) + 1
            if process not in processes.setdefault(path, []):
                processes[path].append(process)
    order = sorted(counts, key=lambda p: (-counts[p], p))
    return [UnixReach(p, counts[p], tuple(processes[p])) for p in order]


def _program_of(pid: int, program: dict[int, str], parent: dict[int, int]) -> str:
    seen = set()
    while pid not in program and pid in parent and pid not in seen:
        seen.add(pid)
        pid = parent[pid]
    return program.get(pid, "?")


def audit(
    command: Sequence[str],
    trace_file: Path,
    cwd: Path | None = None,
    timeout_s: float | None = None,
    output: Path | None = None,
) -> int:
    """Run `command` in a loopback-only namespace under strace; return its exit code (trace in `trace_file`).
    `output`: a file for the command's stdout and stderr together (by default they go where this process's do)."""
    if missing := missing_tools():
        raise RuntimeError(f"the network audit needs {', '.join(missing)}")
    inner = (
        "ip link set lo up && exec strace -f --seccomp-bpf -qq -s 256 "
        f"-e trace=connect,{','.join(SEND_CALLS)},execve,clone,clone3,fork,vfork "
        f"-o {shlex.quote(str(trace_file))} {shlex.join(command)}"
    )
    # -p -f --mount-proc: a process table of its own, so nothing the command leaves behind outlives it.
    wrapped = ["unshare", "-n", "-p", "-f", "--mount-proc", "sh", "-c", inner]
    with open(output, "w") if output is not None else contextlib.nullcontext() as sink:
        merged = subprocess.STDOUT if sink is not None else None
        return subprocess.run(wrapped, cwd=cwd, timeout=timeout_s, check=False, stdout=sink, stderr=merged).returncode


def default_command(run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "diprl.train",
        "+experiment=smoke",
        "train.max_steps=1",
        f"train.run_dir={run_dir}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.netaudit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="where to keep the strace log")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to audit (after --)")
    args = parser.parse_args(argv)
    command = [c for c in args.command if c != "--"] if args.command else []
    workdir = Path(tempfile.mkdtemp(prefix="diprl-netaudit-"))
    trace = args.trace or workdir / "connect.trace"
    if not command:
        command = default_command(workdir / "run")
    print(f"auditing: {shlex.join(command)}", flush=True)
    code = audit(command, trace)
    text = trace.read_text()
    attempts = parse_trace(text)
    reached = unix_sockets(text)
    for unix in reached:
        print(f"UNIX {unix}")
    for attempt in attempts:
        print(f"LEAK {attempt}")
    lookups = sum(u.count for u in reached if u.name_service)
    print(
        f"command_exit={code} attempts_off_loopback={len(attempts)} unix_sockets={len(reached)} "
        f"name_service_lookups={lookups} trace={trace}"
    )
    return 1 if attempts or code else 0


if __name__ == "__main__":
    raise SystemExit(main())
