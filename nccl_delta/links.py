"""Links: one point-to-point connection between two logical ranks, shared by all their groups.

Contract
- A :class:`Link` joins two processes (logical ranks) in one generation and
  serves every group that needs that pair; groups keep their traffic apart by
  tag (see :mod:`nccl_delta.group`). The generation is part of its store
  prefix, so a rebuilt link never meets a stale key or a stale socket of an
  older one.
- A link that saw an error is never reused: its state becomes ``broken`` and
  every later op raises :class:`CommLinkError` at once. Gloo closes the pair on
  an error, and unmatched sends/receives may still sit in it.
- :meth:`Link.sever` (any thread) makes pending ops on both ends fail now; it
  is how ``abandon`` unblocks a thread waiting on a hung peer.
- A link keeps a ledger: messages posted and received per tag, pair collectives
  done, ops in flight. :meth:`Link.quiesce` (``abandon``) stops an idle link
  without breaking it: new ops raise :class:`CommAbandoned`. ``recover`` keeps
  a quiet link only when both ends' ledgers match (nothing sent that was not
  received), and :meth:`Link.resume` reopens it; anything else is rebuilt.
- Errors name the peer's logical rank and the op; a group's ops name the group in ``op``.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

import torch
from torch._C._distributed_c10d import Store

from nccl_delta.errors import CommAbandoned, CommLinkError, CommTimeout

from .config import DeltaConfig

if TYPE_CHECKING:
    from .ring import ReduceOpLike


class TransportHandle(Protocol):
    """A link's transport (:class:`~nccl_delta.transport_gloo.GlooPair`; NCCL's is a
    :class:`~nccl_delta.framing.FramedPair`, which carries the tag that NCCL lacks).

    Its works are opaque to the link, which only hands them back to :meth:`wait` (each transport takes its
    own kind). Optional: ``allreduce`` (see :class:`PairAllreduce`), ``peer_closed``, ``wait_sends``."""

    def isend(self, tensor: torch.Tensor, tag: int) -> object: ...

    def irecv(self, tensor: torch.Tensor, tag: int) -> object: ...

    def wait(self, work: Any, timeout: datetime.timedelta) -> None: ...

    def sever(self) -> None: ...

    def close(self) -> None: ...


class PairAllreduce(TransportHandle, Protocol):
    """A transport with its own 2-rank all-reduce (gloo's pair)."""

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOpLike) -> object: ...


class Ledger(TypedDict):
    """What crossed a quiet link (:meth:`Link.ledger`), as published in the store (JSON)."""

    generation: int
    pair: int
    sent: dict[str, int]
    received: dict[str, int]


@dataclass(kw_only=True, frozen=True)
class LinkId:
    """Who a link connects: both logical ranks and the generation (and the group that first needed it)."""

    group: str
    """Name of the group whose op first needed the link (for messages only: the link serves every group)."""
    a: int
    """The lower logical (global) rank."""
    b: int
    """The higher logical (global) rank."""
    generation: int
    """Epoch the link was built in; part of the rendezvous prefix."""
    transport: str = "gloo"
    """``gloo`` or ``nccl``."""

    def prefix(self) -> str:
        return f"nccl_delta/{self.transport}/{self.a}-{self.b}/g{self.generation}/"

    def side_of(self, rank: int) -> int:
        return 0 if rank == self.a else 1


def connect(link_id: LinkId, me: int, store: Store, config: DeltaConfig) -> Link:
    """Build one link; both ends call this (any thread) and it returns when both have arrived."""
    if me not in (link_id.a, link_id.b):
        raise ValueError(f"rank {me} is not an end of {link_id}")
    peer = link_id.b if me == link_id.a else link_id.a
    timeout = datetime.timedelta(seconds=config.connect_timeout_s)
    start = time.monotonic()
    try:
        if link_id.transport == "nccl":
            from .transport_nccl import connect_nccl_pair

            op_timeout = datetime.timedelta(seconds=config.op_timeout_s)
            handle: TransportHandle = connect_nccl_pair(
                store, link_id.prefix(), link_id.side_of(me), timeout, op_timeout
            )
        else:
            from .transport_gloo import connect_gloo_pair

            handle = connect_gloo_pair(store, link_id.prefix(), link_id.side_of(me), timeout, config.link_host)
    except Exception as exc:  # gloo raises RuntimeError for both a timeout and a refused peer
        waited = time.monotonic() - start
        cls = CommTimeout if waited >= config.connect_timeout_s * 0.95 else CommLinkError
        raise cls(
            f"could not connect to rank {peer} in group {link_id.group!r} (generation {link_id.generation}) "
            f"after {waited:.1f}s: {exc}. Check that the peer is alive and built the same groups in the same order.",
            peers=(peer,),
        ) from exc
    return Link(link_id=link_id, me=me, peer=peer, handle=handle, op_timeout_s=config.op_timeout_s)


