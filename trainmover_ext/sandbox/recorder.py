"""Recording a role's collectives and pipeline receives during the job's first iterations.

Who calls it: every training rank, through :func:`maybe_start_recording`
right before the training loop and ``handle.after_iteration(k)`` after each
iteration. Only one rank per role kind records (tensor- and data-parallel rank
0 of the first, the first middle, and the last pipeline stage); on every other
rank the handle is inert and costs nothing.

How it hooks: for the recorded iterations the ProcessGroup *classes* of the
job's groups (torch's ``ProcessGroup`` on gloo/NCCL, ``DeltaProcessGroup`` on
nccl_delta) get a wrapper on each collective / p2p method. The wrapper acts
only for this process's group objects and only outside another hooked call
(nested calls inside a Python backend are its own business). It notes the
call in call order, runs the real method, and captures the result tensors
when the caller waits on the returned work, i.e. right after they are final
and before the caller reads them. When the last recorded iteration ends the
original methods are put back, so steady iterations run exactly the code
they ran before recording.

Failure: an error while recording (disk full ...) drops the partial recording
(no index is written, so no standby ever reads it) and is re-raised from
``after_iteration`` or ``close``; training itself is unaffected by
construction, since the real op always runs first.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .fingerprint import job_fingerprint
from .groups import all_groups, group_ranks, megatron_group_kinds
from .ops import METHOD_TO_OP, NO_RESULT_OPS, decode
from .recording import RecordingWriter, dtype_name

logger = logging.getLogger(__name__)

_ACTIVE: Recorder | None = None  # one recorder per process: the class hooks are process-wide
_NESTED = threading.local()


def recorder_role(layout) -> str | None:
    """The role this rank records, or None: TP rank 0 and DP rank 0 of pipeline stages 0, 1 and PP-1."""
    if layout.tp_rank != 0 or layout.dp_rank != 0:
        return None
    if layout.pp_size == 1:
        return "only"
    if layout.pp_rank == 0:
        return "first"
    if layout.pp_rank == layout.pp_size - 1:
        return "last"
    return "middle" if layout.pp_rank == 1 else None


def layout_dict(layout) -> dict:
    return {
        k: getattr(layout, k, None)
        for k in (
            "rank",
            "world_size",
            "tp_size",
            "pp_size",
            "dp_size",
            "tp_rank",
            "pp_rank",
            "dp_rank",
            "backend",
            "comm",
        )
    }


class RecordingWork(dist.Work):
    """The real op's work; ``wait`` waits for it, then lets the recorder copy the results."""

    def __init__(self, inner: dist.Work, on_done: Callable[[], None]):
        super().__init__()
        self._inner = inner
        self._on_done: Callable[[], None] | None = on_done

    def _finish(self) -> None:
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()

    @torch.compiler.disable
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._finish()
        return ok if isinstance(ok, bool) else True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def result(self):
        return self._inner.result()

    def get_future(self):
        # Recording happens at wait(); a future user gets the value after it is captured.
        self.wait()
        return self._inner.get_future()

    def synchronize(self) -> None:
        self._inner.synchronize()


