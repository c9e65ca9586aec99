"""The joiner: a promoted standby joins the communicator as the plan's rank, takes the state, and trains.

Contract (the promoted standby's main thread):
- It becomes the plan's rank (``RANK``, its slot's ``LOCAL_RANK``), creates
  the same groups as the job (which builds no link), and opens its
  :class:`~trainmover_ext.migration.worker.WorkerRuntime` at once, so a newer
  plan reaches it from the first moment (the watch thread abandons what is
  under way).
- Its links come up on a thread (``nccl_delta``'s ``join``) while this thread
  builds the rank's model (or adopts the model the sandbox kept for it).
- After a failure it then carries out the convergence like any rank; after a
  planned move it marks the plan ``ready`` and receives the leaver's state.
- When a newer failure plan cuts any of this short (a stayer, the state
  source or the leaver died), it takes part in the newer epoch's recovery as a
  rank without usable state: it receives a copy like a joiner. Training then
  goes on in :func:`~trainmover_training.training.train_loop`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.records import MigrationPlan
from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import (
    CommLinkError,
    JobFinishedFirst,
    MembershipLost,
    MigrationAborted,
    RecoverySuperseded,
    TrainMoverError,
)
from trainmover_ext.launch import progress
from trainmover_ext.migration.timeline import mark_rank_step, mark_step
from trainmover_ext.runtime import faults

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import argparse

    from trainmover_ext.config import TrainMoverConfig
    from trainmover_ext.control.membership import Membership
    from trainmover_ext.kv.job import JobSpace
    from trainmover_ext.launch.identity import Identity
    from trainmover_ext.migration.standby import Providers
    from trainmover_ext.sandbox.adopt import KeptRole
    from trainmover_training.training import Session


def serve_rank(
    args: argparse.Namespace,
    config: TrainMoverConfig,
    providers: Providers,
    plan: MigrationPlan,
    ident: Identity,
    space: JobSpace,
    member: Membership,
    kept: KeptRole | None = None,
    niceness_before: int | None = None,
) -> dict[str, Any]:
    """Join the communicator as the plan's rank, take the state, and train (see the module docstring).

    With ``kept`` (the sandbox role this standby kept) it adopts those parts when they were built
    for this rank, and drops them otherwise, before it builds the rank's model. ``niceness_before``: the
    standby's niceness when its promotion was heard, if its priority was restored then."""
    from trainmover_ext.launch.distributed import TrainMoverDistributed
    from trainmover_ext.migration.planned import receive_from_leaver
    from trainmover_ext.migration.recovery import converge
    from trainmover_ext.migration.worker import WorkerRuntime
    from trainmover_ext.runtime.quiet_build import no_collectives
    from trainmover_ext.sandbox.adopt import adopt_or_build, keep_if_fits
    from trainmover_ext.sandbox.compile import chunk_preparer
    from trainmover_training.initialize import initialize_distributed, shutdown
    from trainmover_training.training import MetricsLog, build_session, train_loop

    rep = next(r for r in plan.replacement_list() if r.joiner == ident.member_id)
    os.environ["RANK"] = str(rep.rank)
    os.environ["LOCAL_RANK"] = str(rep.local_rank)  # its slot's device (see Replacement.local_rank)
    t_promoted = time.time()
    from trainmover_ext.launch import priority

    niceness = os.getpriority(os.PRIO_PROCESS, 0) if niceness_before is None else niceness_before
    # A rank at a standby's low priority would hold every other rank back (again here: a thread started
    # since the promotion was heard).
    failed = priority.restore()
    now = os.getpriority(os.PRIO_PROCESS, 0)
    print(
        f"[trainmover] standby {ident.member_id} promoted to rank {rep.rank} (local rank {rep.local_rank}, "
        f"epoch {plan.epoch}, {plan.reason}){f'; CPU niceness {niceness} -> {now}' if niceness else ''}",
        flush=True,
    )
    if failed:
        print(
            f"[trainmover] standby {ident.member_id}: could not restore normal CPU priority of {failed} thread(s) "
            "after promotion; this rank may hold the others back",
            flush=True,
        )
    member.update(kind="worker")
    progress.mark("recovery")  # serving a rank from now on: its agent judges its progress once it trains
    member.rejoin_on_loss = False  # serving a rank: its runtime (below) re-registers it unless it was replaced
    if config.inject_fault:
        faults.arm(faults.FaultSpec.parse_all(config.inject_fault), int(os.environ["WORLD_SIZE"]))
    faults.at("join", rank=rep.rank, epoch=plan.epoch)
    kept, not_adopted = keep_if_fits(kept, rep.rank)  # what does not fit is freed before anything is built
    layout = initialize_distributed(args, TrainMoverDistributed(delta=True, join_epoch=plan.epoch, join=False))
    t_groups = time.time()
    metrics = MetricsLog(config.metrics_file, layout.is_logging_rank)
    # Watching from here on: a newer plan abandons the join, the convergence or the hand-over.
    runtime = WorkerRuntime(
        None, config, ident, space, member, epoch=plan.epoch - 1, layout=layout, state_valid=False, catch_up=True
    )
    try:
        # The links come up on a thread while this one builds the model: neither needs the other.
        joining = _Joining(plan.epoch, timeout_s=runtime.timeout_s)

        def build(why: str) -> Session:
            print(f"[trainmover] standby {ident.member_id} builds rank {rep.rank}'s model ({why})", flush=True)
            # Everything the build's collectives and its initialisation would set comes with the state
            # transfer: none runs, and the parameters stay NaN until it fills them.
            with no_collectives():
                return build_session(args, layout, *providers, metrics, chunk_preparer(args), initialize=False)

        kept_role = kept.role if kept is not None else None
        # not_adopted is None only with parts kept, and adopt_or_build reads it only without any
        session, not_adopted, repointed = adopt_or_build(kept, layout, metrics, rep.rank, build, not_adopted)
        if not_adopted is None:
            print(
                f"[trainmover] standby {ident.member_id} adopted its kept {kept_role} model for rank "
                f"{rep.rank} ({repointed} group references re-pointed)",
                flush=True,
            )
        t_session = time.time()
        runtime.session = session
        runtime.start_mirror(session)
        runtime.track_progress(session)
        args.iteration, args.consumed_train_samples = 0, 0

        def job_finished() -> bool:
            try:
                done = space.kv.get_prefix(space.key("finished") + "/").entries
            except TrainMoverError:
                return False
            return len(done) >= layout.world_size

        try:
            try:
                joining.wait(job_finished)
            except JobFinishedFirst as exc:
                print(f"[trainmover] rank {rep.rank} (joiner of epoch {plan.epoch}): {exc}; leaving", flush=True)
                return {"iterations": 0, "exit_reason": "the job finished before this move took effect"}
            mark_step(space, plan.epoch, "joined", at=joining.done_at)
            logger.info(
                "rank %d (joiner of epoch %d): groups registered %.3fs, built %.3fs, ring links up %.3fs, model "
                "built %.3fs after its promotion",
                rep.rank,
                plan.epoch,
                t_groups - t_promoted,
                (joining.groups_at or joining.done_at or t_promoted) - t_promoted,
                (joining.done_at or t_promoted) - t_promoted,
                t_session - t_promoted,
            )
            if plan.reason == "planned":
                # Links up and model built: the job may now pick the hand-over boundary.
                mark_rank_step(space, plan.epoch, "ready", rep.rank)  # ``ready`` once every joiner is
                receive_from_leaver(runtime, session, plan)
                # The leaver and the stayers ran any evaluation due at the hand-over boundary before it.
                session.evaluated_iteration = args.iteration
            else:
                converge(runtime, session, plan, fresh_joiner=True)
        except (CommLinkError, RecoverySuperseded) as cut:
            print(
                f"[trainmover] rank {rep.rank} (joiner of epoch {plan.epoch}): {cut}; recovering at the newest epoch",
                flush=True,
            )
            runtime.recover(session, cut)
        except MigrationAborted as exc:
            # Said before the runtime closes: closing ends this member's lease, and the agent then fences
            # the process, which may leave no time to print the error on the way out.
            print(f"[trainmover] rank {rep.rank} (joiner of epoch {plan.epoch}) gives up: {exc}", flush=True)
            raise
        runtime.pending_first_iteration = sorted({plan.epoch, runtime.epoch})
        metrics.write(
            event="promoted",
            member=ident.member_id,
            rank=rep.rank,
            epoch=plan.epoch,
            promoted_at=t_promoted,
            groups_built=t_groups,
            session_built=t_session,
            groups_up=joining.groups_at,
            links_up=joining.done_at,
            resumed_iteration=args.iteration,
            state_ready=time.time(),
            adopted_kept_model=not_adopted is None,
            not_adopted=not_adopted,
        )
        summary = train_loop(session, runtime)
        if runtime.handed_over is not None and rejoins(config, space, ident):
            summary["rejoin"] = (ident.member_id, runtime.handed_over)  # run_standby takes it back to the pool
        return summary
    finally:
        runtime.close()
        metrics.close()
        shutdown()


