"""One attempt at a failure epoch: rebuild links, carry out the controller's convergence, copy state.

Contract (every rank of the epoch, main thread):
- A stayer rewinds its abandoned iteration (when its state is usable), reports
  what it holds (``recovery/<e>/<r>``: its completed steps, or ``None`` when a
  copy into it was cut short), and rebuilds the links the failure touched
  (``nccl_delta``'s ``recover``). A fresh joiner built its links with ``join``.
- Every rank then waits for the controller's one ``convergence/<e>`` record and
  carries it out: the listed state copies over the communicator's own links, or
  the latest checkpoint when no replica holds some state.
- Any step may be cut short by a newer failure plan (the watch thread abandons
  the communicator, which cuts link set-ups and transfers at once): the step
  raises :class:`CommLinkError` or :class:`RecoverySuperseded`, and the caller
  (:meth:`~trainmover_ext.migration.worker.WorkerRuntime.recover`) starts again
  at the newest epoch. A copy cut short leaves the target's state unusable
  (``WorkerRuntime.state_valid``), which its next report says.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.executor import record_event
from trainmover_ext.control.membership import report_recovery, wait_convergence
from trainmover_ext.control.records import ConvergenceRecord, MigrationPlan
from trainmover_ext.errors import MigrationAborted, RecoverySuperseded
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.migration.timeline import mark_step
from trainmover_ext.runtime import faults
from trainmover_training import checkpointing, iteration_start, rank_state

if TYPE_CHECKING:
    from trainmover_ext.migration.transfer import Channel
    from trainmover_ext.migration.worker import WorkerRuntime
    from trainmover_training.training import Session

logger = logging.getLogger(__name__)


def converge(rt: WorkerRuntime, session: Session, plan: MigrationPlan, *, fresh_joiner: bool) -> None:
    """Bring this rank to ``plan.epoch``'s resume point (see the module docstring)."""
    import nccl_delta
    from trainmover_ext.migration.transfer import GroupChannel

    layout, args = session.layout, session.args
    replaced = {r.rank for r in plan.replacement_list()}
    e = plan.epoch
    world = nccl_delta.current_world()
    if not fresh_joiner:
        if rt.state_valid:
            # The abandoned iteration drew dropout masks before it failed: start it again from its
            # snapshot, as a run without the failure would (a copy below may overwrite it).
            session.rewind()
        faults.at("recover", rank=layout.rank, epoch=e)
        report_recovery(
            rt.space,
            epoch=e,
            rank=layout.rank,
            iteration=args.iteration if rt.state_valid else None,
            mirror=rt.mirror.report() if rt.mirror is not None and rt.state_valid else None,
        )
        report = world.recover(e, replaced=replaced)
        logger.info(
            "rank %d: epoch %d kept %d groups, rebuilt %d (%d members in all); agreed in %.3fs, groups built "
            "in %.3fs, %d ring links in %.3fs",
            layout.rank,
            e,
            report.groups_kept,
            report.groups_rebuilt,
            report.members_rebuilt,
            report.agree_s,
            report.groups_s,
            report.rebuilt,
            report.rings_s,
        )
    mark_step(rt.space, e, "joined" if fresh_joiner else "links_rebuilt", only_if=layout.rank in replaced)
    cplan = _await_convergence(rt, e)
    if cplan.from_checkpoint:
        _load_checkpoint(rt, session, cplan)
    elif cplan.mirror:
        _copy_from_mirrors(rt, session, cplan)
    else:
        # Over their data-parallel group's communicator, just rebuilt with the joiner: nothing is set up
        # on the critical path.
        for src, dst in cplan.copies:
            if layout.rank == src:
                send_and_report(GroupChannel(dst), session, dst, e, drill="send", space=rt.space)
            elif layout.rank == dst:
                rt.state_valid = False  # until every tensor has landed
                recv_and_report(GroupChannel(src), session, src, e, space=rt.space)
                rt.state_valid = True
                session.started = iteration_start.capture(args)  # what a later rewind goes back to
        if rt.state_valid is False or args.iteration != cplan.resume_iteration:
            raise MigrationAborted(
                f"rank {layout.rank} holds iteration {args.iteration} after the copies of epoch "
                f"{e}, not {cplan.resume_iteration}"
            )
    mark_step(
        rt.space,
        e,
        "transferred" if not cplan.from_checkpoint else "checkpoint_loaded",
        only_if=layout.rank in replaced,
        resume_iteration=args.iteration,
    )
    session.reset_data()
    rt.epoch = e


def _copy_from_mirrors(rt: WorkerRuntime, session: Session, cplan: ConvergenceRecord) -> None:
    """Carry out a mirror convergence: each holder serves its ward's shard of the resume iteration,
    then every rank rebuilds its model parameters from the main parameters (a data-parallel
    all-gather, so every rank takes part)."""
    from trainmover_ext.migration.transfer import GroupChannel
    from trainmover_ext.runtime.memwatch import PeakWindow

    layout, args, e, k = session.layout, session.args, cplan.epoch, cplan.resume_iteration
    mirror = rt.mirror
    if mirror is None:
        raise MigrationAborted(f"rank {layout.rank}: epoch {e} resumes from mirrors, and this rank keeps none")
    for src, dst in cplan.copies:
        if layout.rank == src == dst:
            mirror.restore_own(k)
            continue
        if layout.rank not in (src, dst):
            continue
        sending = layout.rank == src
        if not sending:
            rt.state_valid = False  # until every tensor has landed
        with PeakWindow() as mem:
            moved = mirror.serve(GroupChannel(dst), k) if sending else mirror.restore(GroupChannel(src), k)
        if not sending:
            print(
                f"[trainmover] rank {dst} took its optimizer shard of iteration {k} from rank {src}'s mirror "
                f"({moved / 2**20:.2f} MiB, epoch {e}); RSS peak {mem.peak / 2**20:.1f} MiB",
                flush=True,
            )
        record_transfer(
            rt.space,
            {
                "side": "sent" if sending else "received",
                "rank": layout.rank,
                "peer": dst if sending else src,
                "epoch": e,
                "bytes": moved,
                "mirror": True,
                "start_rss": mem.start_rss,
                "peak_rss": mem.peak,
                **({} if sending else {"end_rss": mem.end_rss}),
            },
        )
    if args.iteration != k:
        raise MigrationAborted(
            f"rank {layout.rank} holds iteration {args.iteration} after the copies of epoch {e}, not {k}"
        )
    rank_state.rebuild_params(session)
    rt.state_valid = True
    mirror.forget_after(k)
    session.started = iteration_start.capture(args)


