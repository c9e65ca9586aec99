"""``trainmover status | events | migrate | controller``: look at and steer a running job's control plane.

Each subcommand finds the job through ``--tm-etcd-endpoints``, ``--tm-job`` and
``--tm-job-token`` (or ``TRAINMOVER_ETCD_ENDPOINTS`` / ``TRAINMOVER_JOB`` /
``TRAINMOVER_JOB_TOKEN``), plus the TLS and auth flags of the etcd cluster.
Errors are :class:`TrainMoverError` with a message saying what to do; the
top-level CLI prints them and exits 2.

Example::

    trainmover status --tm-etcd-endpoints 127.0.0.1:2379 --tm-job llama --tm-job-token $TOKEN
    trainmover migrate --rank 3 --to standby-n7-1234-ab12cd
    trainmover controller --tm-job llama --tm-job-token $TOKEN   # one more candidate, e.g. on a service node
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from trainmover_ext.control.drain import rejection
from trainmover_ext.control.membership import request_migration
from trainmover_ext.control.placement import warm_standbys
from trainmover_ext.control.records import Event
from trainmover_ext.control.view import View, read_view
from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, MalformedValue
from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
from trainmover_ext.kv.job import JobSpace, job_login


def add_connection_flags(p: argparse.ArgumentParser, *, call_timeout: bool = True) -> None:
    """The flags that locate a job in etcd (shared with other subcommands that need it). ``call_timeout``
    adds ``--tm-etcd-timeout`` (not on ``launch``, whose etcd calls follow the job's lease TTL)."""
    g = p.add_argument_group("job and etcd")
    g.add_argument(
        "--tm-etcd-endpoints",
        default=os.environ.get("TRAINMOVER_ETCD_ENDPOINTS"),
        help="comma-separated etcd host:port list (env TRAINMOVER_ETCD_ENDPOINTS); "
        "`trainmover launch` prints it when it starts an embedded etcd",
    )
    g.add_argument(
        "--tm-job",
        default=os.environ.get("TRAINMOVER_JOB"),
        help="job name, the <job> in /trainmover/<job>/ (env TRAINMOVER_JOB)",
    )
    g.add_argument(
        "--tm-job-token",
        default=os.environ.get("TRAINMOVER_JOB_TOKEN"),
        help="the job token printed by `trainmover launch` (env TRAINMOVER_JOB_TOKEN)",
    )
    g.add_argument(
        "--tm-etcd-ca",
        default=os.environ.get("TRAINMOVER_ETCD_CA"),
        help="CA certificate of the etcd servers; enables TLS (env TRAINMOVER_ETCD_CA)",
    )
    g.add_argument(
        "--tm-etcd-cert",
        default=os.environ.get("TRAINMOVER_ETCD_CERT"),
        help="client certificate for etcd --client-cert-auth (env TRAINMOVER_ETCD_CERT)",
    )
    g.add_argument(
        "--tm-etcd-key",
        default=os.environ.get("TRAINMOVER_ETCD_KEY"),
        help="private key of --tm-etcd-cert (env TRAINMOVER_ETCD_KEY)",
    )
    g.add_argument(
        "--tm-etcd-user",
        default=os.environ.get("TRAINMOVER_ETCD_USER"),
        help="etcd user for password auth (env TRAINMOVER_ETCD_USER)",
    )
    g.add_argument(
        "--tm-etcd-password",
        default=os.environ.get("TRAINMOVER_ETCD_PASSWORD"),
        help="password of --tm-etcd-user (env TRAINMOVER_ETCD_PASSWORD)",
    )
    if not call_timeout:
        return
    g.add_argument(
        "--tm-etcd-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for etcd on each call before giving up (default 5)",
    )


def client_config(args: argparse.Namespace) -> EtcdClientConfig:
    """An :class:`EtcdClientConfig` from the connection flags."""
    if not args.tm_etcd_endpoints:
        raise ConfigError("no etcd endpoints: pass --tm-etcd-endpoints host:port or set TRAINMOVER_ETCD_ENDPOINTS")
    config = EtcdClientConfig(
        endpoints=args.tm_etcd_endpoints,
        ca_cert=args.tm_etcd_ca,
        client_cert=args.tm_etcd_cert,
        client_key=args.tm_etcd_key,
        user=args.tm_etcd_user,
        password=args.tm_etcd_password,
        timeout_s=args.tm_etcd_timeout,
        connect_timeout_s=args.tm_etcd_timeout,
    )
    if getattr(args, "tm_job", None):  # the job's own etcd user (see kv.job.job_login)
        return job_login(config, args.tm_job, getattr(args, "tm_job_token", None))
    return config


def open_job(args: argparse.Namespace) -> JobSpace:
    """Connect and authenticate to the job named by the flags."""
    if not args.tm_job:
        raise ConfigError("no job given: pass --tm-job NAME or set TRAINMOVER_JOB")
    cfg = client_config(args)
    return JobSpace.open(EtcdKV(cfg), args.tm_job, args.tm_job_token)


def _ts(t: float | None) -> str:
    return "-" if t is None else _dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells)


