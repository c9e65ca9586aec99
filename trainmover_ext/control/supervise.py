"""The agent's fast detection path: a child process's exit reported as a failure of the rank it served.

Contract: :func:`report_exit` writes ``reports/<rank>/<reporter>`` (through
:func:`~trainmover_ext.control.membership.report_failure`) naming the exit code, so the controller
plans the replacement without waiting for the child's lease: a SIGKILLed worker is acted on in
milliseconds instead of one TTL. A frozen child (SIGSTOP) does not exit: its agent fences it and
:func:`report_hang` says so (``trainmover_ext.launch.heartbeat``); its lease expiry is the slow path for
every other hang. It is the one way a TrainMover process reports another's exit; the launcher's supervisor
(``trainmover_ext.launch.tm_supervisor``) calls it for every child that exits unexpectedly.

Example (inside the agent)::

    code = proc.poll()
    if code not in (None, 0):
        report_exit(space, rank=3, member_id=worker_id, reporter=agent_id, code=code, epoch=current_epoch)
"""

from __future__ import annotations

from trainmover_ext.control.membership import report_failure
from trainmover_ext.kv.job import JobSpace


def report_exit(space: JobSpace, *, rank: int, member_id: str, reporter: str, code: int, epoch: int) -> None:
    """Report that ``member_id``, serving ``rank``, exited with ``code``; ``epoch`` is the newest epoch the
    reporter knows (a report older than the epoch that already replaced the member is dropped as stale).
    Raises :class:`~trainmover_ext.errors.StoreError` when etcd cannot take it: the caller logs it and the
    child's lease expiry is the fallback."""
    report_failure(
        space, rank=rank, member_id=member_id, reporter=reporter, reason=f"process exited with code {code}", epoch=epoch
    )


def report_hang(space: JobSpace, *, rank: int, member_id: str, reporter: str, why: str, epoch: int) -> None:
    """Report that ``member_id``, serving ``rank``, hung (``why``: what the agent saw) and was killed by its
    agent; otherwise as :func:`report_exit`."""
    report_failure(space, rank=rank, member_id=member_id, reporter=reporter, reason=f"hung: {why}", epoch=epoch)
