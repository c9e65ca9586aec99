"""Compute time on the device's timeline: what a rank's GPU spent on an iteration, less its stalls in communication.

Why: on a GPU a collective's wait returns to the CPU as soon as it is queued on the stream, and the
iteration ends on the CPU when the device has caught up. Every rank's wall time per iteration is then
the slowest rank's (its peers' streams stall inside the collectives until it arrives), so the wall
clock names no straggler. The device's own timeline does: a stream that stalls in a collective was
waiting for a peer; the rest of the iteration was its own work (kernels, or idle while its host was late
to feed it: a slow host is a straggler too).

Contract
- A :class:`Timeline` marks points on the device's current stream without blocking (:meth:`~Timeline.mark`),
  says whether the device has passed one (:meth:`~Timeline.reached`) and the seconds between two passed
  marks (:meth:`~Timeline.between`). :class:`CudaTimeline` is the one over CUDA events with timing (the
  only device code here; the bookkeeping below is pure and unit-tested with a scripted timeline).
- :class:`IterationTimes` keeps one iteration's marks: :meth:`begin` at its start, :meth:`stall_begin` and
  :meth:`stall_end` around each wait in communication (with the peer's logical rank for a point-to-point
  op), :meth:`end` with its number at its end, :meth:`cancel` when a save, evaluation or recovery cuts it.
  Nested stalls count once (the outermost).
- :meth:`IterationTimes.ready` returns, oldest first, the ended iterations whose marks the device has all
  passed, each as ``(iteration, compute_s, {peer: stalled_s})``: compute = the time from its first mark to
  its last less its stalls. Nothing is read before the device gets there, so nothing waits for it. At most
  :data:`PENDING` ended iterations are kept; older ones are dropped (the device fell far behind).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

PENDING = 16
"""Ended iterations kept until the device passes their last mark."""


class Timeline(Protocol):
    def mark(self) -> Any: ...

    def reached(self, mark: Any) -> bool: ...

    def between(self, first: Any, last: Any) -> float: ...


class CudaTimeline:
    """Marks on the current CUDA stream (``torch.cuda.Event(enable_timing=True)``)."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def mark(self) -> Any:
        event = self._event(enable_timing=True)
        event.record()
        return event

    def reached(self, mark: Any) -> bool:
        return bool(mark.query())

    def between(self, first: Any, last: Any) -> float:
        return float(first.elapsed_time(last)) / 1000.0


@dataclass
class _Iteration:
    began: Any
    stalls: list[tuple[Any, Any, int | None]] = field(default_factory=list)
    ended: Any = None
    number: int = 0


@dataclass
class IterationTimes:
    """See the module docstring."""

    timeline: Timeline
    _current: _Iteration | None = None
    _stall: tuple[Any, int | None] | None = None
    _depth: int = 0
    _ended: deque[_Iteration] = field(default_factory=lambda: deque(maxlen=PENDING))

    def begin(self) -> None:
        self._current, self._stall, self._depth = _Iteration(self.timeline.mark()), None, 0

    def cancel(self) -> None:
        self._current, self._stall, self._depth = None, None, 0

    def stall_begin(self, peer: int | None = None) -> None:
        self._depth += 1
        if self._current is not None and self._depth == 1:
            self._stall = (self.timeline.mark(), peer)

    def stall_end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._current is not None and self._stall is not None:
            began, peer = self._stall
            self._current.stalls.append((began, self.timeline.mark(), peer))
            self._stall = None

    def end(self, iteration: int) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        current.ended, current.number = self.timeline.mark(), iteration
        self._ended.append(current)

    def ready(self) -> list[tuple[int, float, dict[int, float]]]:
        out = []
        while self._ended and self.timeline.reached(self._ended[0].ended):
            it = self._ended.popleft()
            on_peer: dict[int, float] = {}
            stalled = 0.0
            for began, ended, peer in it.stalls:
                seconds = self.timeline.between(began, ended)
                stalled += seconds
                if peer is not None:
                    on_peer[peer] = on_peer.get(peer, 0.0) + seconds
            total = self.timeline.between(it.began, it.ended)
            out.append((it.number, max(0.0, total - stalled), on_peer))
        return out