def format_status(view: View, job: str) -> str:
    """The ``trainmover status`` report (a pure function of the view, so tests can check it)."""
    out = [
        f"job {job}   epoch {view.epoch if view.epoch is not None else '?'}   "
        f"controller {view.leader or '(none elected)'}   etcd revision {view.revision}",
        "",
    ]
    rows = []
    for r, rec in sorted(view.ranks.items()):
        state = "alive" if rec.member_id in view.members else "LOST"
        if any(rep.rank == r and rep.member_id == rec.member_id for rep in view.reports.values()):
            state = "REPORTED"
        rows.append([r, rec.member_id, rec.role, rec.host or "-", rec.since_epoch, state])
    out.append(
        _table(["rank", "member", "stage role", "host", "since epoch", "state"], rows)
        if rows
        else "no ranks assigned yet"
    )
    serving = {rec.member_id for rec in view.ranks.values()}
    standbys = [m for m in view.members.values() if m.kind == "standby" and m.member_id not in serving]
    if view.nodes:
        out += ["", "machines:"]
        out.append(
            _table(
                ["host", "role", "slots", "agent", "ranks", "idle standbys"],
                [
                    [
                        host,
                        node.role,
                        node.slots,
                        "alive" if node.agent in view.members else "LOST",
                        sum(rec.host == host for rec in view.ranks.values()),
                        sum(m.host == host for m in standbys),
                    ]
                    for host, node in sorted(view.nodes.items())
                ],
            )
        )
    out += ["", "standbys:"]
    out.append(
        _table(
            ["member", "host", "slot", "warm roles", "health", "kept model"],
            [
                [
                    m.member_id,
                    m.host,
                    "-" if m.slot is None else m.slot,
                    (",".join(m.warm_roles) + (" (warming)" if m.warming else "")) or "(starting)",
                    m.health,
                    "-" if m.kept_rank is None else f"rank {m.kept_rank}",
                ]
                for m in sorted(standbys, key=lambda m: m.member_id)
            ],
        )
        if standbys
        else "  none"
    )
    plan = view.last_plan
    out += ["", "last migration:"]
    if plan is None:
        out.append("  none")
    else:
        out.append(
            f"  epoch {plan.epoch} ({plan.reason}, {plan.status}) decided by {plan.decided_by or '?'}; "
            "resume iteration "
            f"{plan.resume_iteration if plan.resume_iteration is not None else 'at next boundary'}"
        )
        for rep in plan.replacement_list():
            src = rep.state_source
            src_names: dict[str | None, str] = {
                "replica": f"replica rank {src.get('rank')}",
                "checkpoint": f"checkpoint (iteration {src.get('iteration')})",
                "leaver": "the leaver",
            }
            src_s = src_names.get(src.get("kind"), str(src))
            out.append(f"  rank {rep.rank}: {rep.leaver} -> {rep.joiner} ({rep.role}), state from {src_s}")
        out += [f"  placement: {note}" for note in plan.placement]
        if plan.unserved:
            out.append(f"  unserved ranks (no standby): {plan.unserved}")
        t0 = min(plan.steps.values()) if plan.steps else None
        for step, t in sorted(plan.steps.items(), key=lambda kv: kv[1]):
            assert t0 is not None  # steps is not empty here
            out.append(f"    {step:<12} {_ts(t)}  +{(t - t0) * 1000:.1f} ms")
    out += format_policies(view)
    for a in view.alerts.values():
        out.append(f"ALERT rank {a.rank}: {a.reason}")
    for key, msg in view.malformed.items():
        out.append(f"WARNING unreadable key {key}: {msg}")
    return "\n".join(out)


