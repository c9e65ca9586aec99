"""A TCP proxy on loopback that a test can cut: one node's way to etcd, severed while its processes live.

Contract: :class:`CuttableProxy` forwards every connection to ``target`` on two threads each. :meth:`cut`
shuts every connection down at once and refuses new ones (accepted and closed) until :meth:`heal`, as a
network partition would; :meth:`close` ends it all. Every blocking call has a timeout.
"""

from __future__ import annotations

import socket
import threading


class CuttableProxy:
    """See the module docstring; ``port`` is where to connect instead of ``target``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shut(sock)

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                _shut(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                # A cut between the check above and here must still sever this one: cut() takes the lock.
                severed = self._cut.is_set()
                if not severed:
                    self._sockets += [client, upstream]
            if severed:
                _shut(client)
                _shut(upstream)
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), name="proxy-pump", daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    src.settimeout(None)
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _shut(src)
        _shut(dst)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
