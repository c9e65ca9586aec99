"""The training loop's hooks under ``--trainmover``: membership, failures, migrations.

Contract (every rank, main thread unless noted):
- At start the rank registers as a worker (a lease refreshed every TTL/3),
  writes its ``ranks/<r>`` record if absent, and watches ``migrations/``.
- On a *failure* plan (watch thread) the rank abandons its communicator at
  once: every op in flight or to come raises ``CommAbandoned``, and so does a
  link set-up or a hand-over under way. The training loop then calls
  :meth:`WorkerRuntime.recover`, which carries out the newest failure epoch
  (:func:`~trainmover_ext.migration.recovery.converge`): it keeps the idle links
  both ends agree on and rebuilds the others, reports the iteration it holds
  (one etcd write) and carries out the controller's convergence record (one
  etcd key). A newer failure plan arriving at any step cuts that attempt short,
  and recovery starts again at the newest epoch: recovery is restartable, in
  every role. Training continues at the resume iteration.
- On a *planned* plan the stayers build the joiner's links in the background
  (phase 1) and keep training while the joiner builds its model. Once the
  joiner marks the plan ``ready``, the leaver says at which boundary it waits
  and the controller commits the boundary of the hand-over (``switch_at`` in
  the plan): there the leaver streams its state to the joiner and leaves, and
  the stayers switch the leaver's links to the joiner (phase 2). So the
  training pauses only for the state transfer and the joiner's first step.
- A rank that finds itself replaced (declared dead while hung) stops with
  :class:`MembershipLost`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from trainmover_ext.config import TrainMoverConfig
from trainmover_ext.control.convergence import GridShape
from trainmover_ext.control.membership import Membership, PlanInbox, init_job, report_failure
from trainmover_ext.control.records import MemberRecord, MigrationPlan, RankRecord, migration_key_suffix
from trainmover_ext.deadline import Deadline, RecoveryTimeouts
from trainmover_ext.errors import (
    CommLinkError,
    MalformedValue,
    MembershipLost,
    MigrationAborted,
    RecoverySuperseded,
    StoreError,
)
from trainmover_ext.kv.codec import encode
from trainmover_ext.launch import progress
from trainmover_ext.launch.identity import Identity, identity_from_env, open_space
from trainmover_ext.migration.handover_transport import HandoverChannel
from trainmover_ext.migration.mirror import Mirror, holder_and_ward, ward_of
from trainmover_ext.migration.planned import PendingHandover, hand_over, prepare_hand_over
from trainmover_ext.migration.recovery import converge
from trainmover_ext.migration.timeline import mark_step
from trainmover_ext.runtime import faults, stall_dump
from trainmover_ext.runtime.slowdown import LinkDelay, SlowdownClock
from trainmover_training.training import Runtime, Session

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace
    from trainmover_training.initialize import ParallelLayout

logger = logging.getLogger(__name__)


def _mark_backward(grad: Any) -> Any:
    progress.mark("backward")
    return grad


def stage_role(layout: ParallelLayout) -> str:
    """The control plane's role name of this rank's pipeline stage."""
    return "first" if layout.role in ("first", "only") else layout.role


def _ranks_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def mirror_holder(session: Session, config: TrainMoverConfig) -> int | None:
    """The rank that holds this rank's optimizer-shard mirror, or None when there is no mirror: it is
    off, the optimizer is not distributed, the data-parallel size is 1, or the communicator is not
    nccl_delta (whose groups a recovery rebuilds)."""
    layout = session.layout
    if not (config.optimizer_mirror and session.args.use_distributed_optimizer and layout.dp_size > 1):
        return None
    if layout.comm != "nccl_delta":
        return None
    return holder_and_ward(layout, _ranks_per_node())[0]


def grid_of(layout: ParallelLayout) -> GridShape:
    return GridShape(
        tp=layout.tp_size,
        pp=layout.pp_size,
        dp=layout.dp_size,
        pp_before_dp=layout.pp_before_dp,
        ep=getattr(layout, "ep_size", 1),
        cp=getattr(layout, "cp_size", 1),
    )


class WorkerRuntime(Runtime):
    """See the module docstring."""

    recoverable = (CommLinkError,)

    def __init__(
        self,
        session: Session | None,
        config: TrainMoverConfig,
        ident: Identity,
        space: JobSpace,
        member: Membership,
        epoch: int = 0,
        *,
        layout: ParallelLayout | None = None,
        state_valid: bool = True,
        catch_up: bool = False,
    ) -> None:
        self.session, self.config, self.ident, self.space, self.member = session, config, ident, space, member
        # Without a layout the caller passes the session it comes from.
        self.layout = layout if layout is not None else cast(Session, session).layout
        self.epoch = epoch
        """The newest epoch this rank has carried out."""
        self.state_valid = state_valid
        """Whether this rank's training state is usable (False for a joiner, and while a copy into it is
        under way: one cut short leaves it unusable until a later recovery copies it again)."""
        self.handover: HandoverChannel | None = None
        """The planned hand-over's channel while in use (a newer failure plan severs it)."""
        self._handover_pairs: dict[int, PendingHandover] = {}
        """A planned leaver's hand-over pairs by epoch, built from when it learns of the move."""
        self.timeout_s = RecoveryTimeouts(config.lease_ttl_s).decision_s
        self._switch_at: dict[int, int] = {}
        self._leaver_at: dict[int, int] = {}
        """A planned leaver's ``leaver_at`` by epoch, once written."""
        self._replaced = False
        self._checkpoint_unsaid: int | None = None
        """rank 0: a checkpoint iteration not yet written to etcd (it was unreachable)."""
        self.handed_over: int | None = None
        """Epoch at which this rank, a planned leaver, handed its state over and left training."""
        self.pending_first_iteration: list[int] = []
        """Epochs whose ``first_iteration`` step this process (a joiner) still has to record."""
        self.mirror: Mirror | None = None
        """The distributed optimizer's host-memory mirror (:meth:`start_mirror`), when on."""
        self.slowdown: SlowdownClock | None = None
        """An injected slowdown of this rank (``--tm-inject-slowdown``, the original worker only)."""
        self.link_delay: LinkDelay | None = None
        """An injected slow link of this rank (``--tm-inject-link-delay``, the original worker only)."""
        grid = grid_of(self.layout)
        ep_rank = self.layout.dp_rank % getattr(self.layout, "ep_size", 1)
        if grid.shard_of(self.layout.rank) != (self.layout.tp_rank, self.layout.pp_rank, ep_rank):
            raise MigrationAborted("megatron's rank order is not tp-dp-pp; the convergence logic does not apply")
        # ``catch_up``: also the plans committed before the inbox opened (a joiner's promotion and its
        # runtime's inbox are not one instant).
        self.inbox = PlanInbox(space, self._abandon_at_once, after_plan=self._sever_handover, since_start=catch_up)
        # A lease etcd drops while this rank lives is registered again; the controller waits for that.
        member.rejoin_in_background(lambda: not self._replaced)

    # -- construction --------------------------------------------------------
    @classmethod
    def for_session(cls, session: Session, config: TrainMoverConfig) -> WorkerRuntime:
        """Register this rank and start watching decisions."""
        ident = identity_from_env()
        space = open_space(ident)
        layout = session.layout
        replicas = (
            []
            if session.args.use_distributed_optimizer
            else [r for r in grid_of(layout).replicas_of(layout.rank) if r != layout.rank]
        )
        holder = mirror_holder(session, config)
        # Register before naming ourselves in ranks/<r>: a rank whose member is not registered
        # looks orphaned to the controller, which would replace it.
        member = Membership(
            space,
            MemberRecord(member_id=ident.member_id, kind="worker", host=ident.host, pid=ident.pid),
            ttl_s=max(1, round(config.lease_ttl_s)),
        ).register()
        init_job(
            space,
            [
                RankRecord(
                    rank=layout.rank,
                    member_id=ident.member_id,
                    host=ident.host,
                    role=stage_role(layout),
                    replicas=replicas,
                    holder=holder,
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                )
            ],
        )
        return cls(session, config, ident, space, member)

    def close(self) -> None:
        self._drop_handover_pairs()
        try:
            self.inbox.close()
        finally:
            self.member.close()

    def after_checkpoint(self, session: Session) -> None:
        if session.layout.rank == 0:
            # The controller names this iteration in a plan whose lost state has no replica.
            self._checkpoint_unsaid = session.args.iteration
            self._say_checkpoint()

    def _say_checkpoint(self) -> None:
        """Write ``checkpoint``; while etcd is unreachable, try again after the next iteration."""
        if self._checkpoint_unsaid is None:
            return
        try:
            self.space.put(self.space.key("checkpoint"), encode("checkpoint", {"iteration": self._checkpoint_unsaid}))
        except StoreError as exc:
            logger.warning("could not record checkpoint %d in etcd (%s); trying again", self._checkpoint_unsaid, exc)
            return
        self._checkpoint_unsaid = None

    def finishing(self, session: Session) -> contextlib.AbstractContextManager[None]:
        """An abandon during the step's last collectives lets them end alike on every live member, so
        no rank completes an iteration that its model-parallel peers abandon (:mod:`nccl_delta.finishing`)."""
        progress.mark("step")
        if self.layout.comm != "nccl_delta":
            return contextlib.nullcontext()
        import nccl_delta

        return nccl_delta.current_world().finishing()

    @contextlib.contextmanager
    def evaluating(self, session: Session) -> Iterator[None]:
        progress.mark("eval")
        yield
        progress.mark("control")

    @contextlib.contextmanager
    def saving(self, session: Session) -> Iterator[None]:
        progress.mark("save")
        yield
        progress.mark("control")

    def start_mirror(self, session: Session) -> None:
        """Keep this rank's optimizer shard in its holder's host memory after every step, and hold its
        ward's (:mod:`trainmover_ext.migration.mirror`), when the rank's record names a holder (the job's
        first ranks decided it: a joiner follows them, whatever its own flags)."""
        if not session.args.use_distributed_optimizer or self.layout.comm != "nccl_delta":
            return
        key = self.space.key("ranks", self.layout.rank)
        entry = self.space.kv.get(key)
        holder = RankRecord.from_bytes(entry.value, key=key).holder if entry is not None else None
        if holder is None:
            return
        self.mirror = Mirror(session, holder, ward_of(session.layout, holder))
        logger.info("rank %d: optimizer shard mirrored at rank %d", self.layout.rank, holder)

    def after_step(self, session: Session) -> None:
        if self.mirror is not None:
            self.mirror.exchange()
            if session.args.iteration >= session.args.train_iters:
                # The last step's copy lands here, where a failure is still recoverable, before the
                # ranks close their groups.
                self.mirror.settle()

    def track_progress(self, session: Session) -> None:
        """Publish the main thread's progress to the agent (:mod:`trainmover_ext.launch.progress`): each
        micro-batch's forward and backward, and the collective a wait blocks in; on a GPU the compute
        samples come from the device's timeline."""
        import torch

        from nccl_delta import native_group

        inner = session.forward_step_func

        def forward_step(data_iterator: Any, model: Any) -> Any:
            progress.mark("forward")
            return inner(data_iterator, model)

        session.forward_step_func = forward_step
        # The output layer's gradient comes first in a backward pass.
        last = [p for chunk in session.model for p in chunk.parameters() if p.requires_grad][-1]
        last.register_hook(_mark_backward)
        if last.device.type == "cuda":  # the wall clock names no straggler there (launch.device_time)
            from trainmover_ext.launch.device_time import CudaTimeline

            progress.use_device_timeline(CudaTimeline())
        elif torch.get_num_threads() == 1:  # the main thread computes alone: its clock leaves other threads out
            progress.use_cpu_clock(time.thread_time)
        observer: native_group.WaitObserver = progress.waiting
        if self.link_delay is not None:
            observer = self.link_delay.wrap(observer, self.layout.rank, lambda: int(session.args.iteration) + 1)
        native_group.observe_waits(observer)

    def after_iteration(self, session: Session, loss: float | None) -> None:
        if self.slowdown is not None:
            self.slowdown.ended(session.args.iteration)
        progress.iteration_done(session.args.iteration)
        progress.mark("control")  # the etcd writes below wait on etcd, not on this rank's work
        for epoch in self.pending_first_iteration:
            mark_step(self.space, epoch, "first_iteration", status="done")
        self.pending_first_iteration = []
        self._say_checkpoint()

    def after_training(self, session: Session) -> None:
        """Say this rank is done before the lease goes, so the controller does not replace it (retried
        while etcd is unreachable, up to the decision timeout)."""
        progress.mark("done")
        self._say_checkpoint()
        key = self.space.key("finished", session.layout.rank)
        deadline = Deadline(self.timeout_s)
        while True:
            try:
                self.space.put(key, encode("finished", {"iteration": session.args.iteration}))
                return
            except StoreError as exc:
                if deadline.expired:
                    raise
                logger.warning("rank %d: could not record that it finished (%s); trying again", self.layout.rank, exc)
                time.sleep(0.5)

    # -- decisions (watch thread) -------------------------------------------
    def _abandon_at_once(self, plan: MigrationPlan) -> None:
        """A failure plan newer than this rank's epoch abandons the communicator before any waiter wakes:
        the main thread rebuilds the links next, and an abandon arriving after that would sever them."""
        if plan.epoch <= self.epoch or plan.reason != "failure":
            return
        reps = plan.replacement_list()
        if any(rep.rank == self.layout.rank and rep.leaver == self.ident.member_id for rep in reps):
            self._replaced = True  # we were declared dead (e.g. hung): never rejoin
        describe = None
        if self.layout.comm == "nccl_delta":
            import nccl_delta

            describe = nccl_delta.current_world().describe
        # Armed first: if the abandon below or the main thread's recovery blocks, the stacks say where.
        stall_dump.arm(
            lambda: self.epoch >= plan.epoch or self._replaced, self.timeout_s, f"epoch {plan.epoch}", describe
        )
        if self.layout.comm == "nccl_delta":
            import nccl_delta

            world = nccl_delta.current_world()
            if world.epoch < plan.epoch:
                try:
                    world.abandon(plan.epoch, f"rank(s) {[r.rank for r in reps]} failed", dead={r.rank for r in reps})
                except Exception:  # a rank whose abandon failed may wait in an op forever: say why
                    logger.exception("rank %d: the abandon of epoch %d failed", self.layout.rank, plan.epoch)
                    raise

    def _sever_handover(self, plan: MigrationPlan) -> None:
        """A newer failure plan severs a planned hand-over in progress (its owner then finds the plan)."""
        channel = self.handover
        if plan.epoch > self.epoch and plan.reason == "failure" and channel is not None:
            channel.sever()

    def newest_failure_epoch(self) -> int:
        """The newest failure plan's epoch this rank has heard of (0: none)."""
        plan = self.inbox.newest("failure")
        return plan.epoch if plan is not None else 0

    def _wait_failure_plan(self, after: int, timeout_s: float) -> MigrationPlan:
        """The newest failure plan newer than epoch ``after``, once there is one (at most ``timeout_s``)."""

        def newer(latest: dict[int, MigrationPlan]) -> MigrationPlan | None:
            epochs = [e for e, p in latest.items() if p.reason == "failure" and e > after]
            return latest[max(epochs)] if epochs else None

        plan = self.inbox.wait_until(newer, timeout_s)
        if plan is None:
            raise MigrationAborted(
                f"rank {self.layout.rank}: no migration plan within {timeout_s:.0f}s after a "
                "communication failure; is the controller (the launcher's agent) running?"
            )
        return plan

    def _drop_handover_pairs(self) -> None:
        pairs, self._handover_pairs = self._handover_pairs, {}
        for pending in pairs.values():
            pending.cancel()

    # -- unexpected failure ---------------------------------------------------
    def _report_suspects(self, exc: BaseException, after: int) -> None:
        """Report the peers ``exc`` suspects (``CommLinkError.peers``) unless a failure plan newer than
        epoch ``after`` is already known; best effort (the leases are the fallback)."""
        peers = getattr(exc, "peers", ())
        if not peers or self.newest_failure_epoch() > after:
            return
        for peer in peers:
            key = self.space.key("ranks", peer)
            try:
                entry = self.space.kv.get(key)
                if entry is None:
                    continue
                serving = RankRecord.from_bytes(entry.value, key=key).member_id
                report_failure(
                    self.space,
                    rank=peer,
                    member_id=serving,
                    reporter=self.ident.member_id,
                    reason=f"rank {self.layout.rank}'s link broke: {str(exc)[:200]}",
                    epoch=after,
                    suspect=True,
                )
            except (StoreError, MalformedValue) as err:
                logger.info("rank %d: could not report suspect rank %d: %s", self.layout.rank, peer, err)

    def recover(self, session: Session, exc: BaseException) -> None:
        """The current iteration (or migration step) was abandoned: carry out the newest failure epoch,
        and start again at the newest one whenever a newer plan cuts an attempt short."""
        progress.mark("recovery")
        layout = session.layout
        after = self.epoch
        self._drop_handover_pairs()  # a failure supersedes any planned move this rank was leaving in
        while True:
            # Detection is the control plane's: the agent reports a dead child at once and a hung
            # one loses its lease; we say which peers our failed op suspects (a lost machine's agent
            # cannot report) and wait for the decision (which also abandoned our links).
            self._report_suspects(exc, after)
            try:
                plan = self._wait_failure_plan(after, self.timeout_s)
            except MigrationAborted as abort:
                # Say what broke the iteration: with no plan coming, that is where to look.
                raise MigrationAborted(f"{abort} The iteration failed with: {type(exc).__name__}: {exc}") from exc
            if self._replaced:
                raise MembershipLost(f"rank {layout.rank} was replaced at epoch {plan.epoch} while unresponsive")
            logger.info("rank %d: recovering at epoch %d after %s", layout.rank, plan.epoch, exc)
            try:
                converge(self, session, plan, fresh_joiner=False)
            except (CommLinkError, RecoverySuperseded) as cut:
                print(
                    f"[trainmover] rank {layout.rank}: recovery of epoch {plan.epoch} cut short ({cut}); "
                    "restarting at the newest epoch",
                    flush=True,
                )
                after, exc = plan.epoch, cut
                continue
            session.metrics.write(
                event="recovered",
                epoch=plan.epoch,
                reason=plan.reason,
                t=time.time(),
                resumed_iteration=session.args.iteration,
            )
            return

    # -- planned migration ----------------------------------------------------
    def _wait_plan_field(self, epoch: int, ready: Callable[[MigrationPlan], bool], timeout_s: float) -> bool:
        """Block until ``ready(plan)`` holds for the plan of ``epoch`` as the inbox holds it."""
        return self.inbox.wait_until(lambda latest: True if ready(latest[epoch]) else None, timeout_s) is not None

    def _switch_point(self, session: Session, plan: MigrationPlan, leaver: bool) -> int | None:
        """The boundary of the planned move ``plan`` once the controller committed it; None: train on.

        The leaver (``leaver``: of a move of several ranks, the lowest), once every joiner is ready
        (``ready``), says so at its boundary (``leaver_at``), trains one more iteration and waits at the
        next boundary for the controller's ``switch_at`` (one boundary later): no rank can complete the
        iteration after that without it, so nobody passes the point the controller picks. A stayer, and
        any other leaver, reads the plan at each boundary until the point is known (its watch may lag by
        an iteration)."""
        e, args = plan.epoch, session.args
        if e in self._switch_at:
            return self._switch_at[e]
        last = args.train_iters - 1
        at_last = args.iteration >= last
        if leaver:
            if "ready" not in plan.steps and not at_last:
                return None  # the joiner still builds its links and model: train on meanwhile
            # The last boundary: the hand-over cannot come later, so wait for the joiner here.
            if not self._wait_plan_field(e, lambda p: "ready" in p.steps, self.timeout_s):
                logger.warning(
                    "rank %d: the joiner of epoch %d was not ready within %.0fs; finishing without the planned move",
                    self.layout.rank,
                    e,
                    self.timeout_s,
                )
                return None
            if e not in self._leaver_at:
                # Say that we are ready here and train one more iteration while the controller commits the
                # switch point (two boundaries on); wait at the next boundary if it is not known by then.
                mark_step(self.space, e, "leaver_waits", fields={"leaver_at": args.iteration, "last_boundary": last})
                self._leaver_at[e] = args.iteration
                if not at_last:
                    return None
            if not self._wait_plan_field(e, lambda p: p.switch_at is not None, self.timeout_s):
                raise MigrationAborted(
                    f"rank {self.layout.rank}: the controller committed no switch point for the "
                    f"planned move of epoch {e} within {self.timeout_s:.0f}s"
                )
            switch_at = self.inbox.latest[e].switch_at
            assert switch_at is not None  # the wait above saw it set, and a plan's switch_at is never unset
        else:
            key = self.space.key("migrations", migration_key_suffix(e))
            deadline = Deadline(self.timeout_s)
            while True:
                try:
                    entry = self.space.kv.get(key)
                except StoreError as exc:  # etcd unreachable: no switch point known yet
                    logger.warning("rank %d: could not read the plan of epoch %d: %s", self.layout.rank, e, exc)
                    entry = None
                switch_at = None if entry is None else MigrationPlan.from_bytes(entry.value, key=key).switch_at
                if switch_at is not None or not at_last:
                    break
                if deadline.expired:  # the last boundary: the move cannot come later
                    logger.warning(
                        "rank %d: no switch point for epoch %d within %.0fs; finishing without the planned move",
                        self.layout.rank,
                        e,
                        self.timeout_s,
                    )
                    return None
                time.sleep(0.05)
            if switch_at is None:
                return None
        self._switch_at[e] = switch_at
        return switch_at

    def before_iteration(self, session: Session) -> bool:
        progress.mark("control", session.args.iteration)  # a planned move may wait for the controller here
        go_on = self._before_iteration(session)
        if go_on:
            progress.mark("iteration")
            if self.slowdown is not None:
                self.slowdown.began()
        return go_on

    def _before_iteration(self, session: Session) -> bool:
        if self._replaced:
            raise MembershipLost(f"rank {session.layout.rank} was replaced by the control plane")
        latest = self.inbox.snapshot()
        pending = [p for e, p in sorted(latest.items()) if e > self.epoch and p.reason == "planned"]
        if not pending:
            return True
        plan = pending[0]
        if self.newest_failure_epoch() > plan.epoch:
            return True  # a failure superseded the move: this iteration's ops raise and recovery takes over
        reps = plan.replacement_list()
        moving = sorted(r.rank for r in reps)
        layout, args = session.layout, session.args
        leaver = layout.rank in moving
        if leaver:
            faults.at("prepare", rank=layout.rank, epoch=plan.epoch)
            if plan.epoch not in self._handover_pairs and "ready" in plan.steps:
                # Every joiner is ready and opens its end now: build the pair while training goes on.
                self._handover_pairs[plan.epoch] = prepare_hand_over(self, session, plan)
        else:
            import nccl_delta

            world = nccl_delta.current_world()
            if plan.epoch not in world.prepared and plan.epoch not in self._switch_at:
                world.prepare(moving, plan.epoch, joiner=",".join(r.joiner for r in reps))
        # One leaver (the lowest rank moving) agrees the switch point with the controller; the others
        # read it at each boundary like the stayers (see _switch_point).
        switch_at = self._switch_point(session, plan, leaver and layout.rank == moving[0])
        if switch_at is None or args.iteration < switch_at:
            return True
        if self.mirror is not None:
            self.mirror.settle()  # its exchange in flight is on the groups about to be swapped
        if leaver:
            try:
                hand_over(self, session, plan, self._handover_pairs.pop(plan.epoch, None))
            except RecoverySuperseded as exc:
                raise MembershipLost(
                    f"rank {layout.rank}: the planned move of epoch {plan.epoch} was superseded by a "
                    f"failure; the rank's joiner takes its state from a replica ({exc})"
                ) from exc
            self.handed_over = plan.epoch
            return False
        import nccl_delta

        report = nccl_delta.current_world().switch(plan.epoch, timeout_s=self.timeout_s)
        self.epoch = plan.epoch
        session.metrics.write(
            event="recovered",
            epoch=plan.epoch,
            reason=plan.reason,
            t=time.time(),
            resumed_iteration=args.iteration,
            links_touched=report.links_touched,
        )
        return True
