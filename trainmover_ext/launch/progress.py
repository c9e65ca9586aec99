"""The main thread's progress, published to the rank's agent: the iteration, the phase, the collective it waits in.

Why: a rank whose main thread hangs (a deadlock, a stuck data loader or kernel, a peer that never
enters a collective) keeps its lease and its heartbeat, which run on background threads. Its
progress, written by the main thread itself, stops. The agent reads it (``launch.stalls``) and
fences the rank whose main thread stalled *outside* a collective: the ranks waiting *in* one are
waiting for that culprit and stay.

Contract
- The record lives in the rank's heartbeat file (``launch.heartbeat``) right after the beat, at
  :data:`OFFSET`: ``(time.monotonic() of the last mark, iteration, phase, waiting, group, op)``.
  One ``pwrite`` a mark; a generation count before and after lets a reader drop a torn record.
- :func:`mark` (main thread only; a call from another thread is ignored) sets the phase, and the
  iteration when given. :func:`waiting` wraps a blocking wait in a collective: the record says which
  group and which op of it, from the moment the wait starts; leaving restores the phase.
- Phases: ``start`` (before the first iteration), ``control`` (at an iteration boundary, where a
  planned move may wait for the controller), ``iteration`` (between the boundary and the first
  forward), ``forward`` (a micro-batch's forward started), ``backward`` (its backward started),
  ``step`` (the loss reduction and the
  optimizer step), ``eval``, ``save``, ``recovery``, ``done``. The agent judges only
  :data:`JUDGED` phases; the others wait on something else's timeouts.
- **Compute time** (what the straggler detector compares, ``control.stragglers``): CPU time
  (:data:`cpu_clock`) from the ``iteration`` mark to :func:`iteration_done`, less the CPU time spent while
  the main thread was in :func:`waiting`. The clock is the process's (every thread: torch's intra-op
  threads compute too), or the main thread's alone where it does all of the computing
  (:func:`use_cpu_clock`; the worker chooses it for one intra-op thread): then the threads that serve
  others (rank 0's TCP store server, heartbeats) do not count, which made rank 0's samples 3% higher
  than its peer's.
  CPU time, not wall time: a rank descheduled because other processes share its cores is not slower
  hardware, and on a shared host (the 2-core test machine runs 4 ranks, a standby and an agent) such
  stretches made healthy ranks' wall times 1.2x their peers' for ten iterations and more. A slower or
  throttled processor, which needs more CPU time for the same work, still shows.
  Each completed iteration writes one sample ``(iteration, compute_s)`` into a ring
  of :data:`RING` slots after the record (at :data:`COMPUTE_OFFSET`, slot ``iteration % RING``): one
  ``pwrite`` per iteration, read by the agent with :func:`read_compute`. On a GPU a collective's wait
  returns once the wait is queued on the stream, so there the sample is the CPU's view (the iteration's
  final loss read waits for the device): communication a rank does not block on counts as compute.
- **Link waits** (what the slow-link watch compares): the same sample carries the seconds the main
  thread waited in point-to-point ops with each of its (at most :data:`LINKS`) peers in that iteration,
  by the peer's logical rank (a pipeline stage's neighbours; a rank with more peers publishes the
  :data:`LINKS` it waited on longest).
- **On a GPU** (:func:`use_device_timeline`, set by the worker when its model is on CUDA) the sample is
  taken on the device's timeline instead (:mod:`trainmover_ext.launch.device_time`): the iteration's
  time on the stream less the stream's stalls in communication, by peer for point-to-point ops. A sample
  is published once the device has passed its iteration's end (usually at the next iteration's end),
  never by waiting for it.
- Everything here is a no-op in a process that has no heartbeat file (not started by the agent).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainmover_ext.launch.device_time import IterationTimes, Timeline

PHASES = ("start", "control", "iteration", "forward", "backward", "step", "eval", "save", "recovery", "done")
JUDGED = frozenset({"iteration", "forward", "backward", "step"})
"""Phases in which a stalled main thread is a hang (the others have long waits of their own)."""
RESETS = frozenset({"start", "eval", "save", "recovery", "done"})
"""Phases after which a rank's pace is measured anew (``control``, the boundary, is not one)."""
OFFSET = 8
"""Where the record starts in the heartbeat file (the beat's 8 bytes come first)."""
_GROUP_BYTES = 40
_RECORD = struct.Struct(f"<QdqBBxxI{_GROUP_BYTES}sQ")
LINKS = 2
"""Peers whose point-to-point waits a sample carries."""
_SAMPLE = struct.Struct("<qd" + "qd" * LINKS + "q")
"""A compute sample: its iteration, the compute seconds, ``LINKS`` pairs (peer or -1, seconds waited on
it), its iteration again (a torn slot reads unequal)."""
RING = 64
"""Compute samples kept: the agent reads them every ``monitor_interval_s``, far more often than 64 iterations."""
COMPUTE_OFFSET = OFFSET + _RECORD.size
cpu_clock: Callable[[], float] = time.process_time
"""The clock of compute time off the device: the process's CPU seconds (see :func:`use_cpu_clock`)."""
_MAIN = threading.main_thread().ident


