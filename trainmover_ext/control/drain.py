"""``trainmover drain --node N``: move every rank of a node to a standby machine in one planned epoch.

Contract:
- The request (``requests/<id>`` with ``node``) is written only when the node serves a rank;
  otherwise the command fails at once and names the nodes that do.
- The controller plans one two-phase planned migration of all the node's ranks, each leaver
  the state source of its rank, onto one standby machine (each rank in its own local rank's
  slot where it can), or rejects the request when no machine has that many idle warm standbys
  (:func:`trainmover_ext.control.decide.decide`).
- The command waits (``--wait`` seconds) until every leaver handed its state over and then says
  the node is free. Exit codes: 0 free, 1 rejected (the reason is printed), 3 nothing decided or
  not done in time (the request or the move goes on; follow it with ``trainmover status``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from trainmover_ext.control.membership import request_migration
from trainmover_ext.control.records import Event, MigrationPlan
from trainmover_ext.control.view import read_view
from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, MalformedValue
from trainmover_ext.kv.job import JobSpace

POLL_S = 0.1


def cmd_drain(args: argparse.Namespace) -> int:
    from trainmover_ext.control.cli import open_job

    space = open_job(args)
    try:
        view = read_view(space)
        hosts = sorted({rec.host for r, rec in view.ranks.items() if r not in view.finished})
        if args.node not in hosts:
            raise ConfigError(
                f"node {args.node!r} serves no rank of job {space.job!r}; the nodes that do: "
                f"{', '.join(hosts) or 'none'} (see `trainmover status`)"
            )
        epoch = view.epoch or 0
        ranks = sorted(r for r, rec in view.ranks.items() if rec.host == args.node and r not in view.finished)
        rid = request_migration(space, rank=-1, node=args.node, requested_by=f"cli@{os.uname().nodename}")
        print(f"requested drain {rid} of node {args.node} (ranks {ranks})", flush=True)
        if args.wait <= 0:
            print("not waiting (--wait 0): follow it with `trainmover status` or `trainmover events`")
            return 0
        return _await_drain(space, rid, args.node, epoch, args.wait)
    finally:
        space.kv.close()


def rejection(space: JobSpace, request_id: str) -> str | None:
    """The controller's reason, when it rejected request ``request_id`` (from the events timeline)."""
    for entry in reversed(space.kv.get_prefix(space.events_prefix).entries):
        try:
            ev = Event.from_bytes(entry.value, key=entry.key)
        except MalformedValue:
            continue
        if ev.what == "request_rejected" and ev.detail.get("request") == request_id:
            return str(ev.detail.get("reason"))
    return None


def _await_drain(space: JobSpace, request_id: str, node: str, epoch: int, wait_s: float) -> int:
    deadline = Deadline(wait_s)
    key = space.key("requests", request_id)
    plan: MigrationPlan | None = None
    while not deadline.expired:
        if plan is None and space.kv.get(key) is None:  # settled: planned or rejected
            reason = rejection(space, request_id)
            if reason is not None:
                print(f"trainmover drain: the controller rejected the drain: {reason}", file=sys.stderr)
                return 1
            view = read_view(space)
            last = view.last_plan
            if last is not None and last.epoch > epoch and last.drain == node:
                plan = last
                print(f"planned: epoch {plan.epoch}; " + "; ".join(plan.placement), flush=True)
        if plan is not None:
            view = read_view(space)
            now = view.last_plan if view.last_plan is not None and view.last_plan.epoch == plan.epoch else None
            if now is not None and "handed_over" in now.steps:
                moved = ", ".join(f"{r.rank} -> {r.joiner}" for r in now.replacement_list())
                print(f"node {node} is free: every rank handed its state over at epoch {plan.epoch} ({moved})")
                return 0
            if view.epoch is not None and view.epoch > plan.epoch:
                print(
                    f"trainmover drain: epoch {view.epoch} superseded the drain (a failure during it); the "
                    f"node's ranks are recovered by that epoch: see `trainmover status`",
                    file=sys.stderr,
                )
                return 3
        time.sleep(POLL_S)
    what = "no decision" if plan is None else "the hand-over did not finish"
    print(
        f"trainmover drain: {what} within {wait_s:.0f}s; the drain goes on: follow it with `trainmover status`",
        file=sys.stderr,
    )
    return 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node",
        required=True,
        help="the node to drain, by the name `trainmover status` shows under 'host' (the Slurm node name "
        "under Slurm, else TRAINMOVER_NODE_NAME or the host name)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to wait: exit 0 once every rank of the node handed its state over (the node is "
        "free), 1 when the controller rejected the drain (the reason is printed), 3 when it was not "
        "done in time (it goes on). Default 300; 0 returns as soon as the request is written",
    )
