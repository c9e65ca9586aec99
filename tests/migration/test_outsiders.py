"""Nobody outside the job gets in: a running job's etcd refuses an outsider's writes.

The outsider runs the three attacks that once steered a job (a migration request onto its own
"standby", a fake warm standby, a forged failure report) twice: with no credentials (a raw etcd
client, as any process that reaches the port has) and logged in as another job's etcd user.
etcd refuses every read and write of the job's keys, the job never plans anything, and its
trajectory is bit-identical to the fault-free run. A companion shows the same attacks land on an
etcd without auth, so the check can fail.
"""

from __future__ import annotations

import os
import re
import time

import grpc
import pytest

from helpers import assert_recovered, control_flags, read_metrics, start_job, tm_args, trajectory, wait_for

ATTACKS = ("requests/evil-1", "members/evil-standby", "reports/1/evil")


def _attack_values(job: str) -> dict[str, bytes]:
    """The outsider's three writes, as the control plane would read them."""
    from trainmover_ext.control.records import FailureReport, MemberRecord, MigrationRequest

    now = time.time()
    return {
        f"/trainmover/{job}/requests/evil-1": MigrationRequest(
            request_id="evil-1", rank=1, to="evil-standby", requested_by="outsider", requested_at=now
        ).to_bytes(),
        f"/trainmover/{job}/members/evil-standby": MemberRecord(
            member_id="evil-standby",
            kind="standby",
            host="evil",
            pid=1,
            warm_roles=["first", "middle", "last"],
            registered_at=now,
        ).to_bytes(),
        f"/trainmover/{job}/reports/1/evil": FailureReport(
            rank=1, member_id="w1", reporter="evil", reason="forged", epoch=0, reported_at=now
        ).to_bytes(),
    }


def _raw_client(endpoint: str, **login):
    """A plain pyetcd client: what an outsider's script uses."""
    import pyetcd

    host, port = endpoint.rsplit(":", 1)
    client = pyetcd.MultiEndpointEtcd3Client(
        endpoints=[pyetcd.Endpoint(host, int(port), secure=False)], timeout=3, **login
    )
    client.call_credentials = None  # the login token as metadata, as on any plain channel
    return client


def _attempts(client, job: str) -> list[str]:
    """Run every attack; returns what etcd let through (empty when every call was refused)."""
    through = []
    for key, value in _attack_values(job).items():
        try:
            client.put(key, value)
            through.append(f"put {key}")
        except grpc.RpcError:
            pass
    try:
        if client.get_response(f"/trainmover/{job}/job").kvs:
            through.append("read the job record")
    except grpc.RpcError:
        pass
    return through


def _login(job: str, token: str) -> dict:
    from trainmover_ext.kv.job import job_password, job_user

    return {"user": job_user(job), "password": job_password(job, token)}


def test_outsiders_cannot_touch_a_running_job(tmp_path, corpus, reference):
    from trainmover_ext.etcd.auth import provision_job

    args = tm_args(corpus)
    ref = reference("tp2pp2dp2", 8, args)
    job = start_job(tmp_path, 8, args, "--tm-job", "guarded", name="guarded")
    try:
        flags = control_flags(job)
        endpoint = flags[1]
        run_dir = str(tmp_path / "guarded.run")
        # The operator (root password file, mode 600) gives another job its own user on this etcd.
        root_file = os.path.join(run_dir, "etcd-root-password")
        assert oct(os.stat(root_file).st_mode & 0o777) == "0o600"
        provision_job(f"http://{endpoint}", "other", "other-token", admin=("root", open(root_file).read().strip()))
        wait_for(lambda: any(r["iteration"] >= 3 for r in read_metrics(job.metrics_path)), 240, 0.2, "iteration 3")

        anonymous = _raw_client(endpoint)
        assert _attempts(anonymous, "guarded") == []
        other = _raw_client(endpoint, **_login("other", "other-token"))
        other.put("/trainmover/other/mine", b"1")  # that login works, on its own job's keys
        assert _attempts(other, "guarded") == []
        # a watch on the job's keys is refused too (etcd cancels it: id -1)
        assert other.add_watch_callback("/trainmover/guarded/", lambda r: None, range_end="/trainmover/guarded0") == -1
        # the wrong token is no login at all
        with pytest.raises(grpc.RpcError):
            _raw_client(endpoint, **_login("guarded", "not-the-token"))
        code = job.wait(300)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    log = job.stdout() + job.stderr()
    assert code == 0, log[-3000:]
    assert "evil" not in log
    assert not re.search(r"rank \d+ -> ", log), "the controller planned a move"
    assert trajectory(job.metrics_path) == ref, "the trajectory differs from the fault-free run"
    assert len(job.rank_pids()) == 1, "the job restarted"