class Link:
    """One live connection to ``peer``; owned by a group's link table."""

    def __init__(self, *, link_id: LinkId, me: int, peer: int, handle: TransportHandle, op_timeout_s: float):
        self.link_id = link_id
        self.me = me
        self.peer = peer
        self.handle = handle
        self.state = "open"
        self.error: str | None = None
        self._abandon_reason: str | None = None
        self._timeout = datetime.timedelta(seconds=op_timeout_s)
        self._lock = threading.Lock()
        self.sent: dict[int, int] = {}
        """Messages posted per tag (a send counts once posted: its bytes may be on the wire)."""
        self.received: dict[int, int] = {}
        """Messages received per tag."""
        self.pair_collectives = 0
        """Transport collectives completed on the pair (2-member all-reduces)."""
        self.in_flight = 0
        """Ops posted and not yet waited for successfully."""
        self.awaiting = 0
        """Of those, the ones only the peer can complete: receives and pair collectives
        (:mod:`nccl_delta.finishing` severs a link whose stopped peer leaves one pending)."""

    def __repr__(self) -> str:
        return (
            f"Link({self.me}->{self.peer}, group={self.link_id.group!r}, gen={self.link_id.generation}, {self.state})"
        )

    def _check(self, op: str) -> None:
        if self.state == "quiet":
            raise self._error(op, "the link is quiet until recover() decides whether to keep it")
        if self.state != "open":
            raise self._error(op, f"link is {self.state} ({self.error}); it is never reused")

    def _error(
        self, op: str, why: str, cls: type[CommLinkError] = CommLinkError, *, suspect: bool = False
    ) -> CommLinkError:
        """``suspect``: the transport itself failed the op (the peer closed, reset or stopped answering)."""
        if self._abandon_reason is not None:
            cls, suspect = CommAbandoned, False
            why = f"{self._abandon_reason}; {why}"
        return cls(
            f"{op} with peer rank {self.peer} failed: {why}. "
            "The link is broken: the control plane must replace the peer or recover the epoch.",
            peers=(self.peer,) if suspect else (),
        )

    def _start(self, op: str, send_tag: int | None = None, awaits: bool = False) -> None:
        """Check the link and count one op in flight (and a send's message), atomically with
        :meth:`quiesce`. ``awaits``: a receive or a pair collective (see :attr:`awaiting`)."""
        with self._lock:
            self._check(op)
            self.in_flight += 1
            self.awaiting += awaits
            if send_tag is not None:
                self.sent[send_tag] = self.sent.get(send_tag, 0) + 1

    def isend(self, tensor: torch.Tensor, tag: int, op: str) -> LinkWork:
        self._start(op, send_tag=tag)
        try:
            return LinkWork(self, self.handle.isend(tensor, tag), op)
        except Exception as exc:
            raise self._fail(op, exc) from exc

    def irecv(self, tensor: torch.Tensor, tag: int, op: str) -> LinkWork:
        self._start(op, awaits=True)
        try:
            return LinkWork(self, self.handle.irecv(tensor, tag), op, recv_tag=tag, awaits=True)
        except Exception as exc:
            raise self._fail(op, exc) from exc

    def _done(self, recv_tag: int | None, awaits: bool = False) -> None:
        with self._lock:
            self.in_flight -= 1
            self.awaiting -= awaits
            if recv_tag is not None:
                self.received[recv_tag] = self.received.get(recv_tag, 0) + 1

    # --- surviving an abandon ------------------------------------------------
    def quiesce(self, reason: str) -> bool:
        """Stop an idle link without breaking it (``abandon``); False if an op is in flight or the
        link is not open (the caller then severs it). New ops raise :class:`CommAbandoned`."""
        with self._lock:
            if self.state != "open" or self.in_flight:
                return False
            self.state = "quiet"
            self.error = reason
            self._abandon_reason = reason
            return True

    def ledger(self) -> Ledger | None:
        """What crossed this link (JSON-able), or None if it cannot be kept (not quiet)."""
        with self._lock:
            if self.state != "quiet":
                return None
            return {
                "generation": self.link_id.generation,
                "pair": self.pair_collectives,
                "sent": {str(t): n for t, n in sorted(self.sent.items())},
                "received": {str(t): n for t, n in sorted(self.received.items())},
            }

    def resume(self) -> None:
        """Reopen a quiet link that both ends agreed to keep (``recover``)."""
        with self._lock:
            if self.state == "quiet":
                self.state, self.error, self._abandon_reason = "open", None, None

    def allreduce_pair(self, tensor: torch.Tensor, reduce_op: ReduceOpLike, op: str) -> None:
        """All-reduce ``tensor`` with the peer in one transport call (a 2-member group's whole
        collective); the transport must offer ``allreduce``. On failure the link is severed so the
        peer fails fast too, as a ring does."""
        self._start(op, awaits=True)
        try:
            # The caller checked that the transport has an all-reduce (DeltaGroup.allreduce).
            work = LinkWork(self, cast(PairAllreduce, self.handle).allreduce(tensor, reduce_op), op, awaits=True)
        except Exception as exc:
            raise self._fail(op, exc) from exc
        try:
            work.wait()
        except CommLinkError:
            self.sever(f"{op} failed", abandoned=False)
            raise
        with self._lock:
            self.pair_collectives += 1

    def _fail(self, op: str, exc: BaseException) -> CommLinkError:
        with self._lock:
            if self.state == "open":
                self.state = "broken"
                self.error = str(exc).splitlines()[0][:200]
        cls = CommTimeout if "imed out" in str(exc) else CommLinkError
        return self._error(op, self.error or str(exc), cls, suspect=True)

    def sever(self, reason: str, *, abandoned: bool = True) -> None:
        """Fail pending and future ops on both ends now (any thread); the link is then broken.

        ``abandoned`` marks the failure as ordered by the control plane, so errors are
        :class:`CommAbandoned`; a cascade after a neighbour's error passes ``False``.
        """
        with self._lock:
            if self.state == "quiet":
                return  # nothing is pending on a quiet link, and nothing new can start on it
            if abandoned and self._abandon_reason is None:
                self._abandon_reason = reason
            if self.state == "open":
                self.state = "broken"
                self.error = reason
        self.handle.sever()

    def probe_then_sever(self, reason: str) -> bool:
        """After an op on a neighbouring link failed: whether our peer closed or lost this link's
        connection (to name the dead rank), then sever the link. Returns False for a quiet link,
        which is left untouched (``recover`` may keep it) and never probed.

        The link is marked broken *before* the probe, under the lock ``quiesce`` takes: a probe is a
        receive that times out on a live peer, and a timed-out gloo receive closes the pair. An
        abandon racing the probe must therefore not quiesce the link, or ``recover`` would keep a
        pair the probe closed and the next collective on it would fail."""
        with self._lock:
            if self.state == "quiet":
                return False
            if self.state == "open":
                self.state = "broken"
                self.error = reason
        probe = getattr(self.handle, "peer_closed", None)
        try:
            return bool(probe()) if probe is not None else False
        finally:
            self.handle.sever()

    def close(self, *, wait: bool = False) -> None:
        """Retire a link that is no longer in use (after a switch); ops on it raise from now on.

        Tearing a gloo group down joins its threads (milliseconds per link), so by default it
        happens on a reaper thread, off the switch's critical path.
        """
        with self._lock:
            if self.state in ("open", "quiet"):
                self.state = "closed"
                self.error = "closed by switch"
        if wait:
            self.handle.close()
        else:
            reap(self.handle.close)


