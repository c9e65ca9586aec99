"""The training loop's hooks under ``--trainmover``: membership, failures, migrations.

Contract (every rank, main thread unless noted):
- At start the rank registers as a worker (a lease refreshed every TTL/3),
  writes its ``ranks/<r>`` record if absent, and watches ``migrations/``.
- On a *failure* plan (watch thread) the rank abandons its communicator at
  once: every op in flight or to come raises ``CommAbandoned``. The training
  loop then calls :meth:`WorkerRuntime.recover`, which keeps the idle links
  both ends agree on and rebuilds the others in the plan's epoch, reports the
  iteration it holds (one etcd write) and carries out the controller's
  convergence record (one etcd key): the resume iteration and the state copies
  from replicas, or the latest checkpoint when no replica holds the lost state.
  Training continues at that iteration.
- On a *planned* plan the stayers build the joiner's links in the background
  (phase 1) and keep training while the joiner builds its model. Once the
  joiner marks the plan ``ready``, all ranks agree, through one
  compare-and-swap key, on the iteration boundary where the hand-over
  happens: there the leaver streams its state to the joiner and leaves, and
  the stayers switch the leaver's links to the joiner (phase 2). So the
  training pauses only for the state transfer and the joiner's first step.
- A rank that finds itself replaced (declared dead while hung) stops with
  :class:`MembershipLost`.
"""

from __future__ import annotations

import logging
import threading
import time
from megatron.training import checkpointing
from megatron.training.training import Runtime, Session
from trainmover_ext.config import TrainMoverConfig
from trainmover_ext.control.convergence import GridShape
from trainmover_ext.control.membership import DecisionWatcher, Membership, init_job, report_recovery, wait_convergence
from trainmover_ext.control.records import MemberRecord, MigrationPlan, RankRecord
from trainmover_ext.errors import CommLinkError, MembershipLost, MigrationAborted
from trainmover_ext.kv.codec import decode, encode
from trainmover_ext.runtime.identity import Identity, identity_from_env, open_space
from trainmover_ext.runtime.timeline import mark_step

logger = logging.getLogger(__name__)


def stage_role(layout) -> str:
    """The control plane's role name of this rank's pipeline stage."""
    return "first" if layout.role in ("first", "only") else layout.role


def grid_of(layout) -> GridShape:
    return GridShape(tp=layout.tp_size, pp=layout.pp_size, dp=layout.dp_size)


