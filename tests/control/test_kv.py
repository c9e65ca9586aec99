"""The KV interface: the same contract checked on the in-memory fake and on a real etcd."""

from __future__ import annotations

import threading
import time

import pytest

from trainmover_ext.errors import AuthError, ConfigError, MalformedValue, SchemaVersionError, StoreError
from trainmover_ext.kv import Delete, Guard, MemoryKV, Put
from trainmover_ext.kv.codec import decode, encode
from trainmover_ext.kv.job import JobSpace


@pytest.fixture(params=["memory", "etcd"])
def anykv(request):
    if request.param == "memory":
        return MemoryKV()
    return request.getfixturevalue("kv")


def test_cas_put_if_absent_and_commit(anykv):
    rev = anykv.put("/t/a", b"1")
    entry = anykv.get("/t/a")
    assert entry.value == b"1" and entry.mod_revision == rev
    assert anykv.compare_and_swap("/t/a", entry.mod_revision, b"2")
    assert not anykv.compare_and_swap("/t/a", entry.mod_revision, b"3"), "a stale revision must lose"
    assert anykv.get("/t/a").value == b"2"
    assert anykv.put_if_absent("/t/b", b"x") and not anykv.put_if_absent("/t/b", b"y")
    assert anykv.get("/t/b").value == b"x"
    # A failed guard applies nothing, even the writes that would have succeeded alone.
    assert not anykv.commit([Guard.value("/t/a", b"nope")], [Put("/t/c", b"c"), Delete("/t/b")])
    assert anykv.get("/t/c") is None and anykv.get("/t/b") is not None
    assert anykv.commit([Guard.value("/t/a", b"2"), Guard.absent("/t/c")], [Put("/t/c", b"c"), Delete("/t/a")])
    assert [e.key for e in anykv.get_prefix("/t/").entries] == ["/t/b", "/t/c"]
    # etcd refuses a transaction that touches one key twice; the fake must refuse it too.
    with pytest.raises(StoreError):
        anykv.commit([], [Put("/t/x", b"1"), Delete("/t/", prefix=True)])


def test_get_prefix_since_returns_only_what_was_written_from_that_revision_on(anykv):
    anykv.put("/s/a", b"1")
    anykv.put("/s/b", b"1")
    first = anykv.get_prefix("/s/")
    assert [e.key for e in first.entries] == ["/s/a", "/s/b"]
    assert anykv.get_prefix("/s/", since=first.revision + 1).entries == []
    anykv.put("/s/b", b"2")
    anykv.put("/s/c", b"1")
    anykv.put("/t", b"1")
    changed = anykv.get_prefix("/s/", since=first.revision + 1)
    assert [(e.key, e.value) for e in changed.entries] == [("/s/b", b"2"), ("/s/c", b"1")]
    assert changed.revision > first.revision  # the store's revision: the next read asks from one more
    assert [e.key for e in anykv.get_prefix("/s/", end="/s/c", since=first.revision + 1).entries] == ["/s/b"]


def test_watch_sees_changes_in_order(anykv):
    seen: list = []
    done = threading.Event()

    def on(events):
        seen.extend(events)
        if any(e.key == "/w/end" for e in events):
            done.set()

    start = anykv.get_prefix("/w/").revision
    anykv.put("/w/before", b"0")  # written before the watch, replayed from start_revision
    watch = anykv.watch_prefix("/w/", on, start_revision=start + 1)
    anykv.put("/w/a", b"1")
    anykv.delete("/w/a")
    anykv.put("/other", b"x")
    anykv.put("/w/end", b"2")
    assert done.wait(5)
    watch.cancel()
    assert [(e.kind, e.key) for e in seen] == [
        ("put", "/w/before"),
        ("put", "/w/a"),
        ("delete", "/w/a"),
        ("put", "/w/end"),
    ]


def test_codec_rejects_garbage_and_old_versions():
    assert decode(encode("rank", {"m": "a"}), kind="rank", key="/k") == {"m": "a"}
    with pytest.raises(MalformedValue, match="/k does not hold TrainMover JSON"):
        decode(b"\x80garbage", kind="rank", key="/k")
    with pytest.raises(MalformedValue, match="envelope"):
        decode(b'{"a": 1}', kind="rank", key="/k")
    with pytest.raises(MalformedValue, match="'member' record where a 'rank'"):
        decode(encode("member", {}), kind="rank", key="/k")
    with pytest.raises(SchemaVersionError, match="schema version 0"):
        decode(encode("rank", {}, version=0), kind="rank", key="/k")


def test_job_token_gating_and_isolation(anykv):
    space = JobSpace.create(anykv, "job-a")
    assert len(space.token) >= 24
    again = JobSpace.create(anykv, "job-a", space.token)  # a second agent joining
    assert again.token == space.token
    with pytest.raises(AuthError, match="wrong job token"):
        JobSpace.open(anykv, "job-a", "not-the-token")
    with pytest.raises(AuthError, match="wrong job token"):
        JobSpace.create(anykv, "job-a", "not-the-token")
    with pytest.raises(StoreError, match="no job 'job-b'"):
        JobSpace.open(anykv, "job-b", "t")
    with pytest.raises(ConfigError, match="--tm-job"):
        JobSpace.open(anykv, "a/b", "t")
    # Jobs whose names share a prefix never see each other's keys.
    other = JobSpace.create(anykv, "job-ab")
    space.put(space.key("ranks", 0), b"a")
    other.put(other.key("ranks", 0), b"b")
    assert [e.value for e in anykv.get_prefix(space.root).entries if "ranks" in e.key] == [b"a"]
    with pytest.raises(StoreError, match="outside its namespace"):
        space.put(other.key("ranks", 1), b"x")
    # A process holding a stale token (the job was re-created) cannot write, and nothing is changed.
    anykv.put(space.job_key, encode("job", {"job": "job-a", "token_sha256": "0" * 64}))
    with pytest.raises(AuthError, match="record changed"):
        space.put(space.key("ranks", 0), b"evil")
    assert anykv.get(space.key("ranks", 0)).value == b"a"