def format_policies(view: View) -> list[str]:
    """The ``stragglers:`` section of ``trainmover status`` (the policy, each rank flagged, the quarantine) and
    the rebalancing schedule."""
    policy, schedule = view.straggler_policy, view.rebalance_policy
    out = []
    if schedule is not None and schedule.interval_s > 0:
        last = f"; last move asked at {_ts(schedule.last_at)}" if schedule.last_at else ""
        out += ["", f"rebalancing: a planned move every {schedule.interval_s / 60:g} min{last}"]
    if policy is None and not view.stragglers and not view.quarantine and not view.slow_links:
        return out
    out += ["", "stragglers:"]
    if policy is not None:
        out.append(
            f"  policy: {policy.action}, threshold {policy.threshold:g}x its peers' median for {policy.window} "
            f"iterations (set by {policy.set_by or '?'})"
        )
    for st in sorted(view.stragglers.values(), key=lambda st: st.rank):
        moved = f"; move requested ({st.request})" if st.request else ""
        out.append(
            f"  rank {st.rank}: {st.member_id} on {st.host} slot {st.slot} at {st.ratio:g}x its peers at iteration "
            f"{st.iteration} ({_ts(st.flagged_at)}){moved}"
        )
    for link in sorted(view.slow_links, key=lambda link: link.ranks):
        (a, b), (ha, hb) = link.ranks, link.hosts
        out.append(
            f"  SLOW LINK rank {a} ({ha}) <-> rank {b} ({hb}): waited {link.ratio:g}x its peers' median on each other "
            f"at iteration {link.iteration} ({_ts(link.flagged_at)}); check the network path between them"
        )
    for q in sorted(view.quarantine, key=lambda q: (q.host, q.slot)):
        out.append(
            f"  QUARANTINED {q.host} slot {q.slot} since {_ts(q.since)}: {q.reason} "
            f"(`trainmover quarantine --clear {q.host}:{q.slot}` lets standbys there be promoted again)"
        )
    return out


def cmd_status(args: argparse.Namespace) -> int:
    space = open_job(args)
    try:
        view = read_view(space)
    finally:
        space.kv.close()
    if args.finished:
        return 0 if job_done(view) else 1
    print(format_status(view, space.job))
    return 0


def _archived_events(args: argparse.Namespace) -> int:
    """``trainmover events --run-dir D``: the copy the leading agent kept (no etcd needed)."""
    from trainmover_ext.control.archive import EVENTS_FILE, read_jsonl

    path = os.path.join(args.run_dir, EVENTS_FILE)
    if not os.path.exists(path):
        raise ConfigError(
            f"{path} does not exist: give the job's --run-dir (the launcher prints it), or query the "
            "live job with --tm-etcd-endpoints/--tm-job/--tm-job-token"
        )
    records = list(read_jsonl(path))
    rows = [
        [
            _ts(r.get("time", 0)),
            r.get("what", "?"),
            " ".join(f"{k}={v}" for k, v in sorted((r.get("detail") or {}).items())),
        ]
        for r in (records[-args.limit :] if args.limit else records)
    ]
    print(_table(["time", "event", "detail"], rows) if rows else "no events yet")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    if args.run_dir:
        return _archived_events(args)
    space = open_job(args)
    try:
        entries = space.kv.get_prefix(space.events_prefix).entries
        rows = []
        for e in entries[-args.limit :] if args.limit else entries:
            try:
                ev = Event.from_bytes(e.value, key=e.key)
                rows.append([_ts(ev.time), ev.what, " ".join(f"{k}={v}" for k, v in sorted(ev.detail.items()))])
            except MalformedValue as exc:
                rows.append(["?", "unreadable", str(exc)])
        print(_table(["time", "event", "detail"], rows) if rows else "no events yet")
    finally:
        space.kv.close()
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.rank < 0:
        raise ConfigError("--rank must be a logical rank id >= 0 (see `trainmover status`)")
    space = open_job(args)
    try:
        if space.kv.get(space.key("ranks", args.rank)) is None:
            raise ConfigError(f"job {space.job!r} has no rank {args.rank}: see `trainmover status` for the ranks")
        view = read_view(space)
        if args.to is not None:
            _check_target(view, space.job, args.rank, args.to)
        epoch = view.epoch or 0
        rid = request_migration(space, rank=args.rank, to=args.to, requested_by=f"cli@{os.uname().nodename}")
        print(
            f"requested planned migration {rid}: rank {args.rank} -> {args.to or 'a standby chosen by the controller'}",
            flush=True,
        )
        if args.wait <= 0:
            print("not waiting for the decision (--wait 0): follow it with `trainmover status` or `trainmover events`")
            return 0
        return _await_decision(space, rid, args.rank, epoch, args.wait)
    finally:
        space.kv.close()