class WorkerRuntime(Runtime):
    """See the module docstring."""

    recoverable = (CommLinkError,)

    def __init__(self, session: Session, config: TrainMoverConfig, ident: Identity, space, member: Membership,
                 epoch: int = 0):
        self.session, self.config, self.ident, self.space, self.member = session, config, ident, space, member
        self.epoch = epoch
        self.timeout_s = max(30.0, 10 * config.lease_ttl_s)
        self._plans: dict[int, MigrationPlan] = {}
        self._cond = threading.Condition()
        self._switch_at: dict[int, int] = {}
        self._replaced = False
        self.handed_over: int | None = None
        """Epoch at which this rank, a planned leaver, handed its state over and left training."""
        self.pending_first_iteration: int | None = None
        """Epoch whose ``first_iteration`` step this process (a joiner) still has to record."""
        grid = grid_of(session.layout)
        if grid.shard_of(session.layout.rank) != (session.layout.tp_rank, session.layout.pp_rank):
            raise MigrationAborted("megatron's rank order is not tp-dp-pp; the convergence logic does not apply")
        self.watcher = DecisionWatcher(space, self._on_plan)

    # -- construction --------------------------------------------------------
    @classmethod
    def for_session(cls, session: Session, config: TrainMoverConfig) -> "WorkerRuntime":
        """Register this rank and start watching decisions."""
        ident = identity_from_env()
        space = open_space(ident)
        layout = session.layout
        replicas = [] if session.args.use_distributed_optimizer else [
            r for r in grid_of(layout).replicas_of(layout.rank) if r != layout.rank
        ]
        # Register before naming ourselves in ranks/<r>: a rank whose member is not registered
        # looks orphaned to the controller, which would replace it.
        member = Membership(space, MemberRecord(member_id=ident.member_id, kind="worker", host=ident.host,
                                                pid=ident.pid), ttl_s=max(1, round(config.lease_ttl_s))).register()
        init_job(space, [RankRecord(rank=layout.rank, member_id=ident.member_id, host=ident.host,
                                    role=stage_role(layout), replicas=replicas)])
        return cls(session, config, ident, space, member)

    def close(self) -> None:
        try:
            self.watcher.close()
        finally:
            self.member.close()

    def after_checkpoint(self, session: Session) -> None:
        if session.layout.rank == 0:
            # The controller names this iteration in a plan whose lost state has no replica.
            self.space.put(self.space.key("checkpoint"), encode("checkpoint", {"iteration": session.args.iteration}))

    def after_iteration(self, session: Session, loss) -> None:
        if self.pending_first_iteration is not None:
            mark_step(self.space, self.pending_first_iteration, "first_iteration", status="done")
            self.pending_first_iteration = None

    def after_training(self, session: Session) -> None:
        """Say this rank is done before the lease goes, so the controller does not replace it."""
        self.space.put(self.space.key("finished", session.layout.rank),
                       encode("finished", {"iteration": session.args.iteration}))

    # -- decisions (watch thread) -------------------------------------------
    def _on_plan(self, plan: MigrationPlan) -> None:
        if plan.epoch <= self.epoch:
            return
        reps = plan.replacement_list()
        if plan.reason == "failure":
            if any(rep.rank == self.session.layout.rank and rep.leaver == self.ident.member_id for rep in reps):
                self._replaced = True  # we were declared dead (e.g. hung): never rejoin
            if self.session.layout.comm == "nccl_delta":
                import nccl_delta

                world = nccl_delta.current_world()
                # Abandon before waking the main thread: it rebuilds the links next, and an
                # abandon arriving after that would sever the new links.
                if world.epoch < plan.epoch:
                    world.abandon(plan.epoch, f"rank(s) {[r.rank for r in reps]} failed",
                                  dead={r.rank for r in reps})
        with self._cond:
            self._plans[plan.epoch] = plan
            self._cond.notify_all()

    def _wait_plan(self, predicate, timeout_s: float) -> MigrationPlan:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(predicate(p) for e, p in self._plans.items() if e > self.epoch), timeout_s
            )
            if not ok:
                raise MigrationAborted(
                    f"rank {self.session.layout.rank}: no migration plan within {timeout_s:.0f}s after a "
                    "communication failure; is the controller (the launcher's agent) running?"
                )
            return min((p for e, p in self._plans.items() if e > self.epoch and predicate(p)), key=lambda p: p.epoch)

    # -- unexpected failure ---------------------------------------------------
    def recover(self, session: Session, exc: BaseException) -> None:
        """The current iteration was abandoned: converge on a plan's epoch and continue."""
        layout = session.layout
        # Detection is the control plane's: the agent reports a dead child at once and a hung
        # one loses its lease; we only wait for the decision (which also abandoned our links).
        try:
            plan = self._wait_plan(lambda p: p.reason == "failure", self.timeout_s)
        except MigrationAborted as abort:
            # Say what broke the iteration: with no plan coming, that is where to look.
            raise MigrationAborted(f"{abort} The iteration failed with: {type(exc).__name__}: {exc}") from exc
        if self._replaced:
            raise MembershipLost(f"rank {layout.rank} was replaced at epoch {plan.epoch} while unresponsive")
        logger.info("rank %d: recovering at epoch %d after %s", layout.rank, plan.epoch, exc)
        converge(self, session, plan, joiner=False)
        session.metrics.write(event="recovered", epoch=plan.epoch, reason=plan.reason, t=time.time(),
                              resumed_iteration=session.args.iteration)

    # -- planned migration ----------------------------------------------------
    def _wait_ready(self, epoch: int) -> bool:
        """Block until the joiner of ``epoch`` marked its plan ``ready`` (at most ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: "ready" in self._plans[epoch].steps, self.timeout_s)

    def before_iteration(self, session: Session) -> bool:
        if self._replaced:
            raise MembershipLost(f"rank {session.layout.rank} was replaced by the control plane")
        with self._cond:
            pending = [p for e, p in sorted(self._plans.items()) if e > self.epoch and p.reason == "planned"]
        if not pending:
            return True
        plan = pending[0]
        rep = plan.replacement_list()[0]
        layout, args = session.layout, session.args
        leaver = rep.rank == layout.rank
        if plan.epoch not in self._switch_at:
            if not leaver:
                import nccl_delta

                world = nccl_delta.current_world()
                if plan.epoch not in world.prepared:
                    world.prepare(rep.rank, plan.epoch, joiner=rep.joiner)
            # Read every boundary until set: another rank may pick the boundary before our watch
            # delivers the joiner's ``ready``, and we must not pass it.
            key = self.space.key("switch_at", plan.epoch)
            entry = self.space.kv.get(key)
            if entry is None:
                if "ready" not in plan.steps:
                    if args.iteration < args.train_iters - 1:
                        return True  # the joiner still builds its links and model: train on meanwhile
                    # The last boundary: the hand-over cannot come later, so wait for the joiner here.
                    if not self._wait_ready(plan.epoch):
                        logger.warning("rank %d: the joiner of epoch %d was not ready within %.0fs; finishing "
                                       "without the planned move", layout.rank, plan.epoch, self.timeout_s)
                        return True
                # Two iterations ahead (every rank is within one iteration of us, so none has passed
                # it), but never beyond the last boundary: a rank waiting there holds everyone back.
                switch_at = min(args.iteration + 2, args.train_iters - 1)
                self.space.put_if_absent(key, encode("switch_at", {"iteration": switch_at}))
                entry = self.space.kv.get(key)
            self._switch_at[plan.epoch] = decode(entry.value, kind="switch_at", key=key)["iteration"]
        if args.iteration < self._switch_at[plan.epoch]:
            return True
        if leaver:
            hand_over(self, session, plan)
            self.handed_over = plan.epoch
            return False
        import nccl_delta

        report = nccl_delta.current_world().switch(plan.epoch, timeout_s=self.timeout_s)
        self.epoch = plan.epoch
        session.metrics.write(event="recovered", epoch=plan.epoch, reason=plan.reason, t=time.time(),
                              resumed_iteration=args.iteration, links_touched=report.links_touched)
        return True


def _await_convergence(rt: WorkerRuntime, epoch: int):
    """The controller's convergence record of ``epoch`` (it decides once every stayer reported)."""
    def superseded() -> bool:
        with rt._cond:
            return any(e > epoch and p.reason == "failure" for e, p in rt._plans.items())

    record = wait_convergence(rt.space, epoch, rt.timeout_s, superseded)
    if record is None:
        why = ("a newer failure superseded it" if superseded() else
               f"the controller decided nothing within {rt.timeout_s:.0f}s (did every stayer report?)")
        raise MigrationAborted(f"epoch {epoch} did not converge: {why}")
    return record


