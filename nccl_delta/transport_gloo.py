"""Gloo pair transport: one standalone 2-rank ``ProcessGroupGloo`` per link.

Contract
- :func:`connect_gloo_pair` is called by both ends of a link with the same
  store prefix and opposite ``side`` (0 for the lower logical rank). It blocks
  until the peer arrives or ``timeout`` passes, and may run on any thread: the
  gloo constructor releases the GIL.
- Sends and receives are non-blocking and run on the caller's thread; only
  ``wait`` blocks, always with a deadline.
- :meth:`GlooPair.sever` may be called from any thread. It shuts down the
  pair's TCP socket, which makes a pending op on *both* ends raise at once.
  Gloo's own ``abort()``/``shutdown()`` leave pending ops blocked, so this is
  the only way to unblock a thread waiting on a peer that hangs.
- A pair that raised once is never used again (gloo closes it); the owner
  builds a new link under a new store prefix.
"""

from __future__ import annotations

import datetime
import json
import logging
import select
import threading
from typing import TYPE_CHECKING, Protocol

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store
from torch.distributed import AllreduceOptions, Work

from .sockets import Address, Endpoints, connected_endpoints, endpoint, new_gloo_device, shut_down, socket_fds
from .waiter import Pending, Waitable, WaitCancelled, wait_sliced
from .waiter import wait as wait_interruptible

if TYPE_CHECKING:
    from .ring import ReduceOpLike

logger = logging.getLogger(__name__)


class PairGroup(Protocol):
    """The calls a pair makes on its 2-rank c10d group (``ProcessGroupGloo``, ``ProcessGroupNCCL``).

    c10d's ``Backend`` binds them all, but torch's stub omits most, so a constructed group is given this type."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions = ...) -> Work: ...

    def eager_connect_single_device(self, device: torch.device | None) -> None: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None: ...


# Above every tag the groups use (all below 2**30, see nccl_delta.group): never matched by a send.
PROBE_TAG = (1 << 30) + 1


def _link_device(host: str | None) -> ProcessGroupGloo.Device:
    """A gloo device (listener + event loop thread) of the link's own.

    Each link gets its own, as torch gives each process group: the device then lives exactly as
    long as the link's group, so closing a link also stops the listener and the loop that served
    it. A device shared by every link of the process outlived the groups closed on it, and
    processes that built and closed links on one shared device were seen to crash in a gloo
    thread (docs/nccl_delta.md). The cost is one thread and one listening port per link."""
    return new_gloo_device(host)[0]


def _socket_fds() -> set[int]:
    return socket_fds()


def _connected_endpoints(fds: set[int]) -> Endpoints:
    """fd -> (local addr, peer addr) of the connected TCP sockets among ``fds``."""
    return connected_endpoints(fds)


def _endpoint(fd: int) -> tuple[Address, Address] | None:
    return endpoint(fd)


class _Send:
    """A send :meth:`GlooPair.wait` waits for interruptibly, on the waiter thread (gloo completes a send
    only inside ``wait``)."""

    __slots__ = ("work",)

    def __init__(self, work: Waitable):
        self.work = work


class _Sends:
    """Several sends on one pair waited for as one (one hand-off to the waiter thread, not one each)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Waitable]):
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self.works:
            work.wait(timeout)


class _Collective(_Send):
    """The pair's all-reduce: gloo runs it on the pair's worker thread and completes it there, so
    :meth:`GlooPair.wait` waits for it in slices, interruptibly, on the caller's thread."""

    __slots__ = ()