@dataclass(frozen=True)
class Progress:
    """One read of a rank's record."""

    at: float
    """``time.monotonic()`` of the last mark (the same clock on every process of the host)."""
    iteration: int
    """Completed iterations when the phase began."""
    phase: str
    group: str | None
    """The group whose collective the main thread waits in, or None when it waits in none."""
    op: int
    """That collective's number in the group (the ops it issued before it, +1)."""


@dataclass(frozen=True)
class ComputeSample:
    """One completed iteration's times (see the module docstring)."""

    iteration: int
    compute_s: float
    links: tuple[tuple[int, float], ...] = ()
    """(peer's logical rank, seconds waited in point-to-point ops with it), for each peer waited on."""


class _Writer:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.generation = 0
        self.iteration = 0
        self.phase = "start"
        self.at = time.monotonic()
        self.began: float | None = None
        """:data:`cpu_clock` at this iteration's ``iteration`` mark (None: no iteration in progress)."""
        self.waited = 0.0
        """CPU seconds of this iteration spent while the main thread was in :func:`waiting`."""
        self.on_peer: dict[int, float] = {}
        """Wall seconds of this iteration the main thread waited in point-to-point ops, by peer."""
        self.device: IterationTimes | None = None
        """The device's timeline, when the samples are taken there (:func:`use_device_timeline`)."""

    def write(self, group: str | None = None, op: int = 0) -> None:
        self.generation += 1
        name = (group or "").encode()[:_GROUP_BYTES]
        data = _RECORD.pack(
            self.generation,
            self.at,
            self.iteration,
            PHASES.index(self.phase),
            1 if group is not None else 0,
            op & 0xFFFFFFFF,
            name,
            self.generation,
        )
        try:
            os.pwrite(self.fd, data, OFFSET)
        except OSError:
            pass  # the agent removed the file (it is stopping)


_writer: _Writer | None = None


def start(path: str) -> None:
    """Publish progress into ``path`` (the heartbeat file) from now on; the phase is ``start``."""
    global _writer
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return
    _writer = _Writer(fd)
    _writer.write()


def mark(phase: str, iteration: int | None = None) -> None:
    """The main thread enters ``phase`` (see the module docstring)."""
    w = _writer
    if w is None or threading.get_ident() != _MAIN:
        return
    w.phase, w.at = phase, time.monotonic()
    if iteration is not None:
        w.iteration = iteration
    if phase == "iteration":
        w.began, w.waited, w.on_peer = cpu_clock(), 0.0, {}
        if w.device is not None:
            w.device.begin()
    elif phase in RESETS:
        w.began = None  # a save, evaluation or recovery in between: this iteration is not a sample
        if w.device is not None:
            w.device.cancel()
    w.write()


def use_device_timeline(timeline: Timeline) -> None:
    """Take the compute samples on ``timeline`` (the device's; see the module docstring) from the next
    iteration on; a no-op without a heartbeat file."""
    w = _writer
    if w is not None:
        w.device = IterationTimes(timeline)


def use_cpu_clock(clock: Callable[[], float]) -> None:
    """Measure compute time off the device on ``clock`` (``time.process_time`` or, where the main thread
    does all the computing, ``time.thread_time``) from the next iteration on."""
    global cpu_clock
    cpu_clock = clock


