"""A standby of another model shape is refused by the job: real launcher, real etcd, real processes.

The job (2 ranks, hidden size 32) publishes its model fingerprint; its launcher's standby runs with
``--hidden-size 64`` (``tests/support/standby_with_other_flags.py``). The standby must never
advertise a warm role, must exit with the refusal code, and its launcher must not start another.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from harness.jobs import PRETRAIN, REPO_ROOT
from helpers import JobProbe, LaunchedJob, control_flags, kill_quietly, launch_cmd, read_metrics, tiny_args, wait_for
from trainmover_ext.control.fingerprint import REFUSAL_EVENT
from trainmover_ext.control.records import Event, FingerprintRecord, MemberRecord
from trainmover_ext.errors import STANDBY_REFUSED_EXIT_CODE

WRAPPER = os.path.join(REPO_ROOT, "tests", "support", "standby_with_other_flags.py")
JOB = "refused"


def _start(tmp_path) -> LaunchedJob:
    # --tm-standby-nice 0: on two cores a standby at the lowest priority would start only once the job ends.
    args = tiny_args(
        None,
        iters=100000,
        extra=[
            "--trainmover",
            "--tm-standbys",
            "1",
            "--tm-standby-nice",
            "0",
            "--tm-metrics-file",
            str(tmp_path / "metrics.jsonl"),
        ],
    )
    cmd = launch_cmd(2, args, "--tm-job", JOB, "--run-dir", str(tmp_path / "run"))
    cmd[cmd.index(PRETRAIN)] = WRAPPER
    env = dict(os.environ, PYTHONUNBUFFERED="1", TM_TEST_STANDBY_FLAGS="--hidden-size 64")
    out, err = str(tmp_path / "job.out"), str(tmp_path / "job.err")
    popen = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=open(err, "w"), cwd=REPO_ROOT, env=env)
    return LaunchedJob(popen, out, err, str(tmp_path / "metrics.jsonl"))


def _open(probe: JobProbe):
    """The job's space once its agent registered the job (it prints the status hint before)."""
    from trainmover_ext.errors import StoreError

    try:
        return probe._space()
    except StoreError:
        return None


def _events(space) -> list[Event]:
    return [Event.from_bytes(e.value, key=e.key) for e in space.kv.get_prefix(space.events_prefix).entries]


def test_a_standby_of_another_model_shape_is_refused_and_not_restarted(tmp_path):
    job = _start(tmp_path)
    try:
        flags = control_flags(job)
        endpoints, token = flags[1].split(","), flags[5]
        space = wait_for(lambda: _open(JobProbe(endpoints, JOB, token)), 60, 0.2, "the job's namespace")
        warm_seen: list[dict] = []

        def refused():
            # Every standby record seen until the refusal: none may advertise a warm role.
            for entry in space.kv.get_prefix(space.key("members") + "/").entries:
                member = MemberRecord.from_bytes(entry.value, key=entry.key)
                if member.kind == "standby" and member.warm_roles:
                    warm_seen.append({"member": member.member_id, "warm_roles": member.warm_roles})
            assert job.popen.poll() is None, job.stderr()[-3000:]
            return re.search(
                r"standby (\S+) was refused by the job \(exit (\d+)\): (.*); not restarting it", job.stderr()
            )

        found = wait_for(refused, 180, 0.05, "the standby's refusal")
        member, code, fields = found.group(1), int(found.group(2)), found.group(3)
        assert code == STANDBY_REFUSED_EXIT_CODE
        assert "hidden_size: job 32, standby 64" in fields, fields
        assert not warm_seen, warm_seen
        # The job trains on, and no other standby is started meanwhile.
        trained = len(read_metrics(job.metrics_path))
        wait_for(lambda: len(read_metrics(job.metrics_path)) >= trained + 5, 60, 0.2, "the job to keep training")

        stored = space.kv.get(space.key("fingerprint"))
        job_fp = FingerprintRecord.from_bytes(stored.value, key="fingerprint")
        assert job_fp.fields["hidden_size"] == 32 and job_fp.digest
        events = _events(space)
        refusals = [e.detail for e in events if e.what == REFUSAL_EVENT]
        assert refusals == [{"member": member, "fields": refusals[0]["fields"]}]
        assert refusals[0]["fields"]["hidden_size"] == [32, 64]
        standbys = [e.detail["member"] for e in events if e.what == "member_joined" and e.detail["kind"] == "standby"]
        assert standbys == [member], standbys  # registered once (with no warm role), never restarted
        assert space.kv.get(space.key("members", member)) is None  # it left the job
        space.kv.close()
    finally:
        job.popen.send_signal(signal.SIGTERM)
        try:
            job.popen.wait(60)
        except subprocess.TimeoutExpired:
            kill_quietly(job.popen.pid)
            time.sleep(0.5)
