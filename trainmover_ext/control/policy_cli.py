"""``trainmover straggler``, ``quarantine`` and ``rebalance``: the job's policies, at run time.

- ``trainmover straggler`` prints the job's policy; with ``--action``, ``--threshold`` or ``--window`` it
  changes those fields (the others are kept) in one compare-and-swap on ``policy/stragglers``, and the
  leading controller's watch applies the change at its next round (new thresholds restart its streaks).
- ``trainmover quarantine`` lists the quarantined slots; ``--clear HOST:SLOT`` (repeatable) or
  ``--clear-all`` removes them, after which standbys there may be promoted again.
- ``trainmover rebalance`` prints the rebalancing schedule; ``--interval MIN`` sets it (0: off), and
  ``--now`` asks for one rotation move at once (:mod:`trainmover_ext.control.rebalance`).
Bad input is refused with exit 2 and nothing written.
"""

from __future__ import annotations

import argparse
import os
import time

from trainmover_ext.control import rebalance
from trainmover_ext.control.records import (
    STRAGGLER_ACTIONS,
    Quarantine,
    RebalancePolicy,
    StragglerPolicy,
    quarantine_key,
)
from trainmover_ext.control.straggler_watch import POLICY_KEY
from trainmover_ext.control.view import read_view
from trainmover_ext.errors import ConfigError, MalformedValue
from trainmover_ext.kv.base import Delete, Guard, Put


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--action",
        choices=STRAGGLER_ACTIONS,
        default=None,
        help="report: log and record a straggler; migrate: also move it to a warm standby and quarantine its "
        "slot; off: judge nobody",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="slow means this many times the median compute time of the rank's peers (> 1)",
    )
    p.add_argument("--window", type=int, default=None, help="consecutive slow iterations that make a straggler")


def add_quarantine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clear",
        action="append",
        default=[],
        metavar="HOST:SLOT",
        help="let standbys in this slot be promoted again (as `trainmover status` lists it); repeatable",
    )
    p.add_argument("--clear-all", action="store_true", help="clear every quarantined slot of the job")


def _describe(policy: StragglerPolicy) -> str:
    return (
        f"straggler policy: {policy.action}, threshold {policy.threshold:g}x the peers' median for "
        f"{policy.window} iterations (set by {policy.set_by or 'the defaults'})"
    )


def cmd_straggler(args: argparse.Namespace) -> int:
    from trainmover_ext.control.cli import open_job

    space = open_job(args)
    try:
        key = space.key(*POLICY_KEY)
        entry = space.kv.get(key)
        try:
            current = StragglerPolicy() if entry is None else StragglerPolicy.from_bytes(entry.value, key=key)
        except MalformedValue:
            current = StragglerPolicy()
        change = {
            name: value
            for name, value in (("action", args.action), ("threshold", args.threshold), ("window", args.window))
            if value is not None
        }
        if not change:
            print(_describe(current))
            return 0
        fields = vars(current) | change | {"set_by": f"cli@{os.uname().nodename}", "set_at": time.time()}
        policy = StragglerPolicy(**fields).check()
        guard = Guard.absent(key) if entry is None else Guard.mod_revision(key, entry.mod_revision)
        if not space.commit([guard], [Put(key, policy.to_bytes())]):
            raise ConfigError("the straggler policy changed meanwhile (another `trainmover straggler`?); run it again")
        print(_describe(policy))
        return 0
    finally:
        space.kv.close()


def cmd_quarantine(args: argparse.Namespace) -> int:
    from trainmover_ext.control.cli import open_job

    wanted: list[tuple[str, int]] = []
    for text in args.clear:
        host, sep, slot = text.rpartition(":")
        if not sep or not host or not slot.isdigit():
            raise ConfigError(f"--clear {text!r}: expected HOST:SLOT, e.g. node07:3 (see `trainmover quarantine`)")
        wanted.append((host, int(slot)))
    space = open_job(args)
    try:
        held = read_view(space).quarantine
        if not wanted and not args.clear_all:
            for q in held:
                print(f"{q.host}:{q.slot}  since {time.strftime('%H:%M:%S', time.localtime(q.since))}  {q.reason}")
            if not held:
                print("no slot is quarantined")
            return 0
        known = {(q.host, q.slot): q for q in held}
        missing = [f"{h}:{s}" for h, s in wanted if (h, s) not in known]
        if missing:
            listed = ", ".join(f"{h}:{s}" for h, s in known) or "none"
            raise ConfigError(f"not quarantined: {', '.join(missing)} (quarantined: {listed}); nothing cleared")
        cleared: list[Quarantine] = list(known.values()) if args.clear_all else [known[w] for w in wanted]
        if cleared:
            space.commit([], [Delete(quarantine_key(space, q.host, q.slot)) for q in cleared])
        for q in cleared:
            print(f"cleared {q.host}:{q.slot}: standbys there may be promoted again")
        if not cleared:
            print("no slot is quarantined")
        return 0
    finally:
        space.kv.close()


def add_rebalance_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=float,
        default=None,
        metavar="MIN",
        help="minutes between scheduled rotation moves (0 turns them off); the next is due this long after now",
    )
    p.add_argument(
        "--now",
        action="store_true",
        help="ask for one rotation move at once: the rank served longest moves to an idle warm standby",
    )


def cmd_rebalance(args: argparse.Namespace) -> int:
    from trainmover_ext.control.cli import open_job

    if args.interval is not None:
        RebalancePolicy(interval_s=args.interval * 60).check()
    space = open_job(args)
    try:
        key = space.key(*rebalance.POLICY_KEY)
        entry = space.kv.get(key)
        try:
            current = RebalancePolicy() if entry is None else RebalancePolicy.from_bytes(entry.value, key=key)
        except MalformedValue:
            current = RebalancePolicy()
        if args.interval is not None:
            who = {"set_by": f"cli@{os.uname().nodename}", "set_at": time.time()}
            current = RebalancePolicy(**(vars(current) | {"interval_s": args.interval * 60} | who))
            guard = Guard.absent(key) if entry is None else Guard.mod_revision(key, entry.mod_revision)
            if not space.commit([guard], [Put(key, current.to_bytes())]):
                raise ConfigError("the rebalancing schedule changed meanwhile; run it again")
        every = f"every {current.interval_s / 60:g} min" if current.interval_s > 0 else "off"
        print(f"rebalancing: {every}")
        if args.now:
            planned = rebalance.rebalance_puts(space, read_view(space), f"cli@{os.uname().nodename}", time.time())
            if planned is None:
                raise ConfigError(
                    "no rank can move now: no idle standby is warm for any rank's stage role (see `trainmover status`)"
                )
            rank, request, puts = planned
            space.commit([], puts)
            print(f"requested planned migration {request}: rank {rank} -> a standby chosen by the controller")
        return 0
    finally:
        space.kv.close()
