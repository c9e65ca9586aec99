"""The TCP sockets gloo opens, found from outside gloo: how a CPU communicator is cut on purpose.

Why: ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at once but leave an op that waits on a
peer pending until that peer's process exits (measured on torch 2.13: an all-reduce whose peer never
entered stayed blocked after ``abort()``). Shutting the group's sockets down makes every pending op
on them raise ("Connection closed by peer") within milliseconds, on both ends. So the CPU path of
:mod:`nccl_delta` keeps, for each gloo device it creates, the device's listening address, and finds
the group's connections by address when it must cut them.

Contract
- :func:`new_gloo_device` creates a gloo device and returns it with its listener's address. Devices
  are created one at a time in this process (a lock), so the one new listener is the device's own.
- A gloo pair is a connection to or from a device's listener: a group's sockets are the TCP
  connections that appeared during its build whose local address is this process's listener of the
  group, or whose peer address is another member's listener of it. Listener addresses are unique on
  a host while they listen, so this holds while other groups are built on other threads; they are
  recorded then (``NativeComm.own_sockets``) and never looked up by address again, since a closed
  listener's port may be reused by a newer communicator.
- :func:`shut_down` never touches a listener (shutting gloo's listener down aborts the process) and
  shuts a descriptor down only while it still carries the connection found (gloo closes an errored
  pair's descriptor, and the number may be reused).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable

from torch._C._distributed_c10d import ProcessGroupGloo

Address = tuple[str, int]
"""A socket's (host, port)."""

Endpoints = dict[int, tuple[Address, Address]]
"""fd -> (local address, peer address) of connected TCP sockets."""

_DEVICE_LOCK = threading.Lock()


def socket_fds() -> set[int]:
    """This process's descriptors that are sockets."""
    return set(socket_inodes())


def socket_inodes() -> dict[int, str]:
    """fd -> the socket it holds (``socket:[inode]``) for this process's descriptors that are sockets:
    cheap (no socket is opened), and an inode names one socket for as long as it exists."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed between listdir and readlink
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def new_sockets(before: dict[int, str]) -> list[int]:
    """The descriptors that hold a socket not in ``before`` (a :func:`socket_inodes` snapshot): the
    sockets opened since, whatever numbers they took."""
    return [fd for fd, inode in socket_inodes().items() if before.get(fd) != inode]


def _inspect(fds: Iterable[int], *, listeners: bool) -> dict[int, tuple[Address, Address | None]]:
    """fd -> (local, peer) of the TCP sockets among ``fds``: listeners (peer None) or connected ones."""
    found: dict[int, tuple[Address, Address | None]] = {}
    for fd in fds:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # the number now holds a file, not a socket
            os.close(dup)
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            if listening != listeners:
                continue
            local = _address(sock.getsockname())
            found[fd] = (local, None) if listening else (local, _address(sock.getpeername()))
        except OSError:
            continue
        finally:
            sock.close()  # closes only the dup
    return found


def _address(raw: tuple[object, ...]) -> Address:
    return (str(raw[0]), int(str(raw[1])))


def connected_endpoints(fds: Iterable[int] | None = None) -> Endpoints:
    """fd -> (local, peer) of the connected TCP sockets among ``fds`` (default: all of this process)."""
    found = _inspect(socket_fds() if fds is None else fds, listeners=False)
    return {fd: (local, peer) for fd, (local, peer) in found.items() if peer is not None}


def endpoint(fd: int) -> tuple[Address, Address] | None:
    """(local, peer) of the TCP socket now at ``fd``, or ``None`` if there is none."""
    found = connected_endpoints([fd])
    return found.get(fd)


def new_gloo_device(host: str | None) -> tuple[ProcessGroupGloo.Device, Address | None]:
    """A gloo device of its own (a listener and a loop thread) and its listener's address.

    ``host`` picks the address; ``None`` uses ``GLOO_SOCKET_IFNAME`` when set, else the host name.
    The address is ``None`` when it could not be told apart (a listener opened meanwhile outside
    this module); the caller then cannot cut the group's sockets and says so."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    with _DEVICE_LOCK:
        before = socket_inodes()
        if host is not None:
            device = ProcessGroupGloo.create_device(hostname=host)
        elif iface:
            device = ProcessGroupGloo.create_device(interface=iface.split(",")[0])
        else:
            device = ProcessGroupGloo.create_default_device()
        new = {local for local, _ in _inspect(new_sockets(before), listeners=True).values()}
    return device, (next(iter(new)) if len(new) == 1 else None)


def shut_down(sockets: Endpoints) -> int:
    """Shut every socket of ``sockets`` down that still carries its connection; returns how many."""
    done = 0
    for fd, ends in sockets.items():
        if endpoint(fd) != ends:
            continue  # gloo closed it after an error; the number may hold another socket now
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # already closed by the peer
        finally:
            sock.close()
    return done
