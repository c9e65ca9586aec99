"""Interruptible waits on gloo work: a blocking ``work.wait`` that :meth:`Pending.cancel` can abandon.

Why: gloo does not fail every pending op when its pair closes. Seen under
TrainMover: a send queued on a 2-rank ring stayed pending forever after both
ends shut the connection down, so the rank never reached recovery. A send's or
a receive's ``is_completed`` only changes inside ``wait``, and a timed-out wait
on one closes its pair, so such a wait can be neither polled nor sliced.

Contract
- :func:`wait` runs ``work.wait(timeout)`` on a waiter thread owned by the
  calling thread and blocks until it returns, raises, or the wait is cancelled
  (by :meth:`Pending.cancel`, e.g. from a link's ``sever``). It then returns,
  re-raises the op's error, or raises :class:`WaitCancelled`.
- A waiter stuck in a cancelled wait is left behind (it is a daemon thread and
  its pair is dead); the caller gets a fresh waiter for its next op. The cost
  on the normal path is one hand-off between two threads per wait (about
  10 us on an idle machine, 0.25 ms on two loaded cores).
- :func:`wait_sliced` does the same on the calling thread, for a collective's
  work: c10d's ``Work.wait(timeout)`` on such a work only raises when the slice
  runs out, leaving the op running (gloo's own send and receive waits close
  their pair instead), so the wait goes on in slices of :data:`SLICE_S` and a
  cancel ends it at the next slice. Only that timeout's error
  (:data:`SLICE_RAN_OUT`) means "not yet": any other error is the op's outcome
  at once, since gloo's reduce-scatter (a composite work that waits for an inner
  all-reduce, ignoring the slice) never reports itself completed. Nothing is
  handed between threads: on two loaded cores each hand-off cost 0.25 ms, and a
  training iteration waits for dozens of collectives.
- :func:`one_slice` waits one slice with nothing to register (most collectives
  end within it); only an op still running after it needs a :class:`Pending`.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from typing import Protocol, cast


class WaitCancelled(RuntimeError):
    """The wait was abandoned by a sever; the op's link is dead."""


class Waitable(Protocol):
    """What a :class:`Pending` waits for: a c10d work, or a transport's batch of them."""

    def wait(self, timeout: datetime.timedelta) -> object: ...


class Pending:
    """One wait in flight; ``cancel`` may be called from any thread.

    It ends once: finished (``_finish``, the op's outcome) or cancelled, whichever comes first. Cheap to
    make, as a collective's wait makes one per op: a sliced wait reads ``cancelled`` at each slice, and
    only a waiter thread's caller blocks on :meth:`wait_ended` (a bare lock held until the end, not an
    ``Event``: its condition variable cost more than the rest of the op's bookkeeping)."""

    __slots__ = ("work", "timeout", "ended", "error", "cancelled", "_lock", "_gate")

    def __init__(self, work: Waitable, timeout: datetime.timedelta):
        self.work, self.timeout = work, timeout
        self.ended = False
        self.error: BaseException | None = None
        self.cancelled: str | None = None
        self._lock = threading.Lock()
        self._gate = threading.Lock()
        self._gate.acquire()  # released once, when the wait ends

    def cancel(self, reason: str) -> None:
        with self._lock:
            if not self.ended:
                self.cancelled = reason
                self._end()

    def _finish(self, error: BaseException | None) -> bool:
        """Record the outcome; False if the wait had been cancelled meanwhile."""
        with self._lock:
            if self.cancelled is not None:
                return False
            self.error = error
            self._end()
            return True

    def _end(self) -> None:  # under self._lock, once
        self.ended = True
        self._gate.release()

    def wait_ended(self, timeout_s: float) -> bool:
        """Block until the wait finished or was cancelled; False if ``timeout_s`` ran out first."""
        if self._gate.acquire(timeout=max(0.0, timeout_s)):
            self._gate.release()  # any later caller returns at once too
            return True
        return self.ended


