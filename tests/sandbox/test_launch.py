"""The general standby under ``trainmover launch``: real launcher, real etcd, real processes.

The job (PP=3, 3 ranks) records its first iterations into ``--tm-record-dir``
and publishes the index at ``recordings/<role>``; the launcher's standby warms
first, middle and last from it and reports warm roles and timings on its
member record, while its only TCP connections go to etcd. Without recordings
in time it falls back to the basic warm-up and says why.
"""

from __future__ import annotations

import json
import os
import re
import signal

from helpers import kill_quietly, read_metrics, start_job, wait_for
from support.sandbox_jobs import pp3_argv

TOKEN = "sandbox-test-token"


def _launch(tmp_path, corpus, name, *extra):
    # On two cores the job's ranks keep every core busy: a standby at the lowest CPU priority (the
    # default) would warm only once the job ends, so these standbys keep their priority.
    args = pp3_argv(corpus, "--trainmover", "--tm-standbys", "1", "--tm-standby-nice", "0", *extra)
    args[args.index("--train-iters") + 1] = "100000"  # stopped by the test once it has seen enough
    return start_job(tmp_path, 3, args, "--tm-job", name, "--tm-job-token", TOKEN, name=name)


def _etcd(job, name):
    """A client of the job's etcd, logged in as the job's user."""
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import job_login

    match = wait_for(lambda: re.search(r"embedded etcd at (\S+) ", job.stderr()), 60, 0.1, "the embedded etcd")
    return EtcdKV(job_login(EtcdClientConfig(endpoints=match.group(1).split(",")), name, TOKEN)), match.group(1)


def _records(kv, prefix: str, kind: str) -> dict:
    from trainmover_ext.kv.codec import decode

    return {e.key[len(prefix) :]: decode(e.value, kind=kind, key=e.key) for e in kv.get_prefix(prefix).entries}


def _standby(kv, job_name):
    members = _records(kv, f"/trainmover/{job_name}/members/", "member")
    return next((m for m in members.values() if m["kind"] == "standby"), None)


def _established_remote_ports(pid: int) -> set[int]:
    """Remote ports of the ESTABLISHED TCP connections held by ``pid``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes and cols[3] == "01":
                ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def _stop(job):
    job.popen.send_signal(signal.SIGTERM)
    try:
        job.wait(60)
    finally:
        kill_quietly(job.popen.pid)


def test_standby_warms_all_roles_from_recordings_without_touching_the_job(tmp_path, corpus):
    record_dir = str(tmp_path / "recordings")
    # Paced to a fifth of a core (--tm-standby-duty; beside three busy ranks on two cores it gets about
    # half of one, so it must pause): the pauses show in its report. The job evaluates after
    # every iteration: the evaluations' collectives stay out of the recorded iterations, which the
    # standby's shadow iterations replay call for call.
    evals = ["--split", "90,10,0", "--eval-iters", "1", "--eval-interval", "1"]
    job = _launch(
        tmp_path,
        corpus,
        "sbwarm",
        "--tm-record-dir",
        record_dir,
        "--tm-record-iters",
        "2",
        "--tm-standby-duty",
        "0.2",
        *evals,
    )
    try:
        kv, endpoint = _etcd(job, "sbwarm")
        standby = wait_for(
            lambda: (
                (s := _standby(kv, "sbwarm"))
                and s["warmup"].get("mode") == "sandbox"
                and not s.get("warming")  # it serves every role from the start; done warming them
                and len(s["warm_roles"]) == 3
                and s
            ),
            240,
            0.2,
            "the standby to warm three roles",
        )
        assert standby["warm_roles"] == ["first", "middle", "last"]
        roles = {r["role"]: r for r in standby["warmup"]["roles"]}
        assert set(roles) == {"first", "middle", "last"}
        for timing in roles.values():
            assert timing["build_s"] > 0 and timing["first_iteration_s"] > 0 and timing["replayed_calls"] > 0
        assert standby["warmup"]["paused_s"] > 0, standby["warmup"]
        # the index in etcd names the sealed files on the shared directory
        published = _records(kv, "/trainmover/sbwarm/recordings/", "recording")
        assert set(published) == {"first", "middle", "last"}
        for role, summary in published.items():
            assert summary["record_dir"] == record_dir and summary["rank"] == {"first": 0, "middle": 1, "last": 2}[role]
            assert os.path.getsize(os.path.join(record_dir, role, "tensors.bin")) == summary["data_bytes"]
            assert summary["records"] and summary["record_overhead_s"] >= 0
        # isolation: the standby's only TCP connections go to etcd, never to a job rank
        pid = int(re.search(r"started standby \S+ \(pid (\d+)", job.stderr()).group(1))
        assert _established_remote_ports(pid) <= {int(endpoint.rsplit(":", 1)[1])}
        before = len(read_metrics(job.metrics_path))
        wait_for(lambda: len(read_metrics(job.metrics_path)) > before + 3, 60, 0.2, "the job to keep training")
        assert "warm in" in job.stdout() and "(sandbox, roles ['first', 'middle', 'last'])" in job.stdout()
        assert [r["iteration"] for r in read_metrics(job.metrics_path, "evaluation")][:3] == [1, 2, 3]
    finally:
        _stop(job)


def test_standby_falls_back_when_no_recording_appears(tmp_path, corpus):
    # The job records far more iterations than it will reach before the standby's deadline.
    job = _launch(
        tmp_path,
        corpus,
        "sbfallback",
        "--tm-record-dir",
        str(tmp_path / "rec"),
        "--tm-record-iters",
        "100000",
        "--tm-record-timeout",
        "3",
    )
    try:
        kv, _ = _etcd(job, "sbfallback")
        standby = wait_for(
            lambda: (s := _standby(kv, "sbfallback")) and s["warmup"].get("mode") == "basic" and s,
            240,
            0.2,
            "the standby to fall back",
        )
        assert standby["warm_roles"] == ["first", "middle", "last"]  # colder, but it can still serve
        assert "no recording of role(s)" in standby["warmup"]["reason"]
        wait_for(lambda: "falling back to the basic warm-up" in job.stdout(), 30, 0.2, "the fallback message")
    finally:
        _stop(job)
    assert json.dumps(standby)  # plain JSON on the member record
