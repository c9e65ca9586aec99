"""Failures: a SIGKILLed peer raises CommLinkError fast; abandon unblocks ops stuck on a hung peer.

Rings of 4 ranks all-reduce in a loop. Each rank reports when and how its op
failed; the test process acts as the control plane (kills, stops, and sets
an ``abandon`` key that each rank's watcher thread turns into
``world.abandon``).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import torch
import torch.distributed as dist

import nccl_delta
from nccl_delta.errors import CommLinkError

from . import harness


def _loop_until_error(rank, n, store, watch_abandon):
    world = nccl_delta.current_world()
    if watch_abandon:
        watcher_store = store.clone()  # its own client: a blocked wait would stall the rank's store

        def watch():
            watcher_store.wait(["abandon"])
            world.abandon(1, "test control plane declared rank 2 gone")

        threading.Thread(target=watch, daemon=True).start()
    t = torch.ones(50000)
    store.set(f"looping/{rank}", "1")
    iterations = 0
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1.0)
            iterations += 1
    except CommLinkError as exc:
        return dict(at=time.time(), kind=type(exc).__name__, msg=str(exc), iterations=iterations)


def test_sigkill_raises_comm_link_error_within_1s():
    ranks = harness.spawn(4, _loop_until_error, False)
    try:
        ranks.store.wait([f"looping/{r}" for r in range(4)])
        time.sleep(0.3)
        killed_at = time.time()
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        results = ranks.results(timeout=60, expect={0, 1, 3})
    finally:
        ranks.kill_all()
    for rank in (1, 3):  # the neighbours of rank 2 in the ring
        r = results[rank]
        assert r["at"] - killed_at < 1.0, f"rank {rank} raised {r['at'] - killed_at:.2f}s after the kill"
        assert r["kind"] == "CommLinkError"
        assert "group '0'" in r["msg"] and "allreduce(SUM)" in r["msg"], r["msg"]
        # The failing link's peer is named first; rank 1 may see the sever cascade (3 -> 0 -> 1)
        # before its own send to 2 fails, so the dead rank is then named among the closed peers.
        closed = re.search(r"connection closed: ranks \[([\d, ]*)\]", r["msg"])
        assert "peer rank 2 " in r["msg"] or (closed and "2" in closed.group(1).split(", ")), r["msg"]
    assert "peer rank 2 " in results[3]["msg"], "rank 3 receives from rank 2: it must see the death directly"
    # Rank 0 is not a neighbour: the neighbours sever their ring links, so it fails fast too.
    assert results[0]["at"] - killed_at < 1.0


def test_abandon_unblocks_ops_waiting_on_a_hung_peer():
    results, abandoned_at = harness.hang_then_abandon(_loop_until_error, True)
    for rank in (0, 1, 3):
        r = results[rank]
        assert r["at"] >= abandoned_at, f"rank {rank} failed before abandon: {r['msg']}"
        assert r["at"] - abandoned_at < 1.0, f"rank {rank} unblocked {r['at'] - abandoned_at:.2f}s after abandon"
        # A rank sees its own abandon, or (under load) the sever of a neighbour that abandoned first.
        assert r["kind"] in ("CommAbandoned", "CommLinkError"), r
    assert any(results[r]["kind"] == "CommAbandoned" for r in (0, 1, 3)), results


def test_abandon_unblocks_a_pair_all_reduce_waiting_on_a_hung_peer():
    """A 2-member group all-reduces with the pair's own gloo all-reduce, waited for on the caller's thread
    through its future; gloo leaves that op pending when the pair is shut down, so only the cancel of the
    wait by the sever frees the caller."""
    ranks = harness.spawn(2, _loop_until_error, True)
    try:
        ranks.store.wait([f"looping/{r}" for r in range(2)])
        time.sleep(0.3)
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)
        time.sleep(1.0)
        abandoned_at = time.time()
        ranks.store.set("abandon", "1")
        results = ranks.results(timeout=30, expect={0})
    finally:
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.kill_all()
    r = results[0]
    assert r["kind"] == "CommAbandoned", r
    assert abandoned_at <= r["at"] < abandoned_at + 1.0, f"unblocked {r['at'] - abandoned_at:.2f}s after abandon"
    assert not ranks.procs[0].is_alive()


EPOCH = 1


def _survivor(rank, n, store):
    """Fail on the kill, abandon, recover in the next epoch with a joiner for rank 2, then all-reduce."""
    world = nccl_delta.current_world()
    store.set(f"looping/{rank}", "1")
    t = torch.ones(20000)
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1.0)
    except CommLinkError:
        pass
    world.abandon(EPOCH, "rank 2 died")
    store.set(f"abandoned/{rank}", "1")
    world.recover(EPOCH, replaced={2})
    x = torch.full((10001,), float(rank + 1))
    dist.all_reduce(x)
    return x[0].item()


def _replacement(rank, n, store):
    nccl_delta.current_world().join(EPOCH)
    x = torch.full((10001,), float(rank + 1))
    dist.all_reduce(x)
    return x[0].item()


def test_recover_after_kill_with_joiner():
    store = harness.host_store()
    queue = harness.CTX.Queue()
    ranks = harness.spawn(4, _survivor, store=store, queue=queue)
    try:
        store.wait([f"looping/{r}" for r in range(4)])
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        ranks.procs[2].join(5)
        store.wait([f"abandoned/{r}" for r in (0, 1, 3)])
        joiner = harness.spawn(4, _replacement, ranks=[2], keys=["joiner"], store=store, queue=queue, join_epoch=EPOCH)
        both = harness.Ranks(procs={**{r: ranks.procs[r] for r in (0, 1, 3)}, **joiner.procs}, queue=queue, store=store)
        results = both.results(timeout=60)
    finally:
        ranks.kill_all()
    assert set(results.values()) == {10.0}, results


def _stayer_keeping_links(rank, n, store):
    """All-reduce once; ranks 0 and 1 leave a send and a receive in flight; then abandon and recover."""
    world = nccl_delta.current_world()
    x = torch.ones(1000)
    dist.all_reduce(x)
    if rank == 0:
        dist.isend(torch.ones(4), dst=1, tag=5)  # never waited for: in flight at the abandon
    elif rank == 1:
        dist.irecv(torch.zeros(4), src=0, tag=5)
    if rank in (0, 1):  # the pair is built in the background: up before the abandon, or nothing is cut
        assert world.pairs[1 - rank].settled(30.0)
    store.set(f"idle/{rank}", "1")
    store.wait(["abandon"])
    severed = world.abandon(EPOCH, "rank 3 left", dead={3})
    report = world.recover(EPOCH, replaced={3})
    got = None
    if rank == 0:
        dist.send(torch.full((4,), 7.0), dst=1, tag=5)
    elif rank == 1:
        t = torch.zeros(4)
        dist.recv(t, src=0, tag=5)
        got = t[0].item()  # 7.0: the link was rebuilt, nothing of the old one is matched
    y = torch.full((10001,), float(rank + 1))  # the size _replacement all-reduces
    dist.all_reduce(y)
    return dict(severed=severed, kept=report.kept, rebuilt=report.rebuilt, got=got, sum=y[0].item())


def _leaving_rank(rank, n, store):
    dist.all_reduce(torch.ones(1000))
    store.set(f"idle/{rank}", "1")
    return "left"


def test_recover_keeps_idle_links_whose_ledgers_match():
    """WORLD's ring 0-1-2-3, rank 3 replaced. Links 0-1 and 1-2 (idle, ledgers match) survive the
    recovery; WORLD's point-to-point between 0 and 1 goes over their pair communicator, which had a send
    and a receive in flight, so it is cut and built again on first use (the next message arrives
    whole); links 0-3 and 2-3 go to the joiner."""
    store = harness.host_store()
    queue = harness.CTX.Queue()
    ranks = harness.spawn(4, _stayer_keeping_links, ranks=[0, 1, 2], store=store, queue=queue)
    leaver = harness.spawn(4, _leaving_rank, ranks=[3], keys=["leaver"], store=store, queue=queue)
    try:
        store.wait([f"idle/{r}" for r in range(4)])
        assert leaver.results(timeout=30) == {"leaver": "left"}
        store.set("abandon", "1")
        joiner = harness.spawn(4, _replacement, ranks=[3], keys=["joiner"], store=store, queue=queue, join_epoch=EPOCH)
        both = harness.Ranks(procs={**ranks.procs, **joiner.procs}, queue=queue, store=store)
        results = both.results(timeout=60)
    finally:
        ranks.kill_all()
    assert results["joiner"] == 10.0
    stayers = {r: results[r] for r in (0, 1, 2)}
    assert {r: v["sum"] for r, v in stayers.items()} == {0: 10.0, 1: 10.0, 2: 10.0}
    assert stayers[1]["got"] == 7.0
    # rank: (links kept, ring links rebuilt, links and communicators cut by the abandon)
    assert {r: (v["kept"], v["rebuilt"], v["severed"]) for r, v in stayers.items()} == {
        0: (1, 1, 2),  # link 0-3 and the busy pair 0-1 cut
        1: (2, 0, 1),  # the pair 0-1
        2: (1, 1, 1),  # link 2-3
    }, stayers