def _waiting_threads() -> str:
    """Where the join's threads (and the communicator builds it started) are waiting: the stack of each."""
    import sys
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "")
        if name.startswith(("tm_join", "nccl_delta")):
            stack = "".join(traceback.format_stack(frame, limit=6))
            out.append(f"  thread {name}:\n{stack}")
    return "".join(out) or "  (no join thread left)"


class _Joining:
    """``nccl_delta``'s ``join(epoch)`` on a thread; :meth:`wait` re-raises its error."""

    def __init__(self, epoch: int, timeout_s: float) -> None:
        import nccl_delta

        world = nccl_delta.current_world()
        # The stayers' part of the join (their ledgers and their builds of the groups with this rank)
        # waits up to the communicator's connect timeout: the joiner does not give up before they would.
        self.timeout_s = max(timeout_s, world.config.connect_timeout_s + 5.0)
        self.error: BaseException | None = None
        self.done_at: float | None = None
        self.groups_at: float | None = None
        """When the groups were up, before the WORLD ring links (None until then)."""

        def run() -> None:
            try:
                world.join(epoch)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self.error = exc
            finally:
                self.done_at = time.time()
                self.groups_at = world.groups_joined_at

        self._thread = threading.Thread(target=run, name=f"tm_join_e{epoch}", daemon=True)
        self._thread.start()

    def wait(self, job_finished: Callable[[], bool]) -> None:
        """Block until the links are up (at most ``timeout_s``); a superseded join raises ``CommAbandoned``,
        and :class:`JobFinishedFirst` when ``job_finished()`` says every rank completed training meanwhile
        (a planned move asked for at the last boundary: the others trained to the end without it)."""
        deadline = Deadline(self.timeout_s)
        while self._thread.is_alive() and not deadline.expired:
            self._thread.join(min(1.0, deadline.remaining()))
            if self._thread.is_alive() and job_finished():
                raise JobFinishedFirst("every rank completed its last iteration before this joiner's links were up")
        if self._thread.is_alive():
            raise MembershipLost(
                f"the joiner's links were not up within {self.timeout_s:.0f}s; "
                "are the other ranks alive and in the same epoch? Still waiting:\n" + _waiting_threads()
            )
        if self.error is not None:
            raise self.error


def rejoins(config: TrainMoverConfig, space: JobSpace, ident: Identity) -> bool:
    """Whether this process, a planned leaver, goes back to the standby pool: with
    ``--tm-leaver-becomes-standby``, unless it is quarantined as a straggler (its agent decides the same)."""
    if not config.leaver_becomes_standby:
        return False
    from trainmover_ext.control.straggler_watch import is_quarantined

    if is_quarantined(space, ident.host, os.getpid()):
        print(
            f"[trainmover] {ident.member_id} left its rank as a straggler and is quarantined: not rejoining the "
            "standby pool",
            flush=True,
        )
        return False
    return True