def test_memory_leases_expire_on_the_injected_clock():
    now = [0.0]
    kv = MemoryKV(clock=lambda: now[0])
    lease = kv.grant_lease(2)
    kv.put("/m/a", b"x", lease=lease)
    now[0] = 1.5
    assert kv.refresh_lease(lease) == 2
    now[0] = 3.0
    assert kv.expire_leases() == []
    now[0] = 3.6
    assert kv.expire_leases() == [lease]
    assert kv.get("/m/a") is None and kv.refresh_lease(lease) == 0


def test_etcd_lease_expiry_deletes_keys(kv):
    lease = kv.grant_lease(1)
    kv.put("/l/a", b"x", lease=lease)
    assert kv.refresh_lease(lease) == 1
    t0 = time.monotonic()
    while kv.get("/l/a") is not None:
        assert time.monotonic() - t0 < 5, "a TTL-1 lease must expire within seconds"
        time.sleep(0.05)
    assert kv.refresh_lease(lease) == 0
    with pytest.raises(StoreError, match="lease"):
        kv.put("/l/b", b"x", lease=lease)


def _keepalive_streams_started(etcd) -> float:
    """etcd's own count of the LeaseKeepAlive streams it has served (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"{etcd.client_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_started_total") and 'grpc_method="LeaseKeepAlive"' in line
    )


def test_etcd_keepalives_of_a_lease_share_one_stream(etcd, kv):
    """Twenty renewals of one lease open one stream on etcd (pyetcd's refresh_lease opened one each); a
    second lease has its own; a lease etcd no longer knows answers 0 on it."""
    first, second = kv.grant_lease(5), kv.grant_lease(5)
    before = _keepalive_streams_started(etcd)
    assert [kv.refresh_lease(first) for _ in range(20)] == [5] * 20
    assert kv.refresh_lease(second) == 5
    assert _keepalive_streams_started(etcd) - before == 2
    kv.revoke_lease(second)
    assert kv.refresh_lease(second) == 0


def test_wait_prefix_sees_writes_made_after_the_read_and_times_out(anykv):
    from trainmover_ext.kv.base import wait_prefix

    anykv.put("/w/a", b"1")
    anykv.put("/w/gone", b"x")

    def writer():
        time.sleep(0.2)
        anykv.delete("/w/gone")
        anykv.put("/w/b", b"2")
        anykv.put("/w/c", b"3")

    t = threading.Thread(target=writer)
    t.start()
    values = wait_prefix(anykv, "/w/", lambda v: len(v) >= 3, 10)
    t.join()
    assert values == {"/w/a": b"1", "/w/b": b"2", "/w/c": b"3"}
    assert wait_prefix(anykv, "/w/", lambda v: len(v) >= 3, 0.1) == values  # already true: no watch
    t0 = time.monotonic()
    assert wait_prefix(anykv, "/w/", lambda v: len(v) >= 4, 0.3) is None
    assert time.monotonic() - t0 >= 0.3


def test_job_tokens_never_look_like_a_flag():
    """`--tm-job-token TOKEN` must parse whatever token was drawn (a leading '-' reads as a flag)."""
    from trainmover_ext.kv.job import new_token

    tokens = [new_token() for _ in range(2000)]
    assert all(t[0] != "-" and len(t) == 48 for t in tokens)
    assert len(set(tokens)) == len(tokens)


def test_a_watch_created_after_one_that_timed_out_hears_its_own_keys(etcd):
    """pyetcd binds a late "created" answer to whichever create waits then: after one watch's create timed
    out (etcd stalled), the next watch took over the first one's stream and never heard its own keys (a
    waiter that never woke). Each watch must hear exactly its own prefix."""
    import os
    import signal

    from trainmover_ext.errors import EtcdUnavailable
    from trainmover_ext.kv import EtcdClientConfig, EtcdKV

    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=1.0))
    heard: dict[str, list[str]] = {"a": [], "b": []}
    got_b = threading.Event()

    def hear(name):
        def on(events):
            heard[name].extend(e.key for e in events)
            got_b.set() if name == "b" else None

        return on

    kv.get("/warm")  # the channel is up before etcd stalls
    b_watch: list = []
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EtcdUnavailable):
            kv.watch_prefix("/a/", hear("a"))  # its creates reach etcd, their answers come late
        waiter = threading.Thread(target=lambda: b_watch.append(kv.watch_prefix("/b/", hear("b"))), daemon=True)
        waiter.start()
        time.sleep(0.3)  # b's create is queued behind a's on the stream
    finally:
        os.kill(etcd.pid, signal.SIGCONT)
    try:
        waiter.join(10)
        assert b_watch, "the second watch was never created"
        kv.put("/a/x", b"1")
        kv.put("/b/x", b"1")
        assert got_b.wait(5), f"the second watch never heard its own key; it heard {heard}"
        time.sleep(0.2)
        assert heard["b"] == ["/b/x"]
    finally:
        kv.close()
