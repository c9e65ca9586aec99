"""Interruptible waits on gloo work: a blocking ``work.wait`` that :meth:`Pending.cancel` can abandon.

Why: gloo does not fail every pending op when its pair closes. Seen under
TrainMover: a send queued on a 2-rank ring stayed pending forever after both
ends shut the connection down, so the rank never reached recovery. Gloo's
``is_completed`` only changes inside ``wait``, and a timed-out gloo wait closes
the pair, so the wait cannot be polled either.

Contract
- :func:`wait` runs ``work.wait(timeout)`` on a waiter thread owned by the
  calling thread and blocks until it returns, raises, or the wait is cancelled
  (by :meth:`Pending.cancel`, e.g. from a link's ``sever``). It then returns,
  re-raises the op's error, or raises :class:`WaitCancelled`.
- A waiter stuck in a cancelled wait is left behind (it is a daemon thread and
  its pair is dead); the caller gets a fresh waiter for its next op. The cost
  on the normal path is one hand-off between two threads per wait (about
  10 us on an idle machine, 0.25 ms on two loaded cores).
- :func:`wait_completion` does the same without a waiter thread, for works that
  complete on gloo's own worker thread (their future fires without ``wait``);
  :func:`wait_cancellable` picks that where the work has a future (gloo's
  collectives; its sends and receives have none).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from torch.futures import Future


class WaitCancelled(RuntimeError):
    """The wait was abandoned by a sever; the op's link is dead."""


class Waitable(Protocol):
    """What a :class:`Pending` waits for: a c10d work, or a transport's batch of them."""

    def wait(self, timeout: datetime.timedelta) -> object: ...


class FutureWork(Waitable, Protocol):
    """A work whose future completes without a ``wait`` call (see :func:`wait_completion`)."""

    def get_future(self) -> Future[Any]: ...


class Pending:
    """One wait in flight; ``cancel`` may be called from any thread."""

    __slots__ = ("work", "timeout", "done", "error", "cancelled", "_lock")

    def __init__(self, work: Waitable, timeout: datetime.timedelta):
        self.work, self.timeout = work, timeout
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cancelled: str | None = None
        self._lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        with self._lock:
            if not self.done.is_set():
                self.cancelled = reason
                self.done.set()

    def _finish(self, error: BaseException | None) -> bool:
        """Record the outcome; False if the wait had been cancelled meanwhile."""
        with self._lock:
            if self.cancelled is not None:
                return False
            self.error = error
            self.done.set()
            return True


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


def wait_completion(pending: Pending) -> None:
    """Like :func:`wait`, for a work whose future completes without a ``wait`` call (an op gloo runs on
    its own worker thread, such as a pair's all-reduce): no waiter thread, so no hand-off between two
    threads per op (about 0.25 ms on two loaded cores), and still cancellable."""
    # Only a pair's all-reduce comes here: a c10d work, which has a future (a batch of sends has none).
    _await_future(pending, cast(FutureWork, pending.work).get_future())


def _await_future(pending: Pending, future: Future[Any]) -> None:
    def finished(_fut: Future[Any]) -> None:
        pending._finish(None)

    future.add_done_callback(finished)
    if not pending.done.wait(pending.timeout.total_seconds() + 5.0):
        pending.cancel("the op outlived its timeout")
    if pending.cancelled is not None:
        raise WaitCancelled(pending.cancelled)
    pending.work.wait(pending.timeout)  # complete: returns at once, or raises the op's error


def wait_cancellable(pending: Pending) -> None:
    """:func:`wait_completion` for a work with a future (gloo's collectives), else :func:`wait` (gloo's
    sends and receives have none)."""
    try:
        future = cast(FutureWork, pending.work).get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        wait(pending)
        return
    _await_future(pending, future)


def prestart() -> None:
    """Start the calling thread's waiter now (it is otherwise started by the thread's first send)."""
    _waiter()


def wait(pending: Pending) -> None:
    """Block until ``pending`` finishes or is cancelled (see the module docstring)."""
    w = _waiter()
    w.queue.put(pending)
    # The op's own timeout bounds the wait; the margin lets gloo report it first.
    if not pending.done.wait(pending.timeout.total_seconds() + 5.0):
        pending.cancel("the op outlived its timeout")
    if pending.cancelled is not None:
        w.stuck = True
        raise WaitCancelled(pending.cancelled)
    if pending.error is not None:
        raise pending.error
