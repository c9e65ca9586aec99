"""`trainmover status / events / migrate` against a real etcd, through the top-level CLI."""

from __future__ import annotations

import subprocess
import sys
import time

from trainmover_ext.cli import main
from trainmover_ext.control.controller import Controller, ControllerConfig
from trainmover_ext.control.membership import Membership, init_job
from trainmover_ext.control.records import ROLES, MemberRecord, RankRecord
from trainmover_ext.control.view import read_view
from trainmover_ext.kv.job import JobSpace


def flags(etcd, token, job="cli"):
    return [
        "--tm-etcd-endpoints",
        ",".join(etcd.endpoints),
        "--tm-job",
        job,
        "--tm-job-token",
        token,
        "--tm-etcd-timeout",
        "2",
    ]


def test_status_events_and_migrate(etcd, kv, capsys):
    space = JobSpace.create(kv, "cli")
    members = [
        Membership(space, MemberRecord(member_id=f"w{r}", kind="worker", host="h0", pid=1), ttl_s=5).register()
        for r in range(2)
    ]
    members.append(
        Membership(
            space, MemberRecord(member_id="s0", kind="standby", host="h1", pid=2, warm_roles=list(ROLES)), ttl_s=5
        ).register()
    )
    init_job(
        space,
        [RankRecord(rank=r, member_id=f"w{r}", host="h0", role=("first", "last")[r], replicas=[]) for r in range(2)],
    )
    ctl = Controller(space, ControllerConfig(controller_id="c0", ttl_s=2)).start()
    try:
        assert main(["status", *flags(etcd, space.token)]) == 0
        out = capsys.readouterr().out
        assert "epoch 0" in out and "w1" in out and "s0" in out and "first,middle,last" in out

        assert main(["migrate", "--rank", "1", "--to", "no-such-standby", *flags(etcd, space.token)]) == 2
        assert "the warm standbys for rank 1 (stage role 'last') are: s0" in capsys.readouterr().err
        assert main(["migrate", "--rank", "1", "--to", "s0", *flags(etcd, space.token)]) == 0
        out = capsys.readouterr().out
        assert "requested planned migration" in out and "planned: epoch 1, rank 1 -> s0" in out
        deadline = time.monotonic() + 5
        while read_view(space).epoch != 1:
            assert time.monotonic() < deadline, "the controller did not act on the request"
            time.sleep(0.02)
        assert main(["status", *flags(etcd, space.token)]) == 0
        out = capsys.readouterr().out
        assert "rank 1: w1 -> s0 (last), state from the leaver" in out and "decided" in out

        assert main(["events", *flags(etcd, space.token)]) == 0
        out = capsys.readouterr().out
        for what in ("member_joined", "leader_elected", "migration_requested", "migration_planned"):
            assert what in out

        assert main(["migrate", "--rank", "9", *flags(etcd, space.token)]) == 2
        assert "has no rank 9" in capsys.readouterr().err
    finally:
        ctl.close()
        for m in members:
            m.close()


def test_cli_errors_say_what_to_do(etcd, kv, capsys):
    space = JobSpace.create(kv, "cli")
    assert main(["status", *flags(etcd, "wrong")]) == 2
    assert "wrong job token" in capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, "-m", "trainmover_ext.cli", "status", "--tm-job", "cli"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin"},
    )
    assert proc.returncode == 2 and "--tm-etcd-endpoints" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmover_ext.cli",
            "status",
            "--tm-etcd-endpoints",
            "127.0.0.1:1",
            "--tm-job",
            "cli",
            "--tm-job-token",
            space.token,
            "--tm-etcd-timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no etcd answered at 127.0.0.1:1" in proc.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "trainmover_ext.cli", "migrate", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--rank", "--to", "--wait", "--tm-job-token", "--tm-etcd-ca", "--tm-etcd-cert", "--tm-etcd-key"):
        assert flag in help_text
    # a stand-alone controller needs the job's token, and refuses a wrong one before standing
    assert main(["controller", "--tm-etcd-endpoints", ",".join(etcd.endpoints), "--tm-job", "cli"]) == 2
    assert "--tm-job-token" in capsys.readouterr().err
    assert main(["controller", *flags(etcd, "wrong")]) == 2
    assert "token" in capsys.readouterr().err


def test_migrate_without_a_controller_says_so(etcd, kv, capsys):
    space = JobSpace.create(kv, "cli")
    init_job(space, [RankRecord(rank=0, member_id="w0", host="h0", role="first", replicas=[])])
    assert main(["migrate", "--rank", "0", "--wait", "0.5", *flags(etcd, space.token)]) == 3
    assert "no decision within" in capsys.readouterr().err