def converge(rt: WorkerRuntime, session: Session, plan: MigrationPlan, joiner: bool) -> None:
    """Rebuild links at ``plan.epoch``, agree on the resume iteration, copy state, reset data."""
    import nccl_delta

    from trainmover_ext.runtime.transfer import LinkChannel

    layout, args = session.layout, session.args
    reps = plan.replacement_list()
    replaced = {r.rank for r in reps}
    e = plan.epoch
    world = nccl_delta.current_world()
    if not joiner:
        # The abandoned iteration drew dropout masks before it failed: start it again from its
        # snapshot, as a run without the failure would (a copy below may overwrite it).
        session.rewind()
        report_recovery(rt.space, epoch=e, rank=layout.rank, iteration=args.iteration)
        report = world.recover(e, replaced=replaced)
        logger.info("rank %d: epoch %d kept %d links, rebuilt %d", layout.rank, e, report.kept, report.rebuilt)
    mark_step(rt.space, e, "links_rebuilt" if not joiner else "joined", only_if=joiner)
    cplan = _await_convergence(rt, e)
    if cplan.from_checkpoint:
        root = args.load or args.save
        if not root or checkpointing.read_latest_iteration(root) is None:
            raise MigrationAborted(f"epoch {e}: {cplan.reason} and there is no checkpoint to fall back to "
                                   "(give --save/--save-interval)")
        checkpointing.load_checkpoint(root, session.model, session.optimizer, session.scheduler, args, layout)
        args.iteration = checkpointing.read_latest_iteration(root)
        args.consumed_train_samples = args.iteration * args.global_batch_size
    else:
        # Over the communicator's own link: the source is a ring neighbour of its target when one
        # qualifies (the controller picks it), so nothing is set up on the critical path.
        for src, dst in cplan.copies:
            if layout.rank == src:
                _send_and_report(LinkChannel(dst), session, dst, e)
            elif layout.rank == dst:
                _recv_and_report(LinkChannel(src), session, src, e)
        if args.iteration != cplan.resume_iteration:
            raise MigrationAborted(f"rank {layout.rank} holds iteration {args.iteration} after the copies, "
                                   f"not {cplan.resume_iteration}")
    mark_step(rt.space, e, "transferred" if not cplan.from_checkpoint else "checkpoint_loaded", only_if=joiner,
              resume_iteration=args.iteration)
    session.reset_data()
    rt.epoch = e


