"""The recording index in etcd (``recordings/<role>``), and waiting for recordings to appear.

Who calls it
- A recorder rank, once its recording is sealed: :func:`publish` writes the
  index's summary (role, rank, fingerprint, sizes, checksums and where the
  tensors live) to ``recordings/<role>`` through the job's
  :class:`~trainmover_ext.kv.job.JobSpace`. The per-call list is included
  when it is small (etcd values are capped at about 1.5 MB); the
  ``index_sha256`` always pins the exact ``index.json``, wherever a standby reads it.
- A standby: :func:`wait_for_recordings` polls etcd (or, without a job space,
  the directory) until every role its job has is published, then opens each
  recording and verifies it. It never waits longer than ``timeout_s``:
  :class:`RecordingNotFound` says which roles are missing. A role its own
  ``record_dir`` lacks (a standby on another node than the recorder's) is first
  copied there by the caller's ``fetch`` (``sandbox.fetch``); the summary names
  the recorder's ``node`` for that.

A recording whose ``index.json`` or data differs from what etcd says raises
:class:`RecordingCorrupt` and is never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, RecordingCorrupt, RecordingNotFound
from trainmover_ext.launch.identity import node_name

from .recording import DATA_FILE, INDEX_FILE, Recording

RECORDING_KIND = "recording"
MAX_CALLS_IN_ETCD = 256 * 1024
"""Bytes of JSON per-call list stored in etcd; larger lists stay only in ``index.json``."""


def roles_of_job(pp_size: int) -> list[str]:
    """The role kinds a job with ``pp_size`` pipeline stages records."""
    if pp_size == 1:
        return ["only"]
    return ["first", "last"] if pp_size == 2 else ["first", "middle", "last"]


def keep_role_of_job(choice: str, pp_size: int) -> str | None:
    """The sandbox role a standby keeps for ``--tm-keep-role choice`` (None: keep none).

    ``first`` and ``last`` are the PP=1 job's ``only`` role; ``middle`` needs PP >= 3."""
    if choice == "none":
        return None
    roles = roles_of_job(pp_size)
    if roles == ["only"]:
        if choice == "middle":
            raise ConfigError("--tm-keep-role middle: this job has one pipeline stage; use first, last or none")
        return "only"
    if choice not in roles:
        raise ConfigError(f"--tm-keep-role {choice}: this job's pipeline roles are {', '.join(roles)} (or none)")
    return choice


def control_role(role: str) -> str:
    """The control plane's name for a sandbox role (a PP=1 rank is a ``first`` rank there)."""
    return "first" if role == "only" else role


def index_sha256(index: dict) -> str:
    """SHA-256 of the index's canonical JSON (what ``index.json`` holds, key order aside)."""
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()


def published_summary(index: dict, record_dir: str) -> dict:
    """What goes to ``recordings/<role>``: the index without its per-call list, plus where it lives."""
    summary = {k: v for k, v in index.items() if k != "records"}
    summary.update(
        record_dir=os.path.abspath(record_dir),
        index_file=os.path.join(index["role"], INDEX_FILE),
        index_sha256=index_sha256(index),
        calls=len(index["records"]),
    )
    calls = json.dumps(index["records"])
    if len(calls) <= MAX_CALLS_IN_ETCD:
        summary["records"] = index["records"]
    return summary


def publish(space, role: str, record_dir: str, **extra) -> dict:
    """Write ``recordings/<role>`` from the sealed ``index.json`` (token-gated, no lease: it outlives the
    recorder); the summary names this ``node`` (whose agent serves the files to other nodes), and ``extra``
    (e.g. the recording overhead) is added to it. Returns the summary."""
    from trainmover_ext.kv.codec import encode

    summary = _summary_from_disk(record_dir, role)
    if summary is None:
        raise RecordingNotFound(f"{record_dir}/{role}/{INDEX_FILE} does not exist: nothing to publish")
    summary.update({"node": node_name(), **extra})
    space.put(space.key("recordings", role), encode(RECORDING_KIND, summary))
    return summary