class GlooPair:
    """The transport handle of one link: a 2-rank gloo group plus its socket."""

    def __init__(
        self, pg: PairGroup | None, side: int, sockets: dict[int, tuple[Address, Address]], timeout: datetime.timedelta
    ):
        self.pg = pg
        self.side = side
        self.peer_side = 1 - side
        # fd -> (local, peer) address at connect time. Gloo closes a pair's fd when the pair
        # fails, and the number may then be reused by an unrelated socket: every use of an fd
        # first checks that it still carries the same connection.
        self._sockets = sockets
        self._timeout = timeout
        self._severed = False
        self._pending: set[Pending] = set()
        self._lock = threading.Lock()

    @property
    def severable(self) -> bool:
        """Whether :meth:`sever` can unblock pending ops (the pair's socket was identified)."""
        return bool(self._sockets)

    def _live_fds(self) -> list[int]:
        return [fd for fd, ends in self._sockets.items() if _endpoint(fd) == ends]

    def peer_closed(self, grace_s: float = 0.05) -> bool | None:
        """Whether the peer closed (or lost) the connection; waits at most ``grace_s``.

        Used only on the failure path, to name the dead peer when an op fails: the rank before
        a killed rank in a ring may first see the error cascade in from its other neighbour.
        A probe receive on a tag nobody sends raises at once on a closed pair and times out
        on a live one; the link is severed right after, so the dangling receive never matters.
        """
        if self._severed or self.pg is None:
            return False  # we cut it ourselves: says nothing about the peer
        live = self._live_fds()
        if self._sockets and not live:
            return True  # gloo closed the pair's socket after an error
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        if poller.poll(0):
            return True
        try:
            self.pg.recv([torch.empty(1)], self.peer_side, PROBE_TAG).wait(datetime.timedelta(seconds=grace_s))
        except Exception as exc:
            return "imed out" not in str(exc)  # a timeout means the peer is still there
        return False

    def isend(self, tensor: torch.Tensor, tag: int) -> _Send:
        assert self.pg is not None, "the pair was closed"
        return _Send(self.pg.send([tensor], self.peer_side, tag))

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOpLike) -> _Collective:
        """The pair's own gloo all-reduce: one call instead of a send and a receive per step."""
        opts = AllreduceOptions()
        # pybind converts a RedOpType (ReduceOp.SUM etc.) to a ReduceOp; the stub's field takes a ReduceOp only.
        opts.reduceOp = reduce_op  # type: ignore[assignment]
        assert self.pg is not None, "the pair was closed"
        return _Collective(self.pg.allreduce([tensor], opts))

    def irecv(self, tensor: torch.Tensor, tag: int) -> Work:
        assert self.pg is not None, "the pair was closed"
        return self.pg.recv([tensor], self.peer_side, tag)

    def wait(self, work: Work | _Send, timeout: datetime.timedelta) -> None:
        """Block until ``work`` is done; :meth:`sever` interrupts a pending send even if gloo never fails it.

        Only sends need the waiter thread (see :mod:`nccl_delta.waiter`): the op gloo was seen
        to leave pending after its pair closed is a send, while a receive on a closed pair
        raises. Receives, most of a ring's waits, block on the caller's thread. The pair's
        all-reduce, which gloo was also seen to leave pending after a sever, completes on the
        pair's worker thread: the caller waits for it in slices, which a sever interrupts too.
        """
        if not isinstance(work, _Send):
            work.wait(timeout)
            return
        pending = Pending(work.work, timeout)
        with self._lock:
            if self._severed:
                raise WaitCancelled("the link was severed")
            self._pending.add(pending)
        try:
            if isinstance(work, _Collective):
                wait_sliced(pending)
            else:
                wait_interruptible(pending)
        finally:
            with self._lock:
                self._pending.discard(pending)

    def wait_sends(self, works: list[_Send], timeout: datetime.timedelta) -> None:
        """Block until every send in ``works`` (from :meth:`isend`) is done, as one interruptible wait."""
        self.wait(_Send(_Sends([w.work for w in works])), timeout)

    def sever(self) -> None:
        """Shut the pair's socket down so that pending ops on both ends raise now."""
        with self._lock:
            if self._severed:
                return
            self._severed = True
            for pending in self._pending:
                pending.cancel("the link was severed while an op was pending")
            shut_down(self._sockets)

    def close(self) -> None:
        """Drop the group; the socket closes when gloo frees the pair."""
        self.pg = None


def connect_gloo_pair(store: Store, prefix: str, side: int, timeout: datetime.timedelta, host: str | None) -> GlooPair:
    """Build the 2-rank gloo group of one link; both ends call this with the same ``prefix``."""
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub's Options lacks _devices/_threads
    opts._timeout = timeout
    opts._devices = [_link_device(host)]
    # Only send/recv run on a pair, inline on the caller's thread, so one worker thread is enough.
    opts._threads = 1
    link_store = PrefixStore(prefix, store)
    # By connection, not by fd number: a link closed by another thread meanwhile frees its number,
    # and the new pair's socket may take it.
    before = _connected_endpoints(_socket_fds())
    pg: PairGroup = ProcessGroupGloo(link_store, side, 2, opts)  # type: ignore[assignment]  # see PairGroup
    # A round trip first: gloo may still replace the pair's first socket after the constructor
    # returns (seen as the recorded fd later holding another connection). Data that crossed
    # the pair proves the socket we record below is the one it keeps.
    probe = torch.zeros(1)
    works = [pg.send([torch.ones(1)], 1 - side, 0), pg.recv([probe], 1 - side, 0)]
    for work in works:
        work.wait(timeout)
    mine = {fd: ends for fd, ends in _connected_endpoints(_socket_fds()).items() if before.get(fd) != ends}
    # Other threads may open sockets meanwhile, so keep only the socket whose
    # mirror image (peer <-> local) the other end reports: that is the pair.
    link_store.set(f"sock/{side}", json.dumps(list(mine.values())))
    theirs = json.loads(link_store.get(f"sock/{1 - side}").decode())
    mirrored = {((str(peer[0]), int(peer[1])), (str(local[0]), int(local[1]))) for local, peer in theirs}
    sockets = {fd: (local, peer) for fd, (local, peer) in mine.items() if (local, peer) in mirrored}
    if not sockets:
        logger.warning("link %s: pair socket not identified; abandon falls back to the op timeout", prefix)
    return GlooPair(pg, side, sockets, timeout)
