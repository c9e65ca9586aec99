"""The mirror's device-to-host copy of a shard, and when the send of that copy may be posted.

Why: on an accelerator the shard lives in device memory. Copying it on the training stream and waiting
for the copy before posting the send would hold the training thread for the whole copy after every
step; the mirror's promise is that the next forward and backward run while the copy is made and sent.

Contract
- :meth:`ShardCopier.copy` copies a shard's tensors into host views (page-locked ones on an
  accelerator). On CPU it is a plain copy, done when it returns. On an accelerator it runs on a side
  stream, ordered after everything the training stream has queued (the step that wrote the shard),
  and returns at once; its completion is an event.
- :meth:`ShardCopier.then` runs a function (posting the send of the copy) once the last copy is
  done: at once on the caller's thread when nothing is pending, else on one helper thread, which waits
  for the event (the training thread does not). The result is a :class:`~concurrent.futures.Future`;
  :meth:`ShardCopier.result` waits for it within :data:`COPY_TIMEOUT_S`, and cancels a job that has not
  started by then, so a late send never meets the next membership epoch's groups.
- :meth:`ShardCopier.before_step` is an optimizer step pre-hook: on an accelerator the step's kernels
  wait (on the device, not the host) for a copy still reading the shard, so the step never overwrites
  it mid-copy.
- :meth:`ShardCopier.wait` blocks the host until the last copy is done, within :data:`COPY_TIMEOUT_S`
  (the exchange that waits, a recovery's report, and anything that reads or writes the shard or its
  host copy itself).

Only the side stream, the event and the page-locked memory are accelerator code, all torch's own;
the helper thread's path is the same on CPU when :data:`HELPER_ENV` asks for it (the tests do, with
real gloo sends and kills). ``scripts/gpu_check_multi.sh`` runs the accelerator path.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch

from trainmover_ext.errors import MigrationAborted

T = TypeVar("T")

COPY_TIMEOUT_S = 120.0
"""How long the training thread waits for a copy and its posted send before the exchange is refused
(a device that never finishes a copy of host-memory size is a failed device)."""
HELPER_ENV = "TRAINMOVER_MIRROR_HELPER"
"""Set to 1 to post the sends from the helper thread on CPU too (tests of that path)."""


Job = tuple[Any, Callable[[], Any], "Future[Any]"]
"""A helper job: the copy's event to wait for (or None), what to run then, and where its result goes."""


class ShardCopier:
    """One rank's mirror copies: at most one in flight (module docstring)."""

    def __init__(self) -> None:
        self._stream: Any = None
        """The side stream (made on the first accelerator copy)."""
        self._event: Any = None
        """The last accelerator copy's completion (kept: waiting on a completed event costs nothing)."""
        self._helper_always = os.environ.get(HELPER_ENV) == "1"
        self._jobs: queue.SimpleQueue[Job | None] | None = None

    @property
    def on_device(self) -> bool:
        """Whether a copy ran on the side stream (the shard is on an accelerator)."""
        return self._stream is not None

    @property
    def posts_from_helper(self) -> bool:
        """Whether a send was posted from the helper thread."""
        return self._jobs is not None

    # --- the copy ---------------------------------------------------------------------
    def copy(self, views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into ``views`` (pairwise); on an accelerator, begin it on the side stream."""
        if not any(t.device.type == "cuda" for t in tensors):
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's stub leaves __init__ untyped
        self._stream.wait_stream(torch.cuda.current_stream())  # after the step that wrote the shard
        with torch.cuda.stream(self._stream):
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t, non_blocking=True)
            # blocking: a host thread waiting on it sleeps instead of spinning a core
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # as above
            event.record(self._stream)
        self._event = event

    def before_step(self, *_: Any) -> None:
        """Optimizer step pre-hook: the step waits on the device for a copy still reading the shard."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def wait(self) -> None:
        """Block until the last copy is done, at most :data:`COPY_TIMEOUT_S`."""
        event = self._event
        if event is None:
            return
        deadline = time.monotonic() + COPY_TIMEOUT_S
        while not event.query():
            if time.monotonic() > deadline:
                raise MigrationAborted(
                    f"the optimizer shard's copy to host memory was not done in {COPY_TIMEOUT_S:g} s; "
                    "the device is stuck"
                )
            time.sleep(0.001)

    # --- what follows a copy ----------------------------------------------------------
    def then(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` once the last copy is done (module docstring). Run at once, an exception of ``fn``
        is raised here; on the helper it is the future's."""
        future: Future[T] = Future()
        if self._event is None and not self._helper_always:
            future.set_result(fn())
            return future
        self._helper().put((self._event, fn, future))
        return future

    def result(self, future: Future[T]) -> T:
        """What ``fn`` returned (or raised), waiting at most :data:`COPY_TIMEOUT_S`. A job not started by
        then is cancelled: it never runs (a send posted that late could meet the groups of the next
        membership epoch)."""
        try:
            return future.result(timeout=COPY_TIMEOUT_S)
        except FutureTimeout:
            pass
        if future.cancel():
            raise MigrationAborted(
                f"the optimizer shard's copy to host memory was not done in {COPY_TIMEOUT_S:g} s; its send is "
                "cancelled (the device or the mirror's helper thread is stuck)"
            )
        try:  # it was running as the time ran out (posting a send does not block)
            return future.result(timeout=COPY_TIMEOUT_S)
        except FutureTimeout as exc:
            raise MigrationAborted(
                f"the mirror's helper thread has been posting the shard's send for {COPY_TIMEOUT_S:g} s; it is stuck"
            ) from exc

    def _helper(self) -> queue.SimpleQueue[Job | None]:
        if self._jobs is None:
            jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name="tm-mirror-post", daemon=True).start()
            self._jobs = jobs
        return self._jobs


def _serve(jobs: queue.SimpleQueue[Job | None]) -> None:
    """The helper thread: for each job in order, wait for its copy, then run it unless it was cancelled
    meanwhile (a daemon: a process that exits leaves it)."""
    while (job := jobs.get()) is not None:
        event, fn, future = job
        if event is not None:
            event.synchronize()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)
