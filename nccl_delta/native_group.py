"""NativeGroup: one torch/megatron group whose ops run on a native communicator that can be replaced.

Contract
- Every group but WORLD is a :class:`NativeGroup` (WORLD stays a ring over links, see
  :mod:`nccl_delta.group`, so that a replacement never rebuilds it). Its ops go to torch's own
  backend of the group's current generation (:mod:`nccl_delta.native`), one backend call per op,
  and return that backend's work wrapped in :class:`NativeWork`: asynchronous, so megatron's
  ``--overlap-grad-reduce`` and ``--overlap-param-gather`` overlap as on plain torch groups.
- The handle megatron holds (:class:`~nccl_delta.backend.DeltaProcessGroup`) keeps pointing at this
  object; :meth:`install` swaps the communicator behind it at an iteration boundary (a planned move's
  phase 2, or ``recover``/``join``).
- Members are logical ranks in group-rank order and never change; only the process behind a rank does.
- State: ``open``; ``quiet`` (an abandon found it idle: new ops raise :class:`CommAbandoned`, and
  ``recover`` may keep it); ``aborted`` (an abandon cut it: pending ops raise); ``broken`` (its
  communicator raised). Only an ``open`` group runs ops; an aborted or broken one is rebuilt.
- A ledger counts what crossed the group in its generation: collectives issued, messages sent to and
  received from each peer. ``recover`` keeps a quiet group only when every member's ledger agrees
  (nothing issued on one end that the others did not issue).
- A group of the whole job (megatron's distributed-optimizer instance group, say) is never rebuilt by a
  replacement: its communicator is dropped and built again by its next op (:meth:`NativeGroup.reset`).
- The primary communicator (NCCL on a GPU, gloo on CPU) is built with the group; a CPU collective
  on a GPU group (megatron's object collectives) builds the group's gloo communicator on first use,
  in the same generation, on every member at once (they are all in that collective).
- Errors: a failed op raises :class:`CommLinkError` naming the group, the op and, where gloo says
  which connection closed, the suspected peer; :class:`CommAbandoned` when the control plane cut it;
  :class:`CommTimeout` past the op deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.futures import Future

from nccl_delta.errors import CommAbandoned, CommLinkError, CommTimeout

from .native import NativeComm, build_comm
from .waiter import SLICE, Pending, one_slice, wait, wait_sliced

if TYPE_CHECKING:
    from .world import DeltaWorld

OPEN, QUIET, ABORTED, BROKEN = "open", "quiet", "aborted", "broken"
ABORT_SETTLE_S = 2.0
"""How long an op of an aborted group may take to end by itself (fail or finish) before its wait is cancelled."""

IssueObserver = Callable[["NativeGroup", str], None]
_observer: IssueObserver | None = None
WaitObserver = Callable[[str, int, int | None], contextlib.AbstractContextManager[None]]
_wait_observer: WaitObserver | None = None


def observe_issues(observer: IssueObserver | None) -> None:
    """Call ``observer(group, op)`` right after every op a native group issues (``None``: stop). For
    failure drills that must strike inside a collective (``trainmover_ext.runtime.faults``); one
    attribute test per op otherwise."""
    global _observer
    _observer = observer


def observe_waits(observer: WaitObserver | None) -> None:
    """Wrap every wait for an op that has not completed yet in ``observer(group name, op number, peer)``
    (``None``: stop): how a rank says which collective its thread blocks in (a progress watchdog
    tells a waiting rank from the one it waits for), and, for a point-to-point op, on which peer
    (its logical rank; None for a collective: a slow-link watch times each pair). One test per wait
    otherwise."""
    global _wait_observer
    _wait_observer = observer


def waiting_in(group: str, number: int = 0, peer: int | None = None) -> contextlib.AbstractContextManager[None]:
    """The wait observer's context for a blocking op of ``group`` that is not a native work (WORLD's ring,
    a pair still being built, whose ``peer`` is the other end); a no-op without an observer."""
    observer = _wait_observer
    return observer(group, number, peer) if observer is not None else contextlib.nullcontext()


def own_client(store: Store) -> Store:
    """An independent clone of ``store`` where it can be cloned (TCPStore), else ``store`` itself (the
    Python etcd store, which is thread-safe)."""
    try:
        clone: Store = store.clone()  # type: ignore[attr-defined]  # bound in c10d; not in the stub
        return clone
    except Exception:  # a store implemented in Python without clone()
        return store


class NativeGroup:
    """See the module docstring."""

    kind = "native"

    def __init__(self, *, world: DeltaWorld, name: str, members: list[int], store: Store):
        if world.rank not in members:
            raise ValueError(f"rank {world.rank} is not a member of group {name!r} {members}")
        self.world = world
        self.name = name
        self.members = list(members)
        self.store = store
        self.index = self.members.index(world.rank)
        self.size = len(self.members)
        self.spans_world = self.size == world.world_size and self.size > 2
        """A group of the whole job (not WORLD itself): a replacement drops its communicator instead of
        rebuilding it (:meth:`reset`)."""
        self.comms: dict[str, NativeComm] = {}
        """Device type -> the communicator of the current generation."""
        self.generation = -1
        """The epoch the current communicators were built in (-1: none yet)."""
        self.state = OPEN
        self.reason: str | None = None
        self.collectives = 0
        self.sent: dict[int, int] = {}
        """Messages posted to each peer (logical rank) in this generation."""
        self.received: dict[int, int] = {}
        """Receives posted from each peer (logical rank) in this generation."""
        self.any_source = 0
        """Receives from any source (a ledger with one cannot be matched: the group is rebuilt)."""
        self.issued = 0
        """Ops issued on the group in every generation (names an op in a wait)."""
        self._recent: deque[Any] = deque()
        """Works issued and not yet seen complete, oldest first (whether an op is in flight)."""
        self._waits: set[Pending] = set()
        """gloo: the waits in progress on this group's works, which an abort cancels (gloo may leave an
        op pending after its pair closed: the waiter must not depend on it)."""
        self._lock = threading.Lock()
        self._op_timeout = datetime.timedelta(seconds=world.config.op_timeout_s)

    def __repr__(self) -> str:
        return f"NativeGroup({self.name!r}, members={self.members}, gen={self.generation}, {self.state})"

    # --- communicators --------------------------------------------------------------
    def prefix(self, generation: int, device_type: str) -> str:
        return f"nccl_delta/grp/{self.name}/e{generation}/{device_type}/"

    def build(self, generation: int, device_type: str | None = None) -> NativeComm:
        """Build this group's communicator of ``generation`` (blocks until every member built it)."""
        device_type = device_type or self.world.device_type
        return build_comm(
            # A client of its own: builds run on several threads at once, and a thread blocked in a
            # TCPStore client's get blocks every other thread using that client.
            store=own_client(self.store),
            prefix=self.prefix(generation, device_type),
            rank=self.index,
            size=self.size,
            device_type=device_type,
            generation=generation,
            config=self.world.config,
        )

    def install(self, comm: NativeComm) -> None:
        """Make ``comm`` the group's communicator (its generation's ledger starts at zero) and retire
        the old ones: an idle old one is closed; one an abandon left is aborted first, so that no
        thread of it stays blocked on a peer."""
        self._start_generation({comm.device_type: comm}, comm.generation)

    def _start_generation(self, comms: dict[str, NativeComm], generation: int) -> None:
        with self._lock:
            old, cutoff = list(self.comms.values()), self.state != OPEN
            self.comms, self.generation = comms, generation
            self.state, self.reason = OPEN, None
            self.collectives, self.any_source = 0, 0
            self.sent, self.received = {}, {}
            self._recent.clear()
        for stale in old:
            if cutoff:
                stale.abort()
            stale.close()

    def _comm(self, device_type: str, op: str) -> NativeComm:
        comm = self.comms.get(device_type)
        if comm is not None:
            return comm
        if self.state != OPEN:
            raise self._refused(op)
        generation = self.generation
        if generation < 0:
            if not self.spans_world:
                raise CommLinkError(
                    f"{op} in group {self.name!r} before its communicator was built (a joiner calls join)"
                )
            generation = self.world.epoch  # a group of the whole job is built on first use (see reset)
        # Built on first use: every member is in this op. A newer epoch's abandon cuts the wait.
        from .world import build_concurrently

        def discard(built: NativeComm) -> None:
            built.abort()
            built.close()

        comm = build_concurrently(
            self.world, {self.name: lambda: self.build(generation, device_type)}, discard, f"{op}'s set-up"
        )[self.name]
        with self._lock:
            if self.state == OPEN and device_type not in self.comms and self.generation in (-1, generation):
                self.comms[device_type] = comm
                self.generation = generation
                return comm
        discard(comm)
        raise self._refused(op)

    def reset(self) -> None:
        """Drop the communicators (a replacement touched this group of the whole job): the next op
        builds one in the epoch it runs in, on every member at once. Rebuilding such a group during a
        replacement would cost as much as the whole job; most are never used (megatron's distributed-
        optimizer instance group with one instance)."""
        self._start_generation({}, -1)

    # --- ops ---------------------------------------------------------------------
    def run(
        self,
        op: str,
        device: torch.device,
        call: Callable[[Any], Any],
        *,
        send_to: int | None = None,
        recv_from: int | None = None,
        any_source: bool = False,
    ) -> NativeWork:
        """Issue one op on the current communicator: ``call(backend)`` returns the backend's work.

        ``send_to``/``recv_from`` (logical ranks) mark a point-to-point op for the ledger."""
        comm = self._comm(device.type, op)
        with self._lock:
            if self.state != OPEN or self.comms.get(device.type) is not comm:
                raise self._refused(op)
            try:
                work = call(comm.backend)
            except Exception as exc:
                raise self._failed_locked(comm, op, exc) from exc
            if send_to is not None:
                self.sent[send_to] = self.sent.get(send_to, 0) + 1
            elif recv_from is not None:
                self.received[recv_from] = self.received.get(recv_from, 0) + 1
            elif any_source:
                self.any_source += 1
            else:
                self.collectives += 1
            recent = self._recent
            while recent and recent[0].is_completed():
                recent.popleft()
            recent.append(work)
            self.issued += 1
            number = self.issued
        if _observer is not None:
            _observer(self, op)
        peer = send_to if send_to is not None else recv_from
        p2p = peer is not None or any_source
        return NativeWork(work, self, comm, op, number, peer, p2p)

    def _refused(self, op: str) -> CommLinkError:
        if self.state in (QUIET, ABORTED):
            return CommAbandoned(f"{op} in group {self.name!r}: {self.reason}; call recover(epoch) first")
        return CommLinkError(
            f"{op} in group {self.name!r}: its communicator is {self.state} ({self.reason}); it is never reused"
        )

    def failed(self, comm: NativeComm, op: str, exc: BaseException) -> CommLinkError:
        """The error to raise for ``exc`` from an op on ``comm`` (the group is broken from now on)."""
        with self._lock:
            return self._failed_locked(comm, op, exc)

    def _failed_locked(self, comm: NativeComm, op: str, exc: BaseException) -> CommLinkError:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        if comm is self.comms.get(comm.device_type) and self.state in (QUIET, ABORTED) or comm.aborted:
            return CommAbandoned(f"{op} in group {self.name!r}: {self.reason or 'abandoned'}; {first}")
        if comm is self.comms.get(comm.device_type) and self.state == OPEN:
            self.state, self.reason = BROKEN, first
        suspects = tuple(self.members[r] for r in comm.suspects(exc))
        cls = CommTimeout if "imed out" in first else CommLinkError
        named = f" (peer rank {', '.join(map(str, suspects))} closed its connection)" if suspects else ""
        return cls(
            f"{op} in group {self.name!r} (members {self.members}) failed{named}: {first}. The group's "
            "communicator is broken: the control plane must replace the peer or recover the epoch.",
            peers=suspects,
        )

    # --- surviving an abandon ------------------------------------------------------
    def busy(self) -> bool:
        """Whether an op issued on this group may still be in flight."""
        with self._lock:
            return self._busy_locked()

    def _busy_locked(self) -> bool:
        return any(not work.is_completed() for work in self._recent)

    def quiesce(self, reason: str) -> bool:
        """Stop an idle open group without cutting it; False if an op may be in flight or it is not open."""
        with self._lock:
            if self.state != OPEN or self._busy_locked():
                return False
            self.state, self.reason = QUIET, reason
            return True

    def abort(self, reason: str) -> None:
        """Cut the group (any thread): pending ops raise :class:`CommAbandoned`; it is rebuilt later."""
        with self._lock:
            if self.state != BROKEN:
                self.state = ABORTED
            self.reason = self.reason if self.state == BROKEN else reason
            comms = list(self.comms.values())
            waits, self._waits = list(self._waits), set()
        for comm in comms:
            comm.abort()
        # The op normally ends by itself within milliseconds of its sockets' shutdown, failed or done, and
        # its waiter sees that outcome, as without a cut. Only an op gloo leaves pending for good (it
        # writes nothing more) has its wait cancelled, ABORT_SETTLE_S later.
        for pending in waits:
            _cancel_later(pending, f"group {self.name!r} was cut: {reason}")

    def wait(self, work: Any, comm: NativeComm, timeout: datetime.timedelta | None, p2p: bool = False) -> None:
        """Wait for ``work``, an op of ``comm`` (``p2p``: a send or a receive). On gloo an abort of the group
        lets the op end by itself (its outcome, success included, is what the wait returns, as without a
        cut: raising for an op that did complete would break :mod:`nccl_delta.finishing`), and cancels the
        wait (:class:`~nccl_delta.waiter.WaitCancelled`) only if gloo leaves the op pending past
        :data:`ABORT_SETTLE_S`. A collective is waited for on the calling thread, in slices (the first with no
        bookkeeping: most ops end within it); a send or a receive on a waiter thread (:mod:`nccl_delta.waiter`)."""
        if comm.device_type != "cpu":
            work.wait() if timeout is None else work.wait(timeout)
            return
        if not p2p and (timeout is None or timeout >= SLICE) and one_slice(work):
            return
        pending = Pending(work, timeout or self._op_timeout)
        with self._lock:
            self._waits.add(pending)
            late = comm.aborted  # cut before this wait began: the op may have ended, or may never
        if late:
            _cancel_later(pending, f"group {self.name!r} was cut: {self.reason}")
        try:
            wait(pending) if p2p else wait_sliced(pending)
        finally:
            with self._lock:
                self._waits.discard(pending)

    def resume(self) -> None:
        """Reopen a quiet group that every member agreed to keep (``recover``)."""
        with self._lock:
            if self.state == QUIET:
                self.state, self.reason = OPEN, None

    def counts(self) -> dict[str, Any]:
        """The ledger's counts whatever the state (JSON-able)."""
        with self._lock:
            return self._counts_locked()

    def _counts_locked(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "collectives": self.collectives,
            "sent": {str(p): n for p, n in sorted(self.sent.items())},
            "received": {str(p): n for p, n in sorted(self.received.items())},
        }

    def ledger(self) -> dict[str, Any] | None:
        """What crossed this group in its generation, or None when it cannot be kept (not quiet)."""
        with self._lock:
            if self.state != QUIET or self.generation < 0 or self.any_source:
                return None
            return self._counts_locked()

    def close(self) -> None:
        """Retire every communicator (the group is forgotten)."""
        with self._lock:
            comms, self.comms = list(self.comms.values()), {}
            self.state, self.reason = BROKEN, "closed"
        for comm in comms:
            comm.abort()
            comm.close()


