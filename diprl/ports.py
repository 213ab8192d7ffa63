"""TCP ports on this machine: one that is free now, and whether one is taken; and which hosts are loopback.

The PolicyServer picks its HTTP port here (`port: 0`) and checks that no other process holds the one it
was given; the learner group's rank 0 picks the port its ranks meet at, and a one-process learner the
`MASTER_PORT` torch expects. Standard library only, so every layer may use it.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port", "is_loopback", "port_in_use"]


def is_loopback(host: str) -> bool:
    """True for `localhost`, 127.0.0.0/8, ::1 (bracketed or not) and IPv4-mapped loopback (::ffff:127.0.0.1);
    any other name or address counts as exposed. The one test of what binds or connects off this machine."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def free_port(host: str = "127.0.0.1") -> int:
    """A port no one listens on at `host` now (the kernel's pick); free until someone else binds it."""
    with socket.socket(socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on (host, port): binding it (as Serve's proxy will) fails."""
    for family, kind, proto, _name, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is not "in use"
            try:
                sock.bind(address)
            except OSError:
                return True
    return False