def test_migrate_refuses_a_target_that_is_not_a_warm_standby(etcd, kv, capsys):
    """`--to` is checked against the view before any request is written: no controller is needed to refuse it."""
    space = JobSpace.create(kv, "cli")
    init_job(space, [RankRecord(rank=0, member_id="w0", host="h0", role="last", replicas=[])])
    registered = [
        MemberRecord(member_id="w0", kind="worker", host="h0", pid=1),
        MemberRecord(member_id="warming", kind="standby", host="h1", pid=2),
        MemberRecord(member_id="first-only", kind="standby", host="h1", pid=3, warm_roles=["first"]),
    ]
    members = [Membership(space, rec, ttl_s=5).register() for rec in registered]
    try:
        for target in ("w0", "warming", "first-only", "no-such-standby"):
            assert main(["migrate", "--rank", "0", "--to", target, "--wait", "0", *flags(etcd, space.token)]) == 2
            err = capsys.readouterr().err
            assert f"--to {target} is not an idle warm standby" in err and "has no warm standby for rank 0" in err, err
        members.append(
            Membership(
                space, MemberRecord(member_id="s0", kind="standby", host="h1", pid=4, warm_roles=list(ROLES)), ttl_s=5
            ).register()
        )
        assert main(["migrate", "--rank", "0", "--to", "warming", "--wait", "0", *flags(etcd, space.token)]) == 2
        assert "the warm standbys for rank 0 (stage role 'last') are: s0." in capsys.readouterr().err
        assert kv.get_prefix(space.key("requests/")).entries == [], "a refused target writes no request"
        assert main(["migrate", "--rank", "0", "--to", "s0", "--wait", "0", *flags(etcd, space.token)]) == 0
        assert len(kv.get_prefix(space.key("requests/")).entries) == 1
    finally:
        for m in members:
            m.close()


def test_straggler_policy_and_quarantine_at_run_time(etcd, kv, capsys):
    """`trainmover straggler` shows and changes the job's policy (bad values refused, nothing written);
    `trainmover quarantine` lists and clears quarantined slots; `trainmover status` shows both."""
    from trainmover_ext.control.records import (
        Quarantine,
        SlowLinkRecord,
        StragglerRecord,
        quarantine_key,
    )
    from trainmover_ext.control.straggler_watch import slow_link_key, view_policy
    from trainmover_ext.control.view import read_view

    space = JobSpace.create(kv, "strag")
    f = flags(etcd, space.token, job="strag")
    assert main(["straggler", *f]) == 0
    assert "straggler policy: report, threshold 1.15x the peers' median for 20 iterations" in capsys.readouterr().out
    assert main(["straggler", "--action", "migrate", "--threshold", "1.3", *f]) == 0
    policy = view_policy(read_view(space))
    assert (policy.action, policy.threshold, policy.window) == ("migrate", 1.3, 20)
    assert main(["straggler", "--threshold", "0.9", *f]) == 2
    assert "--tm-straggler-threshold must be > 1" in capsys.readouterr().err
    assert view_policy(read_view(space)).threshold == 1.3

    space.put(quarantine_key(space, "n7", 3), Quarantine(host="n7", slot=3, reason="rank 5 at 1.4x").to_bytes())
    record = StragglerRecord(
        rank=5, member_id="w5", host="n7", slot=3, iteration=40, ratio=1.4, peers_median_s=0.1, action="migrate"
    )
    space.put(space.key("stragglers", 5), record.to_bytes())
    link = SlowLinkRecord(
        ranks=[2, 6], hosts=["n1", "n3"], iteration=50, ratio=2.5, peers_median_s=0.01, waited_s=0.025
    )
    space.put(slow_link_key(space, 6, 2), link.to_bytes())
    assert main(["status", *f]) == 0
    out = capsys.readouterr().out
    assert "policy: migrate, threshold 1.3x" in out and "rank 5: w5 on n7 slot 3 at 1.4x" in out
    assert "QUARANTINED n7 slot 3" in out
    assert "SLOW LINK rank 2 (n1) <-> rank 6 (n3): waited 2.5x its peers' median" in out
    assert main(["quarantine", *f]) == 0
    assert "n7:3" in capsys.readouterr().out
    assert main(["quarantine", "--clear", "n7:4", *f]) == 2
    assert "not quarantined: n7:4 (quarantined: n7:3); nothing cleared" in capsys.readouterr().err
    assert main(["quarantine", "--clear", "n7", *f]) == 2
    assert main(["quarantine", "--clear", "n7:3", *f]) == 0
    assert "cleared n7:3" in capsys.readouterr().out
    assert read_view(space).quarantine == []


def test_rebalance_schedule_and_a_move_now(etcd, kv, capsys):
    """`trainmover rebalance` shows and sets the schedule (a negative one refused) and asks for one move now
    (refused, with what to do, when no standby can take any rank)."""
    from trainmover_ext.control.rebalance import POLICY_KEY
    from trainmover_ext.control.records import RebalancePolicy

    space = JobSpace.create(kv, "reb")
    f = flags(etcd, space.token, job="reb")
    init_job(space, [RankRecord(rank=r, member_id=f"w{r}", host="h0", role="first") for r in range(2)])
    assert main(["rebalance", *f]) == 0
    assert "rebalancing: off" in capsys.readouterr().out
    assert main(["rebalance", "--interval", "-1", *f]) == 2
    assert "--tm-rebalance-interval must be >= 0" in capsys.readouterr().err
    assert main(["rebalance", "--interval", "10", *f]) == 0
    assert "rebalancing: every 10 min" in capsys.readouterr().out
    entry = space.kv.get(space.key(*POLICY_KEY))
    assert RebalancePolicy.from_bytes(entry.value, key=entry.key).interval_s == 600
    assert main(["status", *f]) == 0
    assert "rebalancing: a planned move every 10 min" in capsys.readouterr().out
    assert main(["rebalance", "--now", *f]) == 2
    assert "no idle standby is warm" in capsys.readouterr().err
    standby = Membership(
        space, MemberRecord(member_id="s0", kind="standby", host="h1", pid=2, warm_roles=list(ROLES)), ttl_s=5
    ).register()
    try:
        assert main(["rebalance", "--now", *f]) == 0
        assert "rank 0 -> a standby chosen by the controller" in capsys.readouterr().out
        assert [r.rank for r in read_view(space).requests.values()] == [0]
    finally:
        standby.close()
