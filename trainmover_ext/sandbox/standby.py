"""The general standby's sandbox warm-up, as ``trainmover_ext.migration.standby`` runs it.

Who calls it: a standby process (``pretrain_gpt.py ... --tm-role standby``)
after it has registered with no warm roles. :func:`warm_general_standby`

1. waits (at most ``--tm-record-timeout``) for the job's recordings of every
   role its pipeline has, published in etcd at ``recordings/<role>``; a role
   missing from its own ``--tm-record-dir`` is copied from the agent of the
   node that recorded it (``sandbox/fetch.py``, within another
   ``--tm-record-timeout``);
2. refuses with :class:`ConfigMismatch` if its own model, parallel config or
   library versions differ from any recording's;
3. runs shadow iterations of first, middle and last in turn, against a
   replay world (no link to any job rank), and after each role rewrites its
   member record: ``warm_roles`` grows and ``warmup`` carries the timings;
4. keeps the parts of one role (``--tm-keep-role``, default ``last``), warmed
   last so that its peak memory stays one role's. Promoted into the rank that
   role was recorded at, the standby adopts them (``sandbox/adopt.py``);
   promoted elsewhere, it drops them before it builds the rank's model. What
   carries over in both cases is the process-wide warm state (imports,
   allocator, data index, compiled code).

Failure: :class:`RecordingNotFound` (timeout, or a copy that failed) and :class:`RecordingCorrupt`
propagate, and the caller falls back to the basic warm-up and says so.
:class:`ConfigMismatch` and :class:`ReplayMismatch` mean this standby runs
another program than the job: the caller refuses to serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainmover_ext.control.records import MemberRecord

from .adopt import KeptRole
from .fetch import RecordingFetcher
from .pacing import Pacer
from .registry import control_role, keep_role_of_job, roles_of_job, wait_for_recordings
from .shadow import WarmResult, peak_rss_bytes, program_from_providers, warm_standby


@dataclass(kw_only=True)
class StandbyMemberRecord(MemberRecord):
    """A standby's ``members/<id>`` record with its warm-up report (readers of plain
    :class:`MemberRecord` ignore the extra field)."""

    warmup: dict[str, Any] = field(default_factory=dict)
    """``mode`` (``sandbox`` / ``basic`` / ``warming``), per-role timings, the fallback reason if any."""


def role_timings(result: WarmResult) -> dict:
    """One role's warm-up figures for the member record (seconds, bytes)."""
    its = result.iteration_s
    return {
        "role": result.role,
        "rank": result.rank,
        "build_s": round(result.build_s, 4),
        "first_iteration_s": round(its[0], 4) if its else None,
        "steady_iteration_s": round(min(its[1:]), 4) if len(its) > 1 else None,
        "total_s": round(result.total_s, 4),
        "replayed_calls": result.replayed_calls,
        "replayed_bytes": result.replayed_bytes,
        "compiled": result.compiled,
    }


def warm_general_standby(
    args, config, providers, *, space, member, pacer: Pacer, should_stop: Callable[[], bool] | None = None
) -> tuple[dict, KeptRole | None]:
    """Warm every role of the job from its recordings; returns the warm-up report and the kept role's
    parts (None when ``--tm-keep-role none`` or a promotion stopped the warm-up first). ``pacer``
    (``--tm-standby-duty``) pauses after every shadow iteration and role as its budget needs."""
    t0 = time.time()
    roles = roles_of_job(args.pipeline_model_parallel_size)
    keep = keep_role_of_job(config.keep_role, args.pipeline_model_parallel_size)
    serves = [control_role(r) for r in roles]
    # Its fingerprint matched: it may serve any role now, colder until the roles below are warm.
    member.update(warm_roles=serves, warming=True, warmup={"mode": "warming", "waiting_for": roles})
    who = member.record.member_id
    fetch = RecordingFetcher(
        space,
        config.record_dir,
        config.record_timeout_s,
        lambda msg: print(f"[trainmover] standby {who}: {msg}", flush=True),
    )
    recordings = wait_for_recordings(
        record_dir=config.record_dir,
        roles=roles,
        timeout_s=config.record_timeout_s,
        space=space,
        should_stop=should_stop,
        fetch=fetch,
    )
    report: dict[str, Any] = {"mode": "sandbox", "wait_s": round(time.time() - t0, 4), "roles": []}
    if fetch.copies:  # where the recordings came from, when not from this node's directory
        report["copied"] = fetch.copies

    def on_role_done(result: WarmResult) -> None:
        report["paused_s"] = round(pacer.paused_s, 4)
        report["roles"].append(role_timings(result))
        report["peak_rss_bytes"] = peak_rss_bytes()
        report["total_s"] = round(time.time() - t0, 4)
        warm = [control_role(r["role"]) for r in report["roles"]]
        member.update(warm_roles=warm + [r for r in serves if r not in warm], warmup=dict(report))

    results = warm_standby(
        args,
        recordings,
        program=program_from_providers(providers),
        on_role_done=on_role_done,
        should_stop=should_stop,
        keep_role=keep,
        pacer=pacer,
    )
    kept = next((r.kept for r in results if r.kept is not None), None)
    report["kept_role"] = None if kept is None else {"role": kept.role, "rank": kept.rank}
    if len(results) < len(roles):
        report["stopped"] = "promoted before every role was warm"
    report["paused_s"] = round(pacer.paused_s, 4)
    report["total_s"] = round(time.time() - t0, 4)
    # kept_rank: the controller prefers this standby for that rank (it adopts the model, no build).
    member.update(warmup=dict(report), warming=False, kept_rank=None if kept is None else kept.rank)
    return report, kept
