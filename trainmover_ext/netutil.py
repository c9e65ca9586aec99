"""Picking free TCP ports, and the address this machine reaches another from.

A port the kernel handed out and got back is free only "a moment ago": two calls in a row can
return the same number, and another process may bind it before we do. :func:`free_ports` keeps
every socket bound until all ``n`` are chosen, so one call never returns a port twice; callers
that then bind late (a child process) still have to retry on ``EADDRINUSE``.
"""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that was free on ``host`` a moment ago (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


def address_towards(host: str) -> str:
    """The local address this machine reaches ``host`` from (an IP; ``OSError`` if ``host`` does not resolve).

    A UDP socket's ``connect`` only asks the kernel for a route and sends nothing, so this works for any
    reachable ``host``, this machine's own name included (then it is the address that name resolves to)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])