def test_the_same_attacks_land_on_an_etcd_without_auth(etcd):
    """Companion: without auth on the server, every attack goes through (the check above can fail)."""
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import JobSpace

    space = JobSpace.create(EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints)), "open", "token")
    try:
        through = _attempts(_raw_client(etcd.endpoints[0]), "open")
        assert through == [f"put /trainmover/open/{a}" for a in ATTACKS] + ["read the job record"]
    finally:
        space.kv.close()


def test_a_tls_job_recovers_bit_identically_and_refuses_clients_without_a_certificate(tmp_path, corpus, reference):
    """``--tm-etcd-tls``: the demo's failover (a SIGKILLed rank taken over by the standby) is
    bit-identical over TLS, and a client without the member certificate cannot even connect."""
    from trainmover_ext.errors import EtcdUnavailable, StoreError
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import JobSpace, job_login

    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = start_job(
        tmp_path,
        8,
        tm_args(corpus, extra=["--tm-inject-fault", "3:6:forward"]),
        "--tm-job",
        "tls",
        "--tm-etcd-tls",
        name="tls",
    )
    try:
        flags = control_flags(job)
        endpoint, token = flags[1], flags[5]
        tls = dict(zip(flags[6::2], flags[7::2], strict=False))
        assert set(tls) == {"--tm-etcd-ca", "--tm-etcd-cert", "--tm-etcd-key"}, flags
        assert oct(os.stat(tls["--tm-etcd-key"]).st_mode & 0o777) == "0o600"
        wait_for(lambda: any(r["iteration"] >= 1 for r in read_metrics(job.metrics_path)), 240, 0.2, "iteration 1")
        # the job's own login over TLS works (the status command's way in)
        good = EtcdClientConfig(
            endpoints=[endpoint],
            ca_cert=tls["--tm-etcd-ca"],
            client_cert=tls["--tm-etcd-cert"],
            client_key=tls["--tm-etcd-key"],
            connect_timeout_s=10,
        )
        JobSpace.open(EtcdKV(job_login(good, "tls", token)), "tls", token).kv.close()
        # no client certificate: the TLS handshake fails, whatever the login
        no_cert = EtcdClientConfig(endpoints=[endpoint], ca_cert=tls["--tm-etcd-ca"], timeout_s=1, connect_timeout_s=1)
        with pytest.raises(EtcdUnavailable):
            EtcdKV(job_login(no_cert, "tls", token))
        # plain text to a TLS port: no answer either
        with pytest.raises(StoreError):
            EtcdKV(EtcdClientConfig(endpoints=[endpoint], timeout_s=1, connect_timeout_s=1))
        code = job.wait(300)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, job.stderr()[-3000:]
    assert_recovered(job, ref, 3)


@pytest.mark.parametrize(
    "kind,refusal",
    [
        ("pickle", "not a TrainMover state record"),
        ("shapes", "the state source's tensors differ from this process's: tensor 0"),
        ("count", "tensors, this process holds"),
    ],
)
def test_a_crafted_state_record_is_refused_and_the_job_recovers_through_the_next_plan(
    tmp_path, corpus, reference, kind, refusal
):
    """A state source that sends a crafted metadata record (a pickle that would run code, a wrong
    shape, a wrong count) is refused by the joiner, which names what was wrong; the joiner's rank
    then fails again, the next plan brings the other standby, and the run stays bit-identical."""
    marker = str(tmp_path / "forged-code-ran")
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = start_job(
        tmp_path,
        8,
        tm_args(corpus, extra=["--tm-inject-fault", "3:6:forward", "--tm-standbys", "2"]),
        name=f"forged_{kind}",
        env={"TRAINMOVER_DRILL_FORGED_STATE": f"{kind}:1:{marker}"},
    )
    code = job.wait(360)
    log = job.stdout() + job.stderr()
    assert code == 0, log[-4000:]
    assert f"sends rank 3 a crafted state record ({kind}, epoch 1)" in log, log[-3000:]
    assert refusal in log, log[-3000:]
    assert "epoch 2 (failure): rank 3 -> standby" in log, log[-3000:]
    assert not os.path.exists(marker), "the crafted record's code ran"
    assert_recovered(job, ref, 3)