def _await_convergence(rt: WorkerRuntime, epoch: int) -> ConvergenceRecord:
    """The controller's convergence record of ``epoch`` (it decides once every stayer reported)."""
    record = wait_convergence(rt.space, epoch, rt.timeout_s, lambda: rt.newest_failure_epoch() > epoch)
    if record is None:
        if rt.newest_failure_epoch() > epoch:
            raise RecoverySuperseded(
                f"epoch {epoch} will not converge: epoch {rt.newest_failure_epoch()} superseded it"
            )
        raise MigrationAborted(
            f"epoch {epoch} did not converge: the controller decided nothing within "
            f"{rt.timeout_s:.0f}s (did every stayer report?)"
        )
    return record


def _load_checkpoint(rt: WorkerRuntime, session: Session, cplan: ConvergenceRecord) -> None:
    args = session.args
    root = args.load or args.save
    if not root or checkpointing.read_latest_iteration(root) is None:
        raise MigrationAborted(
            f"epoch {cplan.epoch}: {cplan.reason} and there is no checkpoint to fall back to "
            "(give --save/--save-interval)"
        )
    rt.state_valid = False
    checkpointing.load_checkpoint(root, session.model, session.optimizer, session.scheduler, args, session.layout)
    args.iteration = checkpointing.read_latest_iteration(root)
    args.consumed_train_samples = args.iteration * args.global_batch_size
    rt.state_valid = True
    if rt.mirror is not None:
        rt.mirror.forget_after(args.iteration)
    session.started = iteration_start.capture(args)


def record_transfer(space: JobSpace | None, detail: dict[str, Any]) -> None:
    """One side of a state transfer, as a ``state_transfer`` event of the job's timeline (``trainmover
    events``, the run archive): what was moved and what it cost in memory. etcd trouble is logged only:
    the record is not a step of the recovery."""
    failed = record_event(space, "state_transfer", detail) if space is not None else None
    if failed is not None:
        logger.warning("could not record the state transfer of rank %s: %s", detail.get("rank"), failed)


def send_and_report(
    channel: Channel[Any], session: Session, dst: int, epoch: int, drill: str, space: JobSpace | None = None
) -> int:
    """Send this rank's state and say how much, and what it cost in memory (must be ~nothing), in the
    log and in the timeline (:func:`record_transfer`). ``drill`` names the fault-drill phase that fires
    after the metadata (``send`` or ``handover``)."""
    from trainmover_ext.migration.transfer import send_state
    from trainmover_ext.runtime.memwatch import PeakWindow

    forge = faults.forged_kind(epoch) if drill == "send" else None
    if forge:
        print(
            f"[trainmover] fault drill: rank {session.layout.rank} sends rank {dst} a crafted state record "
            f"({forge}, epoch {epoch})",
            flush=True,
        )
    with PeakWindow() as mem:
        sent = send_state(
            channel,
            session,
            after_meta=lambda: faults.at(drill, rank=session.layout.rank, epoch=epoch),
            forge=faults.forger(forge) if forge else None,
        )
    print(
        f"[trainmover] rank {session.layout.rank} sent {sent / 2**20:.2f} MiB of state to rank {dst} "
        f"(epoch {epoch}); RSS {mem.start_rss / 2**20:.1f} MiB at the start, peak {mem.peak / 2**20:.1f} MiB "
        "during",
        flush=True,
    )
    record_transfer(
        space,
        {
            "side": "sent",
            "rank": session.layout.rank,
            "peer": dst,
            "epoch": epoch,
            "bytes": sent,
            "start_rss": mem.start_rss,
            "peak_rss": mem.peak,
        },
    )
    return sent


def recv_and_report(
    channel: Channel[Any], session: Session, src: int, epoch: int, space: JobSpace | None = None
) -> int:
    """Receive a rank's state and say how much, and whether it allocated anything it does not keep, in
    the log and in the timeline (:func:`record_transfer`)."""
    from trainmover_ext.migration.transfer import recv_state
    from trainmover_ext.runtime.memwatch import PeakWindow

    with PeakWindow() as mem:
        received = recv_state(channel, session)
    print(
        f"[trainmover] rank {session.layout.rank} received {received / 2**20:.2f} MiB of state from rank {src} "
        f"(epoch {epoch}); RSS {mem.start_rss / 2**20:.1f} MiB at the start, peak {mem.peak / 2**20:.1f} MiB "
        f"during, {mem.end_rss / 2**20:.1f} MiB after",
        flush=True,
    )
    record_transfer(
        space,
        {
            "side": "received",
            "rank": session.layout.rank,
            "peer": src,
            "epoch": epoch,
            "bytes": received,
            "start_rss": mem.start_rss,
            "peak_rss": mem.peak,
            "end_rss": mem.end_rss,
        },
    )
    return received
