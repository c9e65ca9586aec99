"""Agent-side fast path: report a child process's exit as a failure of the rank it served.

Contract: :class:`ChildExitReporter` waits on a child (``subprocess.Popen``) on a
daemon thread. When the child exits while :meth:`ChildExitReporter.expected_exit`
was not called, it writes ``reports/<rank>/<reporter>`` at once, so the
controller plans the replacement without waiting for the child's lease (a
SIGKILLed worker is acted on in milliseconds instead of one TTL). A hung child
(SIGSTOP) does not exit; its lease expiry is the slow path.

Example (inside the agent)::

    proc = subprocess.Popen([...worker...])
    ChildExitReporter(space, proc, rank=3, member_id=worker_id, reporter=agent_id, epoch=lambda: current_epoch)
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from trainmover_ext.control.membership import report_failure
from trainmover_ext.errors import TrainMoverError
from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


class ChildExitReporter:
    """See the module docstring."""

    def __init__(
        self,
        space: JobSpace,
        proc: subprocess.Popen[Any],
        *,
        rank: int,
        member_id: str,
        reporter: str,
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self.space, self.proc, self.rank, self.member_id, self.reporter, self.epoch = (
            space,
            proc,
            rank,
            member_id,
            reporter,
            epoch,
        )
        self._expected = threading.Event()
        self.reported = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tm-child-exit-{rank}", daemon=True)
        self._thread.start()

    def expected_exit(self) -> None:
        """The child is being stopped on purpose: do not report its exit."""
        self._expected.set()

    def _run(self) -> None:
        code = self.proc.wait()
        if self._expected.is_set():
            return
        reason = f"process {self.proc.pid} exited with code {code}"
        try:
            report_failure(
                self.space,
                rank=self.rank,
                member_id=self.member_id,
                reporter=self.reporter,
                reason=reason,
                epoch=self.epoch(),
            )
            self.reported.set()
        except TrainMoverError as exc:  # etcd down: the child's lease expiry is the fallback
            logger.error("could not report exit of rank %d: %s", self.rank, exc)
