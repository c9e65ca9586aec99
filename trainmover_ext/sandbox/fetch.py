"""Copying a recording from the node that recorded it, for a standby on another node.

Who calls it: the general standby (``sandbox/standby.py``) passes a :class:`RecordingFetcher` to
``registry.wait_for_recordings``, which calls it for each published role missing from the standby's
own ``--tm-record-dir`` (a standby machine's run directory, say). It reads the recorder's node
(``node`` in ``recordings/<role>``) and that node's ``recordings_url`` (``nodes/<host>`` in etcd),
and downloads the role's files with the job token
(:func:`trainmover_ext.launch.recording_server.fetch_role`). The caller then opens the copy through
``open_published``, which verifies it against etcd.

Failure: no node named, no URL, a refusal, a network error or the deadline raise
:class:`RecordingNotFound` saying what to do; the standby then does the basic warm-up and says why.
All downloads of one standby share one deadline of ``timeout_s`` (``--tm-record-timeout``), started
at the first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.records import NodeRecord
from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import MalformedValue, RecordingNotFound
from trainmover_ext.launch.recording_server import fetch_role

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace


class RecordingFetcher:
    """``fetch(summary)`` for ``wait_for_recordings``; logs one line per role (bytes, seconds, from where)
    and keeps the same in :attr:`copies` (the standby's warm-up report carries them)."""

    def __init__(self, space: JobSpace, record_dir: str, timeout_s: float, log: Callable[[str], None]):
        self.space, self.record_dir, self.timeout_s, self.log = space, record_dir, timeout_s, log
        self.deadline: Deadline | None = None
        self.copies: list[dict[str, Any]] = []
        """Per role copied: ``role``, ``node``, ``bytes`` (0: another standby of this node copied it), ``s``."""

    def __call__(self, summary: dict[str, Any]) -> None:
        self.deadline = self.deadline or Deadline(self.timeout_s)
        role, node = summary["role"], summary.get("node")
        if not node:
            raise RecordingNotFound(
                f"recording {role} is not in {self.record_dir} and its summary in etcd names no node to copy it "
                "from (recorded by an older TrainMover): share --tm-record-dir between the nodes"
            )
        url = _recordings_url(self.space, node)
        if not url:
            raise RecordingNotFound(
                f"recording {role} is not in {self.record_dir}, and node {node!r}, which recorded it, serves no "
                "recordings (its agent is not `trainmover launch` with a job token, or could not bind: see its "
                "log): share --tm-record-dir between the nodes, or fix that agent's --recordings-host"
            )
        t0 = time.time()
        got = fetch_role(url, self.space.token, role, self.record_dir, deadline=self.deadline)
        took = time.time() - t0
        self.copies.append({"role": role, "node": node, "bytes": got, "s": round(took, 4)})
        if got:
            self.log(f"copied recording {role} ({got} bytes) in {took:.2f}s from node {node} at {url}")
        else:
            self.log(f"recording {role}: another standby of this node copied it from node {node} meanwhile")


def _recordings_url(space: JobSpace, node: str) -> str:
    key = space.key("nodes", node)
    entry = space.kv.get(key)
    if entry is None:
        return ""
    try:
        return NodeRecord.from_bytes(entry.value, key=key, strict=True).recordings_url
    except MalformedValue:
        return ""