def hand_over(rt: WorkerRuntime, session: Session, plan: MigrationPlan) -> None:
    """The planned leaver, at the agreed boundary: stream state to the joiner, then leave."""
    from trainmover_ext.launch.rendezvous import rank_store
    from trainmover_ext.runtime.transfer import open_transfer_link

    pg = open_transfer_link(rank_store(_td(rt.timeout_s)), f"{plan.epoch}/leaver", 0, rt.timeout_s)
    _send_and_report(pg, session, plan.replacement_list()[0].rank, plan.epoch)
    rt.epoch = plan.epoch


def receive_from_leaver(rt: WorkerRuntime, session: Session, plan: MigrationPlan) -> None:
    """The planned joiner: receive the leaver's state (blocks until the leaver reaches the boundary)."""
    from trainmover_ext.launch.rendezvous import rank_store
    from trainmover_ext.runtime.transfer import open_transfer_link

    pg = open_transfer_link(rank_store(_td(rt.timeout_s)), f"{plan.epoch}/leaver", 1, rt.timeout_s)
    _recv_and_report(pg, session, plan.replacement_list()[0].rank, plan.epoch)
    mark_step(rt.space, plan.epoch, "transferred", resume_iteration=session.args.iteration)
    session.reset_data()
    rt.epoch = plan.epoch


def _send_and_report(channel, session, dst: int, epoch: int) -> int:
    """Send this rank's state and say how much, and what it cost in memory (must be ~nothing)."""
    from trainmover_ext.runtime.memwatch import PeakWindow
    from trainmover_ext.runtime.transfer import send_state

    with PeakWindow() as mem:
        sent = send_state(channel, session)
    print(f"[trainmover] rank {session.layout.rank} sent {sent / 2**20:.2f} MiB of state to rank {dst} "
          f"(epoch {epoch}); RSS {mem.start_rss / 2**20:.1f} MiB at the start, peak {mem.peak / 2**20:.1f} MiB "
          "during", flush=True)
    return sent


def _recv_and_report(channel, session, src: int, epoch: int) -> int:
    """Receive a rank's state and say how much, and whether it allocated anything it does not keep."""
    from trainmover_ext.runtime.memwatch import PeakWindow
    from trainmover_ext.runtime.transfer import recv_state

    with PeakWindow() as mem:
        received = recv_state(channel, session)
    print(f"[trainmover] rank {session.layout.rank} received {received / 2**20:.2f} MiB of state from rank {src} "
          f"(epoch {epoch}); RSS {mem.start_rss / 2**20:.1f} MiB at the start, peak {mem.peak / 2**20:.1f} MiB "
          f"during, {mem.end_rss / 2**20:.1f} MiB after", flush=True)
    return received


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