def _check_target(view: View, job: str, rank: int, to: str) -> None:
    """Refuse ``--to`` before any request is written unless it names a standby the controller would take
    for ``rank``: idle, healthy and warm for the rank's stage role (:func:`warm_standbys`)."""
    rec = view.ranks.get(rank)
    role = rec.role if rec is not None else None
    warm = warm_standbys(view, role)
    if to in warm:
        return
    which = f"for rank {rank} (stage role {role!r})" if role is not None else "of any stage role"
    listed = f"the warm standbys {which} are: {', '.join(warm)}" if warm else f"job {job!r} has no warm standby {which}"
    raise ConfigError(
        f"--to {to} is not an idle warm standby of job {job!r}; {listed}. Pick one of them, leave --to out to "
        "let the controller choose, or start a standby (`trainmover launch --tm-role standby`) and wait "
        "until `trainmover status` shows it warm"
    )


def _await_decision(space: JobSpace, request_id: str, rank: int, epoch: int, wait_s: float) -> int:
    """0 once the controller planned the move, 1 with its reason when it rejected it, 3 on no decision."""
    deadline = Deadline(wait_s)
    key = space.key("requests", request_id)
    while not deadline.expired:
        if space.kv.get(key) is None:  # the controller settled it: planned or rejected
            reason = rejection(space, request_id)
            if reason is not None:
                print(f"trainmover migrate: the controller rejected the move: {reason}", file=sys.stderr)
                return 1
            view = read_view(space)
            plan = view.last_plan
            if plan is not None and plan.epoch > epoch and plan.reason == "planned":
                rep = plan.replacement_list()[0]
                print(
                    f"planned: epoch {plan.epoch}, rank {rep.rank} -> {rep.joiner}; follow it with "
                    "`trainmover status` or `trainmover events`"
                )
                return 0
        time.sleep(0.1)
    print(
        f"trainmover migrate: no decision within {wait_s:.0f}s: is a controller running (an agent, or "
        "`trainmover controller`)? The request stays queued; see `trainmover status`",
        file=sys.stderr,
    )
    return 3


def job_done(view: View) -> bool:
    """Whether every rank the job assigned has written ``finished/<r>``."""
    return bool(view.ranks) and set(view.ranks) <= view.finished


def cmd_controller(args: argparse.Namespace) -> int:
    """One more controller candidate for the job, outside any agent.

    Every agent already runs one; extra candidates on nodes that host no rank (a Slurm batch
    host, a service node) keep the job's control plane up when agents die with their nodes.
    It registers the job if it is the first to arrive (with the same token every agent uses),
    stands for election, and when leading decides exactly as an agent's controller does. It
    exits 0 when every rank of the job has finished, or on SIGTERM / SIGINT (resigning, so a
    successor is elected at once)."""
    from trainmover_ext.control.controller import Controller, ControllerConfig

    if args.tm_lease_ttl < 1:
        raise ConfigError("--tm-lease-ttl must be at least 1 second")
    if not args.tm_job or not args.tm_job_token:
        raise ConfigError(
            "a controller needs the job and its token: pass --tm-job NAME and --tm-job-token TOKEN "
            "(the same ones the launchers use)"
        )
    cid = args.id or f"controller-{os.uname().nodename}-{os.getpid()}"
    kv = EtcdKV(client_config(args))
    stop = threading.Event()
    ctl = None
    try:
        space = JobSpace.create(kv, args.tm_job, args.tm_job_token)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        ctl = Controller(space, ControllerConfig(controller_id=cid, ttl_s=round(args.tm_lease_ttl))).start()
        print(
            f"[trainmover] controller {cid} stands for job {space.job}; Ctrl-C (SIGTERM) resigns and exits", flush=True
        )
        leading, next_check = False, time.monotonic() + args.tm_lease_ttl
        while not stop.wait(0.2):
            if ctl.is_leader != leading:
                leading = ctl.is_leader
                print(f"[trainmover] controller {cid} {'leads' if leading else 'follows'}", flush=True)
            if time.monotonic() >= next_check:  # the job's progress, once per lease TTL
                next_check = time.monotonic() + args.tm_lease_ttl
                if job_done(read_view(space)):
                    print(f"[trainmover] job {space.job} finished; controller {cid} exits", flush=True)
                    break
    finally:
        if ctl is not None:
            ctl.close()
        kv.close()
    return 0