def compute_so_far() -> float | None:
    """The compute seconds (:data:`cpu_clock`) of the iteration in progress until now (None when none is in
    progress)."""
    w = _writer
    if w is None or w.began is None:
        return None
    return max(0.0, cpu_clock() - w.began - w.waited)


def iteration_done(iteration: int) -> None:
    """The main thread completed ``iteration``: publish its compute time (see the module docstring)."""
    w = _writer
    if w is None or threading.get_ident() != _MAIN or w.began is None:
        return
    compute_s = max(0.0, cpu_clock() - w.began - w.waited)
    w.began = None
    if w.device is None:
        _publish(w.fd, iteration, compute_s, w.on_peer)
        return
    w.device.end(iteration)
    for number, device_s, on_peer in w.device.ready():
        _publish(w.fd, number, device_s, on_peer)


def _publish(fd: int, iteration: int, compute_s: float, on_peer: dict[int, float]) -> None:
    links = sorted(on_peer.items(), key=lambda kv: -kv[1])[:LINKS]
    links += [(-1, 0.0)] * (LINKS - len(links))
    try:
        slot = COMPUTE_OFFSET + (iteration % RING) * _SAMPLE.size
        os.pwrite(fd, _SAMPLE.pack(iteration, compute_s, *(x for link in links for x in link), iteration), slot)
    except OSError:
        pass


def waiting(group: str, op: int, peer: int | None = None) -> contextlib.AbstractContextManager[None]:
    """The main thread blocks in ``group``'s op number ``op`` for the duration (a point-to-point op with the
    logical rank ``peer``, or a collective when None)."""
    w = _writer
    if w is None or threading.get_ident() != _MAIN:
        return _UNPUBLISHED
    return _Waiting(w, group, op, peer)


_UNPUBLISHED = contextlib.nullcontext()


class _Waiting:
    """What :func:`waiting` returns while progress is published. A class, not a generator's context manager:
    it runs around every collective's wait, and the generator's machinery cost as much as the two writes."""

    __slots__ = ("_w", "_group", "_op", "_peer", "_started", "_cpu_started")

    def __init__(self, w: _Writer, group: str, op: int, peer: int | None) -> None:
        self._w, self._group, self._op, self._peer = w, group, op, peer
        self._started = self._cpu_started = 0.0

    def __enter__(self) -> None:
        w = self._w
        w.at = self._started = time.monotonic()
        w.write(self._group, self._op)
        self._cpu_started = cpu_clock()
        if w.device is not None:
            w.device.stall_begin(self._peer)

    def __exit__(self, *exc: object) -> None:
        w = self._w
        if w.device is not None:
            w.device.stall_end()
        w.at = time.monotonic()
        w.waited += cpu_clock() - self._cpu_started
        if self._peer is not None:
            w.on_peer[self._peer] = w.on_peer.get(self._peer, 0.0) + w.at - self._started
        w.write()


def read(path: str) -> Progress | None:
    """The record in ``path``, or None when there is none yet or it was being written."""
    try:
        with open(path, "rb") as f:
            f.seek(OFFSET)
            raw = f.read(_RECORD.size)
    except OSError:
        return None
    if len(raw) < _RECORD.size:
        return None
    gen, at, iteration, phase, waits, op, name, gen_after = _RECORD.unpack(raw)
    if gen == 0 or gen != gen_after or phase >= len(PHASES):
        return None
    group = name.rstrip(b"\0").decode(errors="replace") if waits else None
    return Progress(at=at, iteration=iteration, phase=PHASES[phase], group=group, op=op)


def read_compute(path: str, after: int = 0) -> list[ComputeSample]:
    """The samples in ``path`` of iterations after ``after``, oldest first (torn slots left out)."""
    try:
        with open(path, "rb") as f:
            f.seek(COMPUTE_OFFSET)
            raw = f.read(RING * _SAMPLE.size)
    except OSError:
        return []
    samples = []
    for i in range(len(raw) // _SAMPLE.size):
        iteration, compute_s, *links, again = _SAMPLE.unpack_from(raw, i * _SAMPLE.size)
        if iteration == again and iteration > after:
            pairs = tuple((int(links[k]), links[k + 1]) for k in range(0, len(links), 2) if links[k] >= 0)
            samples.append(ComputeSample(iteration, compute_s, pairs))
    return sorted(samples, key=lambda s: s.iteration)