def reap(teardown: Callable[[], None]) -> None:
    """Run ``teardown`` on the process's reaper thread: tearing a gloo group down joins its threads,
    which must not hold up the caller (a switch, an abandon, a recovery)."""
    _reaper().put(teardown)


_reaper_queue: queue.SimpleQueue[Callable[[], None]] | None = None
_reaper_pid: int | None = None
_reaper_lock = threading.Lock()


def _reaper() -> queue.SimpleQueue[Callable[[], None]]:
    global _reaper_queue, _reaper_pid
    with _reaper_lock:
        # A forked child inherits the queue but not the thread: start its own.
        if _reaper_queue is None or _reaper_pid != os.getpid():
            _reaper_queue, _reaper_pid = queue.SimpleQueue(), os.getpid()

            def drain(q: queue.SimpleQueue[Callable[[], None]] = _reaper_queue) -> None:
                while True:
                    teardown = q.get()
                    try:
                        teardown()
                    except Exception:  # already torn down by its error; nothing left to free
                        pass

            threading.Thread(target=drain, name="nccl_delta_reaper", daemon=True).start()
        return _reaper_queue


class LinkWork:
    """A pending send or receive on a link; :meth:`wait` blocks at most the op timeout."""

    __slots__ = ("link", "work", "op", "done", "recv_tag", "awaits")

    def __init__(self, link: Link, work: object, op: str, recv_tag: int | None = None, awaits: bool = False):
        self.link = link
        self.work = work
        self.op = op
        self.done = False
        self.recv_tag = recv_tag
        self.awaits = awaits

    def wait(self) -> None:
        if self.done:
            return
        try:
            self.link.handle.wait(self.work, self.link._timeout)
        except Exception as exc:
            raise self.link._fail(self.op, exc) from exc
        self.done = True
        self.link._done(self.recv_tag, self.awaits)


def wait_sends(works: list[LinkWork]) -> None:
    """Wait for sends, all on one link, as one wait where the transport can (``wait_sends``): a ring
    drains dozens of segment sends per op, and each separate wait costs a thread hand-off."""
    if not works:
        return
    link = works[0].link
    batch = getattr(link.handle, "wait_sends", None)
    if batch is None or len(works) == 1 or any(w.link is not link or w.done for w in works):
        for work in works:
            work.wait()
        return
    try:
        batch([w.work for w in works], link._timeout)
    except Exception as exc:
        raise link._fail(works[0].op, exc) from exc
    for work in works:
        work.done = True
        link._done(None)


def wait_all(works: list[LinkWork], on_error: Callable[[CommLinkError], None] | None = None) -> None:
    """Wait for every work; on the first error call ``on_error`` (e.g. to sever sibling links) and re-raise."""
    for work in works:
        try:
            work.wait()
        except CommLinkError as exc:
            if on_error is not None:
                on_error(exc)
            raise