def _sub(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_: str,
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_, description=help_)
    add_connection_flags(p)
    p.set_defaults(func=func)
    return p


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``status``, ``events`` and ``migrate``; returns the ``status`` parser."""
    status = _sub(
        subparsers, "status", "show ranks -> members, standbys, epoch and the last migration of a job", cmd_status
    )
    status.add_argument(
        "--finished",
        action="store_true",
        help="print nothing; exit 0 when every rank of the job has finished training, 1 when not (e.g. for a "
        "batch script whose node agent was lost although a standby finished that node's ranks)",
    )
    events = _sub(subparsers, "events", "show the timeline of membership and migration events of a job", cmd_events)
    events.add_argument("--limit", type=int, default=0, help="show only the last N events (default: all)")
    events.add_argument(
        "--run-dir",
        default=None,
        help="read the events the leading agent copied to RUN_DIR/events.jsonl instead of etcd "
        "(they outlive the job's etcd)",
    )
    migrate = _sub(subparsers, "migrate", "request a planned migration of one rank to a warm standby", cmd_migrate)
    migrate.add_argument("--rank", type=int, required=True, help="the logical rank to move (see `trainmover status`)")
    migrate.add_argument(
        "--to",
        default=None,
        metavar="MEMBER_ID",
        help="the standby to move the rank to: the member id of an idle, healthy standby that has "
        "warmed the rank's stage role (`trainmover status` lists them under 'standbys'); any "
        "other id is refused before a request is written (default: the controller picks one)",
    )
    migrate.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the controller's decision: exit 0 once the move is planned, 1 when "
        "the controller rejected it (the reason is printed), 3 when nothing was decided in time "
        "(the request stays queued). Default 60; 0 returns as soon as the request is written",
    )
    from trainmover_ext.control import drain

    drain.add_arguments(
        _sub(
            subparsers,
            "drain",
            "move every rank of a node to a standby machine in one planned migration, then report the node free",
            drain.cmd_drain,
        )
    )
    from trainmover_ext.control import policy_cli

    policy_cli.add_arguments(
        _sub(
            subparsers,
            "straggler",
            "show or change the job's straggler policy while it runs (what the controller does with a rank "
            "slower than its peers)",
            policy_cli.cmd_straggler,
        )
    )
    policy_cli.add_quarantine_arguments(
        _sub(
            subparsers,
            "quarantine",
            "list the slots quarantined as slow, or clear them so that standbys there may be promoted again",
            policy_cli.cmd_quarantine,
        )
    )
    policy_cli.add_rebalance_arguments(
        _sub(
            subparsers,
            "rebalance",
            "show or set the job's rebalancing schedule (planned moves that rotate members through the standby "
            "pool), or ask for one move now",
            policy_cli.cmd_rebalance,
        )
    )
    controller = _sub(
        subparsers,
        "controller",
        "run one more leader-elected controller candidate for a job (e.g. on a "
        "node without ranks); it exits when the job has finished",
        cmd_controller,
    )
    controller.add_argument(
        "--id",
        default=None,
        help="this candidate's id, shown as the job's controller (default: controller-<host>-<pid>)",
    )
    controller.add_argument(
        "--tm-lease-ttl",
        type=float,
        default=2.0,
        help="leader lease TTL in seconds, as the job's --tm-lease-ttl: a successor takes over "
        "within about this long after this process dies (default 2)",
    )
    return status