class Recorder:
    """Records the result of every collective and pipeline receive this rank makes.

    ``iters`` iterations are recorded, numbered from ``start_iteration + 1``;
    call :meth:`start` before the first of them, :meth:`mark_iteration_done`
    after each; the recorder stops itself after the last and returns the
    index (a JSON-able dict) from that call.
    """

    def __init__(
        self,
        record_dir: str,
        role: str,
        layout,
        iters: int,
        *,
        fingerprint: dict,
        start_iteration: int = 0,
        consumed_samples: int = 0,
    ):
        if iters < 1:
            raise ValueError("--tm-record-iters must be >= 1")
        self.record_dir = record_dir
        self.role = role
        self.layout = layout
        self.iters = iters
        self.fingerprint = fingerprint
        self.start_iteration = start_iteration
        self.consumed_samples = consumed_samples
        self.iteration = start_iteration + 1
        self.records: list[dict] = []
        self.index: dict | None = None
        self.overhead_s = 0.0
        self._writer: RecordingWriter | None = None
        self._pending: list[RecordingWork] = []
        self._groups: dict[int, tuple[str, list[int]]] = {}
        self._patched: list[tuple[type, str, Any]] = []  # (class, method, original __dict__ entry or None)
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Install the hooks on the classes of this process's groups."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a recorder is already active in this process")
        kinds = megatron_group_kinds()
        for pg in all_groups():
            self._groups[id(pg)] = (kinds.get(id(pg), "other"), group_ranks(pg))
        self._writer = RecordingWriter(self.record_dir, self.role)
        for cls in {type(pg) for pg in all_groups()}:
            for method in METHOD_TO_OP:
                if hasattr(cls, method):
                    self._patch(cls, method)
        _ACTIVE = self
        logger.info(
            "recording role %s (rank %d): %d groups, iterations %d..%d",
            self.role,
            self.layout.rank,
            len(self._groups),
            self.iteration,
            self.start_iteration + self.iters,
        )

    def _patch(self, cls: type, method: str) -> None:
        own = cls.__dict__.get(method)
        if own is None and cls is not dist.ProcessGroup and issubclass(cls, dist.ProcessGroup):
            # Inherited from torch's C++ class: its trampoline looks the method up on the Python class
            # again, so a hook here would call itself. Unhooked, the C++ method calls one the class
            # defines (all_to_all_single -> alltoall_base), which is hooked.
            return
        original = getattr(cls, method)

        def hooked(pg, *args, **kwargs):
            rec = _ACTIVE
            if rec is None or id(pg) not in rec._groups or getattr(_NESTED, "depth", 0):
                return original(pg, *args, **kwargs)
            return rec._intercept(method, pg, original, args, kwargs)

        hooked.__name__ = method
        # Under --tm-compile dynamo must not trace into the recorder: the hook is a graph break.
        hooked = torch.compiler.disable(hooked)
        hooked._tm_recorder_hook = True  # type: ignore[attr-defined]
        setattr(cls, method, hooked)
        self._patched.append((cls, method, own))

    def _unpatch(self) -> None:
        global _ACTIVE
        for cls, method, own in reversed(self._patched):
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)
        self._patched.clear()
        if _ACTIVE is self:
            _ACTIVE = None

    def mark_iteration_done(self, iteration: int) -> dict | None:
        """Iteration ``iteration`` finished; returns the index when it was the last recorded one."""
        if self._error is not None:
            self.close()
            raise self._error
        if self.index is not None or self._writer is None:
            return None
        self.iteration = iteration + 1
        if iteration < self.start_iteration + self.iters:
            return None
        return self._seal()

    def _seal(self) -> dict:
        self._unpatch()
        t0 = time.perf_counter()
        unwaited = [w for w in self._pending if w._on_done is not None]
        self._pending.clear()
        for work in unwaited:
            work.wait()  # results the caller never waited for (none in megatron's paths)
        if unwaited:
            logger.warning("recorder: %d works were never waited by their caller", len(unwaited))
        if self._error is not None:
            self.close()
            raise self._error
        header = {
            "role": self.role,
            "rank": self.layout.rank,
            "layout": layout_dict(self.layout),
            "fingerprint": self.fingerprint,
            "start_iteration": self.start_iteration,
            "iterations": self.iters,
            "consumed_samples": self.consumed_samples,
            "recorded_at": time.time(),
        }
        assert self._writer is not None
        self.index = self._writer.finish(header, self.records)
        self.overhead_s += time.perf_counter() - t0
        logger.info("recorded role %s: %d calls, %d bytes", self.role, len(self.records), self.index["data_bytes"])
        return self.index

    def close(self) -> None:
        """Remove the hooks; drop the recording unless it was sealed. Safe to call twice."""
        self._unpatch()
        if self.index is None and self._writer is not None:
            self._writer.abort()
            self._writer = None

    # --- the hook ---------------------------------------------------------------------
    def _intercept(self, method: str, pg, original, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        call = decode(method, args, kwargs)
        kind, ranks = self._groups[id(pg)]
        record = {
            "seq": len(self.records),
            "iteration": self.iteration,
            "op": call.op,
            "method": method,
            "group": kind,
            "ranks": ranks,
            "peer": call.peer,
            "reduce_op": call.reduce_op,
            "inputs": [[list(t.shape), dtype_name(t.dtype)] for t in call.inputs],
            "tensors": [],
        }
        with self._lock:
            self.records.append(record)
        self.overhead_s += time.perf_counter() - t0
        _NESTED.depth = getattr(_NESTED, "depth", 0) + 1
        try:
            work = original(pg, *args, **kwargs)
        finally:
            _NESTED.depth -= 1
        if call.op in NO_RESULT_OPS or not call.results:
            return work
        results = call.results

        def capture() -> None:
            t1 = time.perf_counter()
            try:
                assert self._writer is not None
                with self._lock:
                    record["tensors"] = [self._writer.add_tensor(t) for t in results]
            except BaseException as exc:  # recorded, re-raised at the iteration boundary
                self._error = self._error or exc
            self.overhead_s += time.perf_counter() - t1

        wrapped = RecordingWork(work, capture)
        self._pending.append(wrapped)
        if len(self._pending) > 256:
            self._pending = [w for w in self._pending if w._on_done is not None]
        return wrapped


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Collectives made inside are not recorded (e.g. an evaluation between recorded iterations: a
    standby's shadow iterations replay training iterations only)."""
    _NESTED.depth = getattr(_NESTED, "depth", 0) + 1
    try:
        yield
    finally:
        _NESTED.depth -= 1


def hooks_installed() -> list[str]:
    """``Class.method`` of every recorder hook currently installed (empty once recording is over)."""
    import nccl_delta.backend as delta_backend

    from .replay import ReplayProcessGroup

    found = []
    for cls in (dist.ProcessGroup, delta_backend.DeltaProcessGroup, ReplayProcessGroup):
        for method in METHOD_TO_OP:
            if getattr(cls.__dict__.get(method), "_tm_recorder_hook", False):
                found.append(f"{cls.__name__}.{method}")
    return found


class RecordingHandle:
    """What the training loop holds: ``after_iteration(k)`` after every iteration, ``close()`` at exit."""

    def __init__(self, recorder: Recorder | None = None):
        self.recorder = recorder
        self.index: dict | None = None

    @property
    def active(self) -> bool:
        return self.recorder is not None and self.index is None

    def after_iteration(self, iteration: int) -> dict | None:
        """Returns the sealed index once, after the last recorded iteration; else None (and costs nothing)."""
        if self.recorder is None or self.index is not None:
            return None
        self.index = self.recorder.mark_iteration_done(iteration)
        return self.index

    def abort(self, reason: str) -> None:
        """Drop an unsealed recording (e.g. an iteration was abandoned mid-way); sealed ones stay."""
        if self.active:
            logger.warning("recording of role %s dropped: %s", self.recorder.role, reason)
            self.recorder.close()
            self.recorder = None

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def maybe_start_recording(
    args, layout, *, record_dir: str | None = None, record_iters: int | None = None
) -> RecordingHandle:
    """Start recording on this rank if it is its role's recorder and recording is asked for.

    ``record_dir`` / ``record_iters`` default to ``args.tm_record_dir`` /
    ``args.tm_record_iters`` (2). Call after the model, optimizer and data
    iterators are built and before the first training iteration; the iterations
    recorded are ``args.iteration + 1 ...``. Returns an inert handle when this
    rank does not record or a sealed recording for its role already exists.
    """
    record_dir = record_dir or getattr(args, "tm_record_dir", None)
    record_iters = record_iters or getattr(args, "tm_record_iters", None) or 2
    role = recorder_role(layout)
    if not record_dir or role is None:
        return RecordingHandle()
    if os.path.isfile(os.path.join(record_dir, role, "index.json")):
        return RecordingHandle()  # identical roles are stored once, across restarts too
    recorder = Recorder(
        record_dir,
        role,
        layout,
        record_iters,
        fingerprint=job_fingerprint(args),
        start_iteration=getattr(args, "iteration", 0) or 0,
        consumed_samples=getattr(args, "consumed_train_samples", 0) or 0,
    )
    recorder.start()
    return RecordingHandle(recorder)
