"""A lease's keep-alives over one long-lived etcd stream, reused for every renewal.

Why: etcd's ``LeaseKeepAlive`` is a bidirectional stream. pyetcd's ``refresh_lease`` opens a new one for
each renewal and, in gRPC's Python client, a new thread to feed it. Every member renews three times a
TTL, so that was most of what a steady job asked of etcd: 15 streams a second set up and torn down at 8
ranks and the default 2 s TTL, 6,000 a second at 4,000 ranks.

Contract:
- :meth:`KeepAliveStream.refresh` sends one keep-alive request on the lease's stream (opened on first
  use, and again after a failure, on the client's endpoint of that moment) and waits up to the client's
  attempt timeout for etcd's answer. It returns the lease's remaining TTL in seconds (0: etcd does not
  know the lease; the stream is then closed, as a lost lease renews no more).
- Any failure closes the stream and raises: the server's ``grpc.RpcError`` as pyetcd's own calls raise
  it (``ConnectionFailedError`` for an unreachable server), ``ConnectionTimeoutError`` when no answer
  came in time (both count as an unreachable server, so
  :class:`~trainmover_ext.kv.etcd.EtcdKV` retries them on another endpoint), or
  :class:`~trainmover_ext.errors.StoreError` when the stream ended without an answer. A refresh never
  waits on a dead stream: the next one opens a new stream, so a restarted etcd costs one failed renewal.
- :meth:`close` ends the stream and its reader thread; idempotent. One refresh runs at a time (a lock).
- Not fork-safe (threads and a gRPC call): the owning client refuses use in a child process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from trainmover_ext.errors import StoreError


class _Stream:
    """One open ``LeaseKeepAlive`` call: requests in through a queue, answers out through another."""

    def __init__(self, client: Any) -> None:
        self.requests: queue.Queue[Any] = queue.Queue()
        self.answers: queue.Queue[Any] = queue.Queue()
        self.call = client.leasestub.LeaseKeepAlive(
            self._outgoing(), None, credentials=client.call_credentials, metadata=client.metadata
        )
        threading.Thread(target=self._read, name="tm-keepalive-stream", daemon=True).start()

    def _outgoing(self) -> Iterator[Any]:
        # gRPC consumes this on a thread of its own for the call's whole life; None ends the stream.
        while (request := self.requests.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.answers.put(answer)
            self.answers.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting refresh, which raises it
            self.answers.put(exc)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class KeepAliveStream:
    """The keep-alive stream of lease ``lease_id``; see the module docstring."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self._stream: _Stream | None = None
        self._lock = threading.Lock()

    def refresh(self, client: Any) -> int:
        from pyetcd import etcdrpc
        from pyetcd.exceptions import ConnectionTimeoutError

        with self._lock:
            if self._stream is None:
                self._stream = _Stream(client)
            stream = self._stream
            stream.requests.put(etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id))
            try:
                answer = stream.answers.get(timeout=client.timeout)
            except queue.Empty:
                self._drop()
                raise ConnectionTimeoutError(
                    f"no answer to a keep-alive of lease {self.lease_id:x} within {client.timeout:.2f}s"
                ) from None
            if answer is None or isinstance(answer, BaseException):
                self._drop()
                if answer is None:
                    # etcd answers every keep-alive request, with TTL 0 for a lease it does not know; a
                    # stream that ended without an answer says nothing about the lease.
                    raise StoreError(f"etcd refresh lease {self.lease_id:x}: the keep-alive stream ended unanswered")
                try:
                    raise answer
                except grpc.RpcError as exc:
                    # As pyetcd's own calls do: mark the endpoint failed and raise pyetcd's exception for
                    # the code (UNAVAILABLE: ConnectionFailedError), which the client retries elsewhere.
                    client._manage_grpc_errors(exc)
                    raise
            if answer.TTL <= 0:
                self._drop()
            return int(answer.TTL)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