class _Waiter:
    """A daemon thread running the waits of one caller thread, in order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self.stuck = False
        threading.Thread(target=self._run, name="nccl_delta_waiter", daemon=True).start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item.cancelled is not None:
                continue
            try:
                item.work.wait(item.timeout)
                error = None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            if not item._finish(error):
                # Our caller gave up on this wait and moved to a new waiter; ops queued behind
                # it belong to dead links too.
                return


_local = threading.local()


def _waiter() -> _Waiter:
    w = getattr(_local, "waiter", None)
    if w is None or w.pid != os.getpid() or w.stuck:
        w = _local.waiter = _Waiter()
    return w


SLICE_S = 0.05
"""How long :func:`wait_sliced` blocks at a time: a cancelled wait ends within this."""

SLICE = datetime.timedelta(seconds=SLICE_S)
"""The slice as c10d takes it."""
SLICE_RAN_OUT = "Operation timed out!"
"""What c10d's ``Work::wait(timeout)`` raises when the timeout runs out before the op ends; gloo's
own errors, its op timeout included, read otherwise."""


def one_slice(work: Waitable) -> bool:
    """Wait up to one :data:`SLICE_S` for a collective's ``work``: True if it ended well, False if the slice ran
    out (the op may go on); raises the op's own error. The step of :func:`wait_sliced`; a caller may also take
    the first slice with it alone, with no :class:`Pending` to make, register and drop (most ops end within
    it): no cancel can reach that wait, and none needs to, as it ends within the slice."""
    try:
        work.wait(SLICE)
    except RuntimeError as exc:
        if SLICE_RAN_OUT not in str(exc):
            raise
        return False
    return True


def wait_sliced(pending: Pending) -> None:
    """Like :func:`wait`, on the calling thread, for a collective's work (see the module docstring):
    returns, re-raises the op's error, or raises :class:`WaitCancelled` within :data:`SLICE_S` of a
    cancel (or once the op outlived its timeout by 5 s)."""
    work = pending.work
    deadline = time.monotonic() + pending.timeout.total_seconds() + 5.0
    while True:
        error: BaseException | None = None
        try:
            ended = one_slice(work)
        except RuntimeError as exc:
            # The op's own error. A composite work (gloo's reduce-scatter, which waits for an inner
            # all-reduce and ignores the slice) fails without ever reporting itself completed.
            error, ended = exc, True
        if not ended:
            if cast(_Completable, work).is_completed():
                error = _outcome(pending)  # ended as the slice ran out: its own outcome, at once
            elif pending.cancelled is None and time.monotonic() < deadline:
                continue  # the slice ran out; the op goes on
            else:
                pending.cancel("the op outlived its timeout")
                raise WaitCancelled(pending.cancelled or "the op outlived its timeout")
        if not pending._finish(error):  # cancelled as it ended: the caller moves on either way
            raise WaitCancelled(pending.cancelled or "cancelled")
        if error is not None:
            raise error
        return


def _outcome(pending: Pending) -> BaseException | None:
    try:
        pending.work.wait(pending.timeout)  # complete: returns at once, or raises the op's error
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        return exc
    return None


class _Completable(Protocol):
    def is_completed(self) -> bool: ...


def prestart() -> None:
    """Start the calling thread's waiter now (it is otherwise started by the thread's first send)."""
    _waiter()


def wait(pending: Pending) -> None:
    """Block until ``pending`` finishes or is cancelled (see the module docstring)."""
    w = _waiter()
    w.queue.put(pending)
    # The op's own timeout bounds the wait; the margin lets gloo report it first.
    if not pending.wait_ended(pending.timeout.total_seconds() + 5.0):
        pending.cancel("the op outlived its timeout")
    if pending.cancelled is not None:
        w.stuck = True
        raise WaitCancelled(pending.cancelled)
    if pending.error is not None:
        raise pending.error