def _cancel_later(pending: Pending, reason: str) -> None:
    """Cancel ``pending``'s wait :data:`ABORT_SETTLE_S` from now unless its op ended by itself first."""
    timer = threading.Timer(ABORT_SETTLE_S, pending.cancel, args=(reason,))
    timer.daemon = True
    timer.start()


def ledgers_agree(ledgers: dict[int, dict[str, Any] | None]) -> bool:
    """Whether a group may be kept: every member's ledger (logical rank -> ledger) is there, of one
    generation and one count of collectives, and every message one member sent another was received."""
    if any(entry is None for entry in ledgers.values()):
        return False
    entries: dict[int, dict[str, Any]] = {rank: entry for rank, entry in ledgers.items() if entry is not None}
    first = next(iter(entries.values()))
    for rank, entry in entries.items():
        if entry["generation"] != first["generation"] or entry["collectives"] != first["collectives"]:
            return False
        for peer, other in entries.items():
            if peer != rank and entry["sent"].get(str(peer), 0) != other["received"].get(str(rank), 0):
                return False
    return True


class NativeWork(dist.Work):
    """A native backend's work behind the group handle; ``wait`` turns its errors into ours."""

    def __init__(
        self,
        work: Any,
        group: NativeGroup,
        comm: NativeComm,
        op: str,
        number: int = 0,
        peer: int | None = None,
        p2p: bool = False,
    ):
        super().__init__()
        self._work = work
        self._group = group
        self._comm = comm
        self._op = op
        self._number = number
        self._peer = peer
        """The logical rank at the other end of a point-to-point op (None: a collective)."""
        self._p2p = p2p
        """A send or a receive (from one peer or any)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        observer = _wait_observer
        if observer is not None and not self._work.is_completed():
            with observer(self._group.name, self._number, self._peer):
                return self._wait(timeout)
        return self._wait(timeout)

    def _wait(self, timeout: datetime.timedelta | None) -> bool:
        try:
            self._group.wait(self._work, self._comm, timeout, self._p2p)
        except Exception as exc:
            raise self._group.failed(self._comm, self._op, exc) from exc
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return list(self._work.result())

    def get_future(self) -> Future[Any]:
        future: Future[Any] = self._work.get_future()
        return future

    def synchronize(self) -> None:
        self._work.synchronize()

    def source_rank(self) -> int:
        return int(self._work.source_rank())


class WorkList(dist.Work):
    """Several works waited for as one (a coalesced op the backend lacks, issued op by op)."""

    def __init__(self, works: list[dist.Work], result: list[torch.Tensor]):
        super().__init__()
        self._works = works
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> Future[list[torch.Tensor]]:
        self.wait()
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        for work in self._works:
            work.synchronize()
