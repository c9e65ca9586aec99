"""The agent's TrainMover mode: a failed rank is replaced by a warm standby, nobody restarts.

Contract (one agent per node; the single-node case is what runs today):
- Ranks and ``--tm-standbys`` standbys are forked from the warm agent before
  the agent opens any etcd (gRPC) connection; each gets ``TRAINMOVER_MEMBER_ID``.
- An active node's agent then serves its ``--tm-record-dir`` to standbys on other nodes
  (:mod:`~trainmover_ext.launch.recording_server`, job token required) and writes the URL on its
  node record; without the job token it serves nothing and says why.
- The agent then registers as a member and runs a leader-elected
  :class:`~trainmover_ext.control.controller.Controller`.
- A rank process that exits non-zero is reported at once
  (``reports/<rank>/<agent>``): the fast detection path. The controller's plan
  names a standby; the agent maps the rank to that standby's process and,
  once that migration finished (its ``first_iteration`` step, or
  ``REPLENISH_AFTER_S`` at the latest), starts a fresh standby so the pool
  returns to its size: it wakes one of the ``--tm-standby-reserves`` children
  it forked at the start (``process.fork_reserve``), which skips a new
  interpreter's imports, and spawns a new interpreter once none is left.
  Waiting keeps the new standby's start and warm-up off the node's cores
  while the job is still recovering; a rank lost while none of the node's
  standbys is idle (its joiner died in its join) starts the refills at once.
- A plan that leaves a rank unserved (no standby), or no plan within the
  deadline (``replacement_s``; ``decision_s``, as long as the ranks wait, while
  a standby of the node is idle: it is warming), ends the job the classic way:
  every process is stopped and the agent's restart policy applies.
- With ``--tm-leaver-becomes-standby`` a planned leaver of this agent stays
  alive as one of its standbys (``leaver_standby_id``), so the standby the move
  consumed here is not replaced: the leaver refills the pool.
- A planned leaver stays watched until it exits: until its hand-over is done
  it holds the rank's only up-to-date state, so its non-zero exit is reported
  like a rank's (the controller then treats it as a failure of the rank whose
  joiner stays), and a failure plan that names it fences it.
- A rank may move to a standby of another node's agent: the leaver's agent
  retires (and fences) its process, the joiner's agent adopts the standby.
- A standby that exited with ``STANDBY_REFUSED_EXIT_CODE`` (78) was refused by
  the job: its model fingerprint differs from the job's
  (:mod:`trainmover_ext.control.fingerprint`). The agent says which fields
  differ and does not start another: the same flags would be refused again.
- The job is done for an agent when every process it serves has exited 0, or,
  when it serves none any more, when every rank of the job has finished;
  leftover standbys are then stopped.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import TYPE_CHECKING

from trainmover_ext.control.fingerprint import why_refused
from trainmover_ext.deadline import RecoveryTimeouts
from trainmover_ext.errors import STANDBY_REFUSED_EXIT_CODE, StoreError
from trainmover_ext.launch.heartbeat import HangWatch
from trainmover_ext.launch.identity import ENV_MEMBER_ID, ENV_SLOT, leaver_standby_id
from trainmover_ext.launch.process import (
    RankProcess,
    Reserve,
    activate,
    discard,
    fork_rank,
    fork_reserve,
    spawn_rank,
    wait_any_exit,
)
from trainmover_ext.launch.recording_server import RecordingServer, serve_node_recordings
from trainmover_ext.launch.stalls import StallWatch

if TYPE_CHECKING:
    from trainmover_ext.launch.node_reports import NodeReports

MAX_STANDBY_FAILURES = 3
REPLENISH_AFTER_S = 60.0
"""A consumed standby is replaced when its migration finished, or this long after the plan at the latest."""


def _member_id(kind: str, node: str, index: int) -> str:
    """``<kind>-<node>-<index>-<random>``; ``node`` is ``n<node rank>``, or ``m`` on a standby machine."""
    return f"{kind}-{node}-{index}-{uuid.uuid4().hex[:6]}"


class TrainMoverSupervisor:
    """Runs inside :class:`~trainmover_ext.launch.agent.Agent` when the script has ``--trainmover``."""

    def __init__(self, agent):
        self.agent = agent
        self.cfg = agent.config
        self.serving: dict[int, tuple[RankProcess, str]] = {}
        self.standbys: dict[str, RankProcess] = {}
        self.retired: list[RankProcess] = []
        self.leaving: dict[int, tuple[RankProcess, str]] = {}
        """Planned leavers still running, by rank (see the module docstring)."""
        self.planned_leavers: set[str] = set()
        """Members that were the leaver of a planned move (of any node)."""
        self.kept_joiner: set[int] = set()
        """Failure epochs whose planned joiner kept its rank (logged once)."""
        self.reported: dict[int, float] = {}
        self.placed: set[int] = set()
        """Epochs whose placement notes were logged."""
        self.report_retry: dict[int, float] = {}
        """When a report etcd could not take may be tried again, by rank."""
        self.space = self.controller = self.member = self.inbox = self.archive = self.probes = None
        self.hangs = HangWatch(0)
        """Sees a serving process freeze (``launch.heartbeat``); made in :meth:`start`, before any fork."""
        self.stalls = StallWatch(0)
        """Sees a serving rank's main thread stall (``launch.stalls``; its progress is in the heartbeat file)."""
        self.reports: NodeReports | None = None
        """Compute times and GPU health for the straggler watch (``launch.node_reports``; once etcd is open)."""
        self.recordings: RecordingServer | None = None
        """Serves this node's recordings to standbys on other nodes (an active node with the sandbox)."""
        self.epoch = self.standbys_started = 0
        self.reserves: list[Reserve] = []
        """Pre-forked children that start refills without a new interpreter (``--tm-standby-reserves``)."""
        self.standby_nice = self.refill_nice = 0
        """Niceness until promotion of this agent's first standbys (``--tm-standby-nice``) and of those it starts
        while the job trains (``--tm-refill-nice``), where a promoted one can restore its priority."""
        self.standby_failures = 0
        """Standbys that exited non-zero in a row; replenishing stops at ``MAX_STANDBY_FAILURES``."""
        self.slots: dict[str, int] = {}
        """The slot of each standby of a standby machine, by member id."""
        self.replenish: list[tuple[int, float]] = []
        """One ``(epoch, latest time)`` per consumed standby still to be replaced."""

    # -- processes -------------------------------------------------------------
    @property
    def node_label(self) -> str:
        return "m" if self.standby_machine else f"n{self.cfg.node_rank}"

    @property
    def standby_machine(self) -> bool:
        """This agent runs a standby machine (``--tm-role standby``): one standby per slot, no ranks."""
        return self.cfg.role == "standby"

    def _start_standby(self, method: str, slot: int | None = None) -> None:
        """Start one standby; on a standby machine in ``slot`` (its ``LOCAL_RANK``, the device it warms
        and serves on), beside an active node's ranks without one."""
        cfg = self.cfg
        member = _member_id("standby", self.node_label, self.standbys_started)
        self.standbys_started += 1
        env = self.agent.rank_env(slot or 0, self.port)
        env.pop("RANK")
        if slot is None:
            env.pop("LOCAL_RANK")
        else:
            env[ENV_SLOT] = str(slot)
            self.slots[member] = slot
        env[ENV_MEMBER_ID] = member
        env.update(self.hangs.env_for(member))
        args = list(cfg.script_args) + ["--tm-role", "standby"]
        output = cfg.logs.open(member, 0, self.agent.restarts)
        proc = None
        while method == "spawn" and proc is None and self.reserves:
            proc = activate(self.reserves.pop(0), -1, env, cfg.script, args, output)
            method = "pre-forked" if proc is not None else method
        if proc is None:
            start = fork_rank if method == "fork" else spawn_rank
            nice = self.refill_nice if self.space is not None else self.standby_nice  # the first: before etcd
            proc = start(-1, env, cfg.script, args, output, niceness=nice)
        self._watch_hangs(proc, member)
        self.standbys[member] = proc
        self.agent.log(f"started standby {member} (pid {proc.pid}, {method})")
        if self.space is not None:  # a refill (the first standbys start before etcd is opened)
            self._event("standby_started", {"member": member, "pid": proc.pid, "how": method, "node": cfg.node_rank})

    def _watch_hangs(self, proc: RankProcess, member: str) -> None:
        """Judge ``proc`` by the heartbeat file it was started with (``member``'s) once it serves a rank."""
        proc.heartbeat = member if self.hangs.enabled else ""

    def _event(self, what: str, detail: dict) -> None:
        """One line of the job's events timeline (``trainmover events``); etcd trouble is logged only."""
        from trainmover_ext.control.executor import record_event

        failed = record_event(self.space, what, detail)
        if failed is not None:
            self.agent.log(f"could not record event {what}: {failed}")

    def _fall_back(self, why: str) -> tuple[bool, int]:
        """Give up on live recovery: (False, 1) asks the agent for the classic stop-restart, which fails the
        job when no restart is left (``--max-restarts``); the log line says which."""
        agent = self.agent
        if agent.restarts < agent.config.max_restarts:
            agent.log(why + "; falling back to stop-restart")
        else:
            agent.log(
                f"{why}; the job fails: no stop-restart is left to fall back on (--max-restarts "
                f"{agent.config.max_restarts}). Keep more standbys, or allow restarts from the checkpoint"
            )
        self._event("stop_restart", {"node": self.cfg.node_rank, "reason": why})
        return False, 1

    def start(self) -> None:
        from trainmover_ext.launch import priority
        from trainmover_ext.launch.process import preimport_for_fork
        from trainmover_ext.netutil import free_port

        cfg = self.cfg
        restorable = priority.can_restore()
        self.standby_nice, self.refill_nice = (cfg.standby_nice, cfg.refill_nice) if restorable else (0, 0)
        if max(cfg.standby_nice, cfg.refill_nice) > 0 and not restorable:
            self.agent.log(
                "standbys keep normal CPU priority: a promoted one could not raise it back here (needs "
                "root, CAP_SYS_NICE or RLIMIT_NICE >= 20); see --tm-standby-nice"
            )
        self.port = cfg.master_port or free_port(cfg.master_addr)
        self.hangs = HangWatch(cfg.hang_timeout_s)
        self.stalls = StallWatch(cfg.progress_timeout_s if self.hangs.enabled else 0)
        preimport_for_fork(install_patches=True)
        if self.standby_machine:
            for slot in range(cfg.nproc_per_node):
                self._start_standby("fork", slot)
            self.agent.procs = list(self.standbys.values())
            self.agent.log(
                f"standby machine: {len(self.standbys)} standbys in slots 0..{cfg.nproc_per_node - 1}, pids "
                f"{[p.pid for p in self.standbys.values()]}"
            )
            self._connect()
            return
        for i in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + i
            member = _member_id("worker", self.node_label, i)
            env = self.agent.rank_env(i, self.port) | {ENV_MEMBER_ID: member} | self.hangs.env_for(member)
            proc = fork_rank(rank, env, cfg.script, cfg.script_args, cfg.logs.open(str(rank), i, self.agent.restarts))
            self._watch_hangs(proc, member)
            self.serving[rank] = (proc, member)
        for _ in range(cfg.standbys):
            self._start_standby("fork")
        # Last, so that no rank or standby holds a reserve's wake-up line.
        self.reserves = [
            fork_reserve(niceness=self.refill_nice) for _ in range(cfg.standby_reserves if cfg.standbys else 0)
        ]
        self.agent.procs = [p for p, _ in self.serving.values()] + list(self.standbys.values())
        self.agent.log(
            f"started {len(self.serving)} ranks, pids {[p.pid for p, _ in self.serving.values()]}, "
            f"and {len(self.standbys)} standby(s)"
        )
        self.recordings = serve_node_recordings(self.cfg, self.agent.log)  # after every fork, like /metrics
        self._connect()

    def _connect(self) -> None:
        """Open etcd only now: a gRPC channel must not be inherited by forked ranks."""
        from trainmover_ext.control.controller import Controller, ControllerConfig
        from trainmover_ext.control.membership import Membership, PlanInbox
        from trainmover_ext.control.records import MemberRecord
        from trainmover_ext.launch.identity import Identity, node_name, open_space

        plan = self.cfg.rendezvous
        os.environ.update(plan.env(0))
        ident = Identity(
            member_id=_member_id("agent", self.node_label, 0),
            job=plan.job,
            token=plan.token or "",
            host=node_name(),
            pid=os.getpid(),
        )
        self.space = open_space(ident)
        ttl = max(1, round(self.cfg.lease_ttl_s))
        # An agent serves no rank itself: a lease it lost to a stall is registered again (its node looks
        # lost to the controller meanwhile, see decide's node loss), not a reason to stop.
        self.member = Membership(
            self.space,
            MemberRecord(member_id=ident.member_id, kind="agent", host=ident.host, pid=ident.pid),
            ttl_s=ttl,
            rejoin_on_loss=True,
        ).register()
        self.agent_id = ident.member_id
        from trainmover_ext.control.records import NodeRecord

        # Kept without a lease: once the agent's member key is gone, the controller knows this node is lost.
        node = NodeRecord(
            host=ident.host,
            agent=ident.member_id,
            role="standby" if self.standby_machine else "active",
            slots=self.cfg.nproc_per_node,
            registered_at=time.time(),
            recordings_url=self.recordings.url if self.recordings is not None else "",
        )
        self.space.put(self.space.key("nodes", ident.host), node.to_bytes())
        from trainmover_ext.control.probes import ProbeResponder

        # The controller asks whether this node lives when a peer suspects one of its ranks.
        self.probes = ProbeResponder(self.space, host=ident.host, agent_id=ident.member_id).start()
        self.controller = Controller(
            self.space,
            ControllerConfig(controller_id=ident.member_id, ttl_s=ttl, preferred=self.standby_machine),
            metrics=self.agent.metrics,
        ).start()
        if self.agent.metrics_feed is not None:
            controller = self.controller
            self.agent.metrics_feed.attach(self.space, is_leader=lambda: controller.is_leader)
        self.inbox = PlanInbox(self.space)
        from trainmover_ext.launch.node_reports import NodeReports

        self.reports = NodeReports.open(self.space, ident.host, self.cfg, ident.member_id, self.agent.log)
        from trainmover_ext.control.archive import RunArchive

        controller = self.controller
        self.archive = RunArchive(self.agent.run_dir()).start(self.space, lambda: controller.is_leader)
        for member, proc in self.standbys.items():  # started before etcd was opened
            self._event(
                "standby_started", {"member": member, "pid": proc.pid, "how": "fork", "node": self.cfg.node_rank}
            )

    def close(self) -> None:
        reserves, self.reserves = self.reserves, []
        for reserve in reserves:
            discard(reserve)
        if self.agent.metrics_feed is not None:
            # Before the controller resigns: a stopping agent keeps exporting its last job-wide figures
            # (migrations, members) instead of clearing them as an agent that lost the lead would.
            self.agent.metrics_feed.detach()
        objs = (self.probes, self.archive, self.inbox, self.controller, self.member, self.recordings, self.hangs)
        for obj in (*objs, self.reports):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # noqa: BLE001 - teardown must go on
                    self.agent.log(f"teardown: {exc}")

    # -- supervision ----------------------------------------------------------------
    def _apply_plans(self) -> str | None:
        plans = self.inbox.take()
        for plan in plans:
            self.epoch = max(self.epoch, plan.epoch)
            if plan.epoch not in self.placed:  # a plan is delivered again with every step marked on it
                self.placed.add(plan.epoch)
                for note in plan.placement:
                    self.agent.log(f"epoch {plan.epoch} ({plan.reason}): {note}")
            if plan.unserved:
                return f"epoch {plan.epoch}: no warm standby left for rank(s) {plan.unserved}"
            for rep in plan.replacement_list():
                gone = self.leaving.get(rep.rank)
                if gone is not None and gone[1] == rep.leaver and plan.reason == "failure":
                    # A planned leaver lost before its hand-over: fence it if it hangs.
                    if gone[0].poll() is None:
                        gone[0].signal(signal.SIGKILL)
                    self.retired.append(gone[0])
                    del self.leaving[rep.rank]
                old = self.serving.get(rep.rank)
                if plan.reason == "planned":
                    self.planned_leavers.add(rep.leaver)
                if (
                    plan.reason == "failure"
                    and rep.leaver in self.planned_leavers
                    and old is not None
                    and old[1] == rep.joiner
                    and plan.epoch not in self.kept_joiner
                ):
                    self.kept_joiner.add(plan.epoch)
                    self.agent.log(
                        f"epoch {plan.epoch} (failure): rank {rep.rank}'s planned leaver {rep.leaver} was "
                        f"lost before its hand-over; {rep.joiner} keeps the rank, state from "
                        f"{rep.state_source.get('kind')}"
                    )
                    continue
                rejoined = False
                if old is not None and old[1] == rep.leaver:
                    # The leaver is ours: retire it, whoever serves the rank from now on.
                    if plan.reason == "failure" and old[0].poll() is None:
                        # Fence a member declared dead while alive (hung): it must never touch the job again.
                        old[0].signal(signal.SIGKILL)
                    if plan.reason == "planned" and self.cfg.leaver_becomes_standby and not self._slow(old[0].pid):
                        standby = leaver_standby_id(rep.leaver, plan.epoch)
                        self.standbys[standby] = old[0]
                        rejoined = True
                        self.agent.log(
                            f"epoch {plan.epoch} (planned): the leaver of rank {rep.rank} (pid "
                            f"{old[0].pid}) rejoins the pool as {standby}"
                        )
                        self._event(
                            "standby_rejoined",
                            {"member": standby, "pid": old[0].pid, "rank": rep.rank, "epoch": plan.epoch},
                        )
                    elif plan.reason == "planned":
                        self.leaving[rep.rank] = old
                    else:
                        self.retired.append(old[0])
                    del self.serving[rep.rank]
                    self.reported.pop(rep.rank, None)
                proc = self.standbys.pop(rep.joiner, None)
                if proc is None:
                    if old is not None and old[1] == rep.leaver:
                        self.agent.log(
                            f"epoch {plan.epoch} ({plan.reason}): rank {rep.rank} -> {rep.joiner} on another node"
                        )
                    continue
                self.serving[rep.rank] = (proc, rep.joiner)
                self.agent.log(
                    f"epoch {plan.epoch} ({plan.reason}): rank {rep.rank} -> {rep.joiner} "
                    f"(pid {proc.pid}); state from {rep.state_source.get('kind')}"
                )
                # Keep the pool at --tm-standbys, once this migration is over (see the module doc),
                # unless the leaver already refilled it. A standby machine's slot now serves a rank.
                self.slots.pop(rep.joiner, None)
                if not rejoined and not self.standby_machine:
                    self.replenish.append((plan.epoch, time.time() + REPLENISH_AFTER_S))
        return None

    def _replenish(self, now_too: bool = False) -> None:
        """Start the refills that are due: their epoch settled (its first iteration ran: its joiners no
        longer need the cores), ``REPLENISH_AFTER_S`` passed, or ``now_too`` (a rank was lost with none of
        this node's standbys idle: the pool is needed now, not the cores)."""
        latest = self.inbox.snapshot()
        due = [
            (e, t)
            for e, t in self.replenish
            if now_too or (e in latest and "first_iteration" in latest[e].steps) or time.time() > t
        ]
        if now_too and due:
            self.agent.log(f"a rank was lost and no standby of this node is idle: refilling the pool now ({len(due)})")
        for entry in due:
            self.replenish.remove(entry)
            self._start_standby("spawn")

    def _job_finished(self) -> bool:
        """Whether every rank of the job wrote ``finished/<r>`` (read when this agent serves none)."""
        try:
            entries = self.space.kv.get_prefix(self.space.key("finished") + "/").entries
        except Exception as exc:  # noqa: BLE001 - etcd trouble: keep supervising, ask again later
            self.agent.log(f"could not read the job's progress: {exc}")
            return False
        return len(entries) >= self.cfg.nnodes * self.cfg.nproc_per_node

    def _report(self, rank: int, member: str, code: int, *, track: bool = True, hung: str = "") -> None:
        """Report ``member``'s exit, or with ``hung`` (what was seen) its hang; ``track``: expect a plan for
        the rank within the deadline (a planned leaver's report is moot once its hand-over is done, so it
        is not tracked)."""
        from trainmover_ext.control.supervise import report_exit, report_hang

        if time.time() < self.report_retry.get(rank, 0.0):
            return
        what = f"hang ({hung})" if hung else f"exit (code {code})"
        if rank not in self.report_retry:  # once per failure, not per retry
            proc = self.serving.get(rank, (None, ""))[0] or self.leaving.get(rank, (None, ""))[0]
            self.agent.record_failure(
                rank,
                code,
                pid=proc.pid if proc is not None else None,
                member=member,
                note=f"hung: {hung}" if hung else "",
            )
        try:
            if hung:
                report_hang(self.space, rank=rank, member_id=member, reporter=self.agent_id, why=hung, epoch=self.epoch)
            else:
                report_exit(
                    self.space, rank=rank, member_id=member, reporter=self.agent_id, code=code, epoch=self.epoch
                )
        except StoreError as exc:  # etcd unreachable: report again in a second (the lease is the fallback)
            self.report_retry[rank] = time.time() + 1.0
            self.agent.log(f"could not report rank {rank}'s {what}: {exc}; trying again")
            return
        self.report_retry.pop(rank, None)
        if track:
            self.reported[rank] = time.time()
        if hung:
            self.agent.log(f"rank {rank} ({member}) hung: {hung}; killed it and reported to the controller")
        else:
            self.agent.log(f"rank {rank} ({member}) exited with code {code}; reported to the controller")
        if track and not self.standbys:  # e.g. the joiner promoted into it died before its epoch settled
            self._replenish(now_too=True)

    def _fence_hung(self) -> None:
        """Kill and report every serving process and planned leaver that froze (``launch.heartbeat``), and
        every serving process whose main thread stalled outside a collective (``launch.stalls``): its
        rank is then replaced like a killed one's, without waiting a lease TTL. A serving process's report
        that etcd refused is made again as the exit of the killed process; a leaver's, like its exit's, is
        made once (its lease is the fallback)."""
        watched = {
            proc.heartbeat: (rank, proc, member, False)
            for rank, (proc, member) in self.serving.items()
            if proc.heartbeat and rank not in self.reported and proc.poll() is None
        }
        watched |= {
            proc.heartbeat: (rank, proc, member, True)
            for rank, (proc, member) in self.leaving.items()
            if proc.heartbeat and proc.poll() is None
        }
        found = self.hangs.hung({key: proc.pid for key, (_, proc, _, _) in watched.items()})
        frozen = {key for key, _ in found}
        found += self.stalls.stalled(
            {
                key: (proc.pid, rank, self.hangs.file_for(key))
                for key, (rank, proc, _, leaver) in watched.items()
                if not leaver and key not in frozen
            }
        )
        for key, why in found:
            rank, proc, member, leaver = watched[key]
            self.stalls.forget(key)
            proc.signal(signal.SIGKILL)  # fenced first: it must never touch the job again
            if leaver:  # its exit is reported here, as hung, not again by the leavers' watch
                del self.leaving[rank]
                self.retired.append(proc)
            self._report(rank, member, -signal.SIGKILL, track=not leaver, hung=why)

    def _slow(self, pid: int) -> bool:
        """Whether our process ``pid`` is quarantined as a straggler: as a leaver it exits instead of rejoining
        the pool (the worker checks the same), and a fresh standby refills the pool."""
        from trainmover_ext.control.straggler_watch import is_quarantined

        return self.space is not None and is_quarantined(self.space, self.member.record.host, pid)

    def _report_node(self) -> None:
        """Compute times and GPU health for the straggler watch (``launch.node_reports``)."""
        if self.reports is not None:
            serving = [(r, p) for r, (p, _) in self.serving.items() if p.heartbeat and p.poll() is None]
            files = {r: self.hangs.file_for(p.heartbeat) for r, p in serving}
            self.reports.tick(files, self.agent.metrics)

    def supervise(self) -> tuple[bool, int]:
        """Block until done. Returns (finished_ok, exit code); (False, code) asks for the classic fallback."""
        timeouts = RecoveryTimeouts(self.cfg.lease_ttl_s)
        while True:
            if self.agent.stop_signal is not None:
                return False, 128 + self.agent.stop_signal
            why = self._apply_plans()
            self._replenish()
            self.member.check()  # registers again after a lost lease (rejoin_on_loss)
            if why:
                return self._fall_back(why)
            codes = {rank: (p.poll(), member) for rank, (p, member) in self.serving.items()}
            for rank, (code, member) in codes.items():
                if code not in (None, 0) and rank not in self.reported:
                    self._report(rank, member, code)
            self._fence_hung()
            self._report_node()
            for rank, (proc, member) in list(self.leaving.items()):
                code = proc.poll()
                if code is not None:
                    del self.leaving[rank]
                    self.retired.append(proc)
                    if code != 0:
                        self._report(rank, member, code, track=False)
            # An idle standby of this node is warming (once warm, it is named): wait as long as the ranks do.
            deadline_s = timeouts.decision_s if self.standbys else timeouts.replacement_s
            for rank, t in self.reported.items():
                if time.time() - t > deadline_s:
                    return self._fall_back(f"no replacement for rank {rank} within {deadline_s:.0f}s")
            for member, proc in list(self.standbys.items()):
                if proc.poll() is not None:
                    del self.standbys[member]
                    if proc.returncode == STANDBY_REFUSED_EXIT_CODE:
                        self.agent.log(
                            f"standby {member} was refused by the job (exit {proc.returncode}): "
                            f"{why_refused(self.space, member)}; not restarting it (start standbys with the "
                            "job's flags)"
                        )
                        continue
                    self.standby_failures = self.standby_failures + 1 if proc.returncode != 0 else 0
                    if self.standby_failures >= MAX_STANDBY_FAILURES:
                        self.agent.log(
                            f"standby {member} exited ({proc.returncode}); {self.standby_failures} "
                            "standbys in a row failed, so no more are started: see the standby's "
                            "error above (e.g. a ConfigMismatch) and fix its flags"
                        )
                        continue
                    self.agent.log(f"standby {member} exited ({proc.returncode}); starting another")
                    self._event("standby_exited", {"member": member, "code": proc.returncode, "replaced": True})
                    self._start_standby("spawn", self.slots.pop(member, None))
            self.agent.procs = (
                [p for p, _ in self.serving.values()]
                + list(self.standbys.values())
                + [p for p, _ in self.leaving.values()]
                + [p for p in self.retired if p.poll() is None]
            )
            # An agent whose ranks all moved to other nodes keeps its standbys (and its controller
            # candidacy) until the whole job is done.
            mine_done = all(code == 0 for code, _ in codes.values()) and (bool(codes) or self._job_finished())
            if mine_done and not self.leaving and all(p.poll() is not None for p in self.retired):
                for proc in self.standbys.values():
                    proc.signal(signal.SIGTERM)
                return True, 0
            wait_any_exit([p for p in self.agent.procs if p.returncode is None], self.cfg.monitor_interval_s)
