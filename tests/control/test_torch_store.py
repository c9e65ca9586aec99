"""EtcdStore: the torch Store contract, init_process_group and megatron-core group creation in forked processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

# megatron-core is imported before forking so that children do not each pay the import.
from megatron.core import parallel_state

from trainmover_ext.errors import StoreTimeout
from trainmover_ext.kv.torch_store import EtcdStore


@pytest.fixture
def store(etcd):
    s = EtcdStore(etcd.endpoints, prefix="/trainmover/t/store/0/", timeout=5)
    yield s
    s.close()


def test_store_api(store):
    store.set("a", b"hello")
    assert store.get("a") == b"hello"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    assert store.get("n") == b"2"
    assert store.compare_set("c", b"", b"first") == b"first"
    assert store.compare_set("c", b"wrong", b"second") == b"first"
    assert store.compare_set("c", b"first", b"second") == b"second"
    assert store.compare_set("missing", b"x", b"y") == b"x" and not store.check(["missing"])
    assert store.check(["a", "n"]) and not store.check(["a", "zzz"])
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 2
    store.append("ap", b"x")
    store.append("ap", b"y")
    assert store.get("ap") == b"xy"
    store.multi_set(["m1", "m2"], [b"1", b"2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]


def test_wait_blocks_until_set_and_times_out(store):
    threading.Timer(0.2, lambda: store.set("late", b"1")).start()
    t0 = time.monotonic()
    store.wait(["late"], timedelta(seconds=5))
    assert 0.15 < time.monotonic() - t0 < 2
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="'never'"):
        store.wait(["never"], timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 1.5
    # get() blocks like TCPStore's, bounded by the store timeout; the error is a TimeoutError.
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(TimeoutError):
        store.get("never-either")


def test_a_watch_that_never_fires_costs_a_recheck_not_the_timeout(monkeypatch):
    """pyetcd can bind a new watch's callback to another watch after a create timed out; the waiter then
    never hears of its key. Waits re-read the key every RECHECK_S, so they still see it."""
    import trainmover_ext.kv.base as kv_base
    from trainmover_ext.kv.memory import MemoryKV

    class DeafKV(MemoryKV):
        def watch_prefix(self, prefix, callback, *, start_revision=0):
            return super().watch_prefix(prefix, lambda events: None, start_revision=start_revision)

    monkeypatch.setattr(kv_base, "RECHECK_S", 0.1)
    store = EtcdStore(["unused:1"], prefix="/t/deaf/", timeout=10, kv=DeafKV())
    threading.Timer(0.2, lambda: store.set("late", b"v")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(StoreTimeout):
        store.wait(["never"], timedelta(seconds=0.35))
    # the same safety net under wait_prefix (the stayers' wait for each other's iteration)
    from trainmover_ext.kv.base import wait_prefix

    kv = store._kv()
    threading.Timer(0.2, lambda: kv.put("/t/deaf/it/1", b"5")).start()
    got = wait_prefix(kv, "/t/deaf/it/", lambda values: len(values) >= 1, timeout_s=5.0)
    assert got == {"/t/deaf/it/1": b"5"}
    assert wait_prefix(kv, "/t/deaf/none/", lambda values: bool(values), timeout_s=0.3) is None


def test_concurrent_adds_are_exact(store):
    threads = [threading.Thread(target=lambda: [store.add("ctr", 1) for _ in range(20)]) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert store.get("ctr") == b"80"


def _gloo_worker(store, rank, world, queue):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    queue.put(("allreduce", rank, t.item()))
    dist.destroy_process_group()


def _megatron_worker(store, rank, world, queue):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
    queue.put(
        (
            "megatron",
            rank,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            t.item(),
        )
    )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _run_forked(target, store, world):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(store, r, world, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = sorted(queue.get(timeout=5) for _ in range(world))
    assert [p.exitcode for p in procs] == [0] * world
    return results


def test_init_process_group_on_etcd_store(etcd):
    # The parent uses the store before forking: each child must open its own etcd connection.
    store = EtcdStore(etcd.endpoints, prefix="/trainmover/t/store/gloo/", timeout=60)
    store.set("parent", b"1")
    results = _run_forked(_gloo_worker, store, 3)
    assert results == [("allreduce", r, 6.0) for r in range(3)]
    # No TCPStore: the rendezvous keys are in etcd.
    assert store.num_keys() > 1


def test_megatron_group_creation_on_etcd_store(etcd):
    store = EtcdStore(etcd.endpoints, prefix="/trainmover/t/store/mcore/", timeout=60)
    results = _run_forked(_megatron_worker, store, 4)
    # TP groups are {0,1} and {2,3}; PP groups are {0,2} and {1,3}.
    assert results == [
        ("megatron", 0, 0, 0, 1.0),
        ("megatron", 1, 1, 0, 1.0),
        ("megatron", 2, 0, 1, 5.0),
        ("megatron", 3, 1, 1, 5.0),
    ]


def test_connect_opens_the_one_client_before_threads_call_the_store(etcd, monkeypatch):
    """A joiner's link threads call the store from several gloo constructors at once: ``connect()``
    (called by ``rank_store``) has opened the process's one client before, so none of them logs in."""
    import trainmover_ext.kv.torch_store as torch_store

    opened = []
    real = torch_store.EtcdKV
    monkeypatch.setattr(torch_store, "EtcdKV", lambda config: opened.append(config) or real(config))
    s = EtcdStore(etcd.endpoints, prefix="/trainmover/t/store/conn/", timeout=5)
    try:
        assert opened == []
        assert s.connect() is s and len(opened) == 1
        threads = [threading.Thread(target=s.set, args=(f"k{i}", b"v")) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(opened) == 1 and s.num_keys() == 8
    finally:
        s.close()


class _AnswerLostOnce:
    """The real etcd KV, except that the first commit is sent twice, as ``EtcdKV`` retries an attempt whose
    answer was lost: the first applies, the second (whose guard now fails) is the answer the caller sees."""

    def __init__(self, kv):
        self._kv, self.lost = kv, 0

    def commit(self, guards, ops):
        if self.lost == 0:
            self.lost += 1
            self._kv.commit(guards, ops)
        return self._kv.commit(guards, ops)

    def __getattr__(self, name):
        return getattr(self._kv, name)


@pytest.mark.parametrize("op", ["add", "append"])
def test_an_applied_attempt_whose_answer_was_lost_is_not_applied_again(kv, op):
    store = EtcdStore(["unused:0"], prefix=f"/trainmover/t/store/lost-{op}/", timeout=5, kv=_AnswerLostOnce(kv))
    if op == "add":
        assert store.add("n", 5) == 5
        assert store.get("n") == b"5" and store.add("n", 1) == 6
    else:
        store.append("a", b"x")
        assert store.get("a") == b"x"
    assert store.num_keys() == 1  # no receipt left, none counted
    assert kv.get_prefix(store.prefix).entries[0].key == store.prefix + ("n" if op == "add" else "a")
