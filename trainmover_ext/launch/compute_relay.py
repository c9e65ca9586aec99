"""The agent's relay of its ranks' compute times to the controller's straggler watch.

Contract:
- Every rank writes one compute sample per iteration into its heartbeat file
  (:func:`trainmover_ext.launch.progress.iteration_done`); the agent, on every supervision round,
  :meth:`ComputeRelay.collect` s the new ones of the ranks it serves.
- :meth:`ComputeRelay.publish` writes them as one :class:`~trainmover_ext.control.records.ComputeReport`
  per node (``compute/<host>``), at most once every ``publish_s`` and only when something new came:
  one etcd write per node per second, never one per rank per iteration. The report holds each rank's
  last ``keep`` samples, each with the rank's point-to-point waits by peer (the slow-link watch's input),
  a sliding window, so a reader that missed one write loses nothing younger.
- A rank served by a new process (its heartbeat file changed) starts a new window.
- etcd trouble never stops supervision: the write is retried at the next round, and said once.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from trainmover_ext.control.records import ComputeReport
from trainmover_ext.errors import TrainMoverError
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.launch import progress

logger = logging.getLogger(__name__)


class ComputeRelay:
    """See the module docstring."""

    def __init__(self, space: JobSpace, host: str, *, publish_s: float = 1.0, keep: int = 64) -> None:
        self.space, self.host = space, host
        self.publish_s, self.keep = publish_s, keep
        self._windows: dict[int, deque[progress.ComputeSample]] = {}
        self._files: dict[int, str] = {}
        self._fresh = False
        self._published_at = 0.0
        self._failing = False

    def collect(self, files: dict[int, str]) -> None:
        """Read the new samples of each serving rank (rank -> its process's heartbeat file)."""
        for rank, path in files.items():
            if self._files.get(rank) != path:
                self._files[rank] = path
                self._windows[rank] = deque(maxlen=self.keep)
            window = self._windows[rank]
            last = window[-1].iteration if window else 0
            new = progress.read_compute(path, after=last)
            if new:
                window.extend(new)
                self._fresh = True
        for rank in set(self._windows) - set(files):  # moved away: its samples went with its process
            del self._windows[rank], self._files[rank]

    def publish(self, now: float | None = None) -> bool:
        """Write the node's report when due (see the module docstring); True when written."""
        now = time.monotonic() if now is None else now
        if not self._fresh or now - self._published_at < self.publish_s:
            return False
        report = ComputeReport(
            host=self.host,
            samples={str(r): [_entry(s) for s in w] for r, w in sorted(self._windows.items()) if w},
            published_at=time.time(),
        )
        try:
            self.space.put(self.space.key("compute", self.host), report.to_bytes())
        except TrainMoverError as exc:
            if not self._failing:
                logger.warning("compute times of %s not published (%s); trying again", self.host, exc)
            self._failing = True
            return False
        self._failing, self._fresh, self._published_at = False, False, now
        return True


def _entry(sample: progress.ComputeSample) -> list[float]:
    """A sample as the report holds it: ``[iteration, compute_s, peer, wait_s, ...]``."""
    return [sample.iteration, sample.compute_s, *(x for peer, waited in sample.links for x in (peer, waited))]