def read_published(space, role: str) -> dict | None:
    """The summary at ``recordings/<role>``, or None."""
    from trainmover_ext.kv.codec import decode

    key = space.key("recordings", role)
    entry = space.kv.get(key)
    return None if entry is None else decode(entry.value, kind=RECORDING_KIND, key=key)


def open_published(summary: dict, record_dir: str | None = None) -> Recording:
    """Open and verify the recording ``summary`` names; its ``index.json`` must be the one etcd pinned."""
    role = summary["role"]
    recording = Recording(record_dir or summary["record_dir"], role)
    got = index_sha256(recording.index)
    if got != summary["index_sha256"]:
        raise RecordingCorrupt(
            f"{recording.dir}/{INDEX_FILE} is not the index the job published in etcd (sha256 {got[:12]} != "
            f"{summary['index_sha256'][:12]}): the directory was overwritten or is not the job's --tm-record-dir. "
            "Delete it and let the job record again"
        )
    return recording


def wait_for_recordings(
    *,
    record_dir: str,
    roles: list[str],
    timeout_s: float,
    space=None,
    poll_s: float = 0.25,
    should_stop: Callable[[], bool] | None = None,
    fetch: Callable[[dict], None] | None = None,
) -> dict[str, Recording]:
    """Every role in ``roles``, opened and verified, once all are sealed; see the module docstring.

    ``fetch(summary)`` copies a published role that ``record_dir`` lacks into it (raising
    :class:`RecordingNotFound` when it cannot); a copy that fails verification is deleted and
    :class:`RecordingCorrupt` raised, so that no later standby opens it."""
    deadline = Deadline(timeout_s)
    found: dict[str, dict] = {}
    while True:
        for role in roles:
            if role in found:
                continue
            if space is not None:
                summary = read_published(space, role)
            else:
                summary = _summary_from_disk(record_dir, role)
            if summary is not None:
                found[role] = summary
        if len(found) == len(roles):
            return {role: _open_or_fetch(found[role], record_dir, fetch) for role in roles}
        if deadline.expired or (should_stop is not None and should_stop()):
            missing = [r for r in roles if r not in found]
            where = "etcd (recordings/<role>)" if space is not None else record_dir
            raise RecordingNotFound(
                f"no recording of role(s) {missing} in {where} after {timeout_s:.0f}s: the job records its first "
                "--tm-record-iters iterations into --tm-record-dir once it trains; check that the job trains "
                "with the sandbox on (no --tm-no-sandbox), or raise --tm-record-timeout"
            )
        time.sleep(min(poll_s, deadline.remaining()))


def _open_or_fetch(summary: dict, record_dir: str, fetch: Callable[[dict], None] | None) -> Recording:
    role_path = os.path.join(record_dir, summary["role"])
    if fetch is None or os.path.isfile(os.path.join(role_path, INDEX_FILE)):
        try:
            return open_published(summary, record_dir)
        except RecordingCorrupt:
            # A copy left by an earlier run from another node's recording (a standby machine started again
            # in the same run directory): copy the current one. The recorder's own files are never replaced.
            if fetch is None or summary.get("node") in (None, node_name()):
                raise
            _delete_copy(role_path)
    fetch(summary)
    try:
        return open_published(summary, record_dir)
    except RecordingCorrupt as exc:
        _delete_copy(role_path)
        raise RecordingCorrupt(
            f"the recording of role {summary['role']} downloaded from node {summary.get('node')!r} is not the "
            f"one the job published ({exc}); the copy was deleted. Check the network path between the nodes, "
            "or share --tm-record-dir"
        ) from exc


def _delete_copy(role_path: str) -> None:
    for name in (INDEX_FILE, DATA_FILE):  # the index first: nobody may find an index without its data
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(role_path, name))


def _summary_from_disk(record_dir: str, role: str) -> dict | None:
    path = os.path.join(record_dir, role, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise RecordingCorrupt(
            f"{path} is not a readable recording index ({exc}); delete "
            f"{os.path.dirname(path)} and let the job record again"
        ) from exc
    return published_summary(index, record_dir)
