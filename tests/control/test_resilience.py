"""etcd under stress: TLS with client certificates, a 3-member cluster losing a member, a restarted
single etcd, an unreachable etcd, a missing binary, and the metrics endpoint."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
import urllib.request
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import wait_until
from nccl_delta.transport_gloo import connect_gloo_pair
from trainmover_ext.control.membership import LeaseKeeper, Membership
from trainmover_ext.control.records import MemberRecord
from trainmover_ext.errors import ConfigError, EtcdNotFound, EtcdUnavailable, LaunchError, StoreError
from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig, LocalEtcdCluster, find_etcd_binary
from trainmover_ext.etcd.tls import make_test_certs
from trainmover_ext.kv import EtcdClientConfig, EtcdKV
from trainmover_ext.kv.job import JobSpace, job_login
from trainmover_ext.kv.torch_store import EtcdStore
from trainmover_ext.metrics import ControlMetrics


def test_tls_with_client_certificates(tmp_path):
    certs = make_test_certs(tmp_path / "certs")
    server = EmbeddedEtcd(
        EmbeddedEtcdConfig(
            data_dir=tmp_path / "etcd",
            cert_file=certs.server_cert,
            key_file=certs.server_key,
            trusted_ca_file=certs.ca_cert,
            client_cert_auth=True,
        )
    )
    with server:
        assert server.client_url.startswith("https://")
        good = EtcdClientConfig(
            endpoints=server.endpoints,
            ca_cert=certs.ca_cert,
            client_cert=certs.client_cert,
            client_key=certs.client_key,
            timeout_s=2,
            connect_timeout_s=3,
        )
        with EtcdKV(good) as kv:
            space = JobSpace.create(kv, "tls")
            space.put(space.key("x"), b"1")
            assert kv.get(space.key("x")).value == b"1"
        # A certificate from a CA the server does not trust is refused, as is a client without any certificate.
        for bad in (
            EtcdClientConfig(
                endpoints=server.endpoints,
                ca_cert=certs.ca_cert,
                client_cert=certs.other_client_cert,
                client_key=certs.other_client_key,
                timeout_s=1,
                connect_timeout_s=1,
            ),
            EtcdClientConfig(endpoints=server.endpoints, ca_cert=certs.ca_cert, timeout_s=1, connect_timeout_s=1),
        ):
            with pytest.raises(StoreError, match="tm-etcd"):
                EtcdKV(bad)
        # Plain-text clients cannot talk to a TLS server either.
        with pytest.raises(EtcdUnavailable):
            EtcdKV(EtcdClientConfig(endpoints=server.endpoints, timeout_s=1, connect_timeout_s=1))


def test_tls_config_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tm-etcd-cert and --tm-etcd-key"):
        EtcdClientConfig(endpoints=["127.0.0.1:1"], ca_cert="/x", client_cert="/y")
    with pytest.raises(ConfigError, match="--tm-etcd-ca /nope: no such file"):
        EtcdClientConfig(endpoints=["127.0.0.1:1"], ca_cert="/nope")
    with pytest.raises(ConfigError, match="--tm-etcd-endpoints"):
        EtcdClientConfig(endpoints=[])


def test_three_member_cluster_survives_losing_one(tmp_path):
    with LocalEtcdCluster(base_dir=tmp_path / "cluster", size=3) as cluster:
        kv = EtcdKV(EtcdClientConfig(endpoints=cluster.endpoints, timeout_s=5))
        space = JobSpace.create(kv, "ha")
        member = Membership(space, MemberRecord(member_id="w0", kind="worker", host="h", pid=1), ttl_s=2).register()
        store = EtcdStore(cluster.endpoints, prefix=space.key("store", "0") + "/", timeout=10)
        store.set("before", b"1")
        # Kill the member this client is talking to, so the client must fail over.
        in_use = kv._etcd.endpoint_in_use.netloc  # noqa: SLF001 - the test needs to know which one to kill
        index = cluster.endpoints.index(in_use)
        cluster.kill_member(index)
        for i in range(20):
            space.put(space.key("after", i), b"x")
        assert store.get("before") == b"1" and store.add("n", 2) == 2
        time.sleep(2.5)  # longer than the member TTL: its lease must have been kept alive through the failover
        member.check()
        assert kv.get(member.key) is not None
        assert len(kv.get_prefix(space.key("after/")).entries) == 20
        member.close()
        store.close()
        kv.close()


def _pair_over_store(store, side, queue):
    """One end of a gloo link whose rendezvous goes through ``store`` (a fresh client in this process)."""
    store.set(f"hello/{side}", str(side))
    store.wait([f"hello/{1 - side}"], timedelta(seconds=20))
    peer = store.get(f"hello/{1 - side}").decode()
    pair = connect_gloo_pair(store, "link/", side, timedelta(seconds=20), "127.0.0.1")
    t = torch.tensor([side + 1.0])
    pair.wait(pair.allreduce(t, dist.ReduceOp.SUM), timedelta(seconds=20))
    queue.put((side, peer, t.item()))


def test_a_new_client_whose_first_member_is_dead_fails_over_and_links_come_up(tmp_path, monkeypatch):
    """A process that builds its first etcd client after a member died (a promoted standby) must not stay on
    that member: the login, then the store's waits and sets, then a gloo pair's rendezvous all go through."""
    with LocalEtcdCluster(base_dir=tmp_path / "cluster", size=3) as cluster:
        cluster.kill_member(1)
        dead = cluster.endpoints[1]
        endpoints = [dead] + [ep for ep in cluster.endpoints if ep != dead]
        # pyetcd starts each client on a random member (random.choice): make it the dead one, in every child.
        monkeypatch.setattr(random, "choice", lambda seq: seq[0])
        config = job_login(EtcdClientConfig(endpoints=endpoints, timeout_s=5, connect_timeout_s=5), "ha", "token")
        store = EtcdStore(config, prefix="/trainmover/ha/store/1/", timeout=30)
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_pair_over_store, args=(store, side, queue)) for side in (0, 1)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(60)
        assert [proc.exitcode for proc in procs] == [0, 0]
        assert sorted(queue.get(timeout=5) for _ in procs) == [(0, "1", 3.0), (1, "0", 3.0)]


def test_single_etcd_restart_mid_run(tmp_path):
    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd"))
    with server:
        kv = EtcdKV(EtcdClientConfig(endpoints=server.endpoints, timeout_s=1.5))
        space = JobSpace.create(kv, "restart")
        seen: list = []
        got_after = threading.Event()
        watch = kv.watch_prefix(
            space.key("w/"),
            lambda evs: (seen.extend(evs), got_after.set() if any(e.key.endswith("after") for e in evs) else None),
        )
        keeper = LeaseKeeper(space, 3, name="t")
        space.put(space.key("w", "before"), b"1")
        server.kill()  # crash
        # A call while etcd is down waits up to the client timeout, then says what is wrong.
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="unreachable during get"):
            kv.get(space.key("w", "before"))
        assert 1.0 < time.monotonic() - t0 < 4
        server.start()  # same ports, same data dir
        # The old client reconnects by itself: data, watches and the lease survived.
        assert kv.get(space.key("w", "before")).value == b"1"
        space.put(space.key("w", "after"), b"2")
        assert got_after.wait(10), "the watch must re-subscribe after the restart"
        assert [e.key.rsplit("/", 1)[1] for e in seen] == ["before", "after"]
        time.sleep(1.2)
        assert not keeper.lost.is_set(), "a lease shorter-lived than the outage is kept alive after reconnecting"
        keeper.close()
        watch.cancel()
        kv.close()


def test_unreachable_etcd_at_start_is_a_clear_error():
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="no etcd answered at 127.0.0.1:1 .*--tm-etcd-endpoints"):
        EtcdKV(EtcdClientConfig(endpoints=["127.0.0.1:1"], timeout_s=0.5, connect_timeout_s=0.5))
    assert time.monotonic() - t0 < 3


def test_missing_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TRAINMOVER_ETCD_BINARY", raising=False)
    with pytest.raises(EtcdNotFound, match="not an executable file; .*apt-get install -y etcd-server"):
        find_etcd_binary(str(tmp_path / "no-etcd"))
    monkeypatch.setattr("trainmover_ext.etcd.server.FALLBACK_PATHS", ())
    with pytest.raises(EtcdNotFound, match="no etcd binary found; install one with `apt-get install -y etcd-server`"):
        EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd"))


def test_metrics_are_served(etcd, kv):
    metrics = ControlMetrics(job="m")
    port = metrics.serve(0)
    try:
        metrics.observe_view({"worker": 3, "standby": 1}, 7)
        metrics.detections.labels("m", "report").inc()
        metrics.detection_latency.labels("m").observe(0.01)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'trainmover_members{kind="worker",tm_job="m"} 3.0' in body
        assert 'trainmover_membership_epoch{tm_job="m"} 7.0' in body
        assert 'trainmover_detections_total{path="report",tm_job="m"} 1.0' in body
        assert "trainmover_detection_latency_seconds_bucket" in body
    finally:
        metrics.close()


def test_etcd_picks_new_ports_when_its_picked_port_is_taken(tmp_path):
    """A port picked "free a moment ago" can be bound by someone else before etcd starts (a CI run
    once had its client and peer URLs on one port). The server re-picks the ports it chose itself."""
    import socket

    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd"))
    assert server.config.client_port != server.config.peer_port
    taken = server.config.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start(timeout=30)
    try:
        assert server.config.client_port != taken
        assert "address already in use" in server.log_path.read_text()
        kv = EtcdKV(EtcdClientConfig(endpoints=server.endpoints))
        kv.put("/k", b"v")
        assert kv.get("/k").value == b"v"
        kv.close()
    finally:
        server.stop()


def test_etcd_keeps_a_port_the_caller_gave_and_says_it_is_taken(tmp_path):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd", client_port=port))
        with pytest.raises(LaunchError, match="address already in use"):
            server.start(timeout=30)
    server.stop()


def test_a_standby_registers_again_at_once_without_waiting_for_its_own_next_step(kv):
    """A standby paced to a small CPU share (``--tm-standby-duty``) calls ``check()`` only between its paced
    steps, seconds apart: with ``rejoin_in_background`` (as ``run_standby`` sets it) a lost lease is registered
    again on a thread of its own, with no call from the owner, so the pool is not short of it meanwhile. A
    ``check()`` after it registers nothing twice, and once promotion turns it off it stops."""
    from trainmover_ext.config import TrainMoverConfig
    from trainmover_ext.launch.identity import Identity
    from trainmover_ext.migration.standby import register_standby

    space = JobSpace.create(kv, "rejoin-bg")
    ident = Identity(member_id="s1", job="rejoin-bg", token="", host="h", pid=1)
    standby = register_standby(space, ident, TrainMoverConfig(lease_ttl_s=1))
    try:
        first = standby.keeper.lease_id
        kv.revoke_lease(first)
        assert wait_until(lambda: standby.rejoins == 1 and kv.get(standby.key) is not None, 10)
        assert standby.keeper.lease_id != first and not standby.keeper.lost.is_set()
        standby.check()  # the owner's next step finds it registered: nothing more
        assert standby.rejoins == 1
        # Promoted: no longer rejoins by itself (the rank's runtime decides from then on).
        standby.rejoin_on_loss = False
        kv.revoke_lease(standby.keeper.lease_id)
        assert wait_until(standby.keeper.lost.is_set, 5)
        time.sleep(1.5)
        assert standby.rejoins == 1 and kv.get(standby.key) is None
    finally:
        standby.close()


def test_an_unpromoted_standby_registers_again_after_losing_its_lease(kv):
    """A standby starved of CPU past its TTL loses its lease; it serves no rank, so it registers again (same
    record, fresh lease) instead of leaving the pool. A worker in the same spot leaves (MembershipLost)."""
    from trainmover_ext.errors import MembershipLost

    space = JobSpace.create(kv, "rejoin")
    record = MemberRecord(member_id="s0", kind="standby", host="h", pid=1, warm_roles=["first"])
    standby = Membership(space, record, ttl_s=1, rejoin_on_loss=True).register()
    worker = Membership(space, MemberRecord(member_id="w0", kind="worker", host="h", pid=2), ttl_s=1).register()
    try:
        # The lease ends before the keeper notices: the next write finds it gone and registers again.
        kv.revoke_lease(standby.keeper.lease_id)
        standby.update(warm_roles=["first", "last"])
        assert standby.rejoins == 1
        assert MemberRecord.from_bytes(kv.get(standby.key).value, key=standby.key).warm_roles == ["first", "last"]
        # The keeper notices first: check() registers again.
        kv.revoke_lease(standby.keeper.lease_id)
        assert wait_until(standby.keeper.lost.is_set, 5)
        standby.check()
        assert standby.rejoins == 2 and kv.get(standby.key) is not None
        # A worker serves a rank: a lost lease is its death.
        kv.revoke_lease(worker.keeper.lease_id)
        assert wait_until(worker.keeper.lost.is_set, 5)
        with pytest.raises(MembershipLost, match="w0 lost its lease"):
            worker.check()
    finally:
        standby.close()
        worker.close()
