"""Two-phase swap under load: logical rank 3 of a 4-rank world moves to a new process.

Groups: WORLD, LOAD=[0,1,2] (without 3), B=[1,2,3], C=[0,3]. While phase 1
runs in the background, ranks 0-2 keep all-reducing on LOAD and must never
block. After phase 2 every group containing 3 gives results bit-identical to
those before the swap (same inputs, same group order); each stayer swapped only
its groups with 3, and LOAD keeps the very communicator it had.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import nccl_delta

from . import harness

EPOCH = 1
SPECS = {"LOAD": [0, 1, 2], "B": [1, 2, 3], "C": [0, 3]}
CONFIG = dict(segment_bytes=4096, small_bytes=256)


def _groups(rank):
    made = {"WORLD": dist.group.WORLD}
    for name, ranks in SPECS.items():
        group = dist.new_group(ranks)  # every process creates every group, in the same order
        if rank in ranks:
            made[name] = group
    return made


def _reduce_all(rank, groups):
    out = {}
    for name, group in groups.items():
        if name == "LOAD":
            continue
        t = torch.randn(3001, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
        dist.all_reduce(t, group=group)
        out[name] = t.numpy().tobytes()
    return out


def _stayer(rank, n, store):
    groups = _groups(rank)
    before = _reduce_all(rank, groups)
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])
    world = nccl_delta.current_world()
    load_comm = world.groups[groups["LOAD"].group_name].comms["cpu"]
    swap = world.prepare(3, EPOCH, joiner="test-joiner")
    latencies, during_phase1 = [], 0
    wrong = 0
    for _ in range(120):
        load = torch.ones(2000)
        t0 = time.perf_counter()
        dist.all_reduce(load, group=groups["LOAD"])
        wrong += not bool((load == 3.0).all())
        latencies.append(time.perf_counter() - t0)
        during_phase1 += not swap.done.is_set()
        time.sleep(0.004)
    report = world.switch(EPOCH)
    after = _reduce_all(rank, groups)
    return dict(
        before=before,
        after=after,
        max_latency=max(latencies),
        during_phase1=during_phase1,
        links_touched=report.links_touched,
        groups_switched=report.groups_switched,
        load_kept=world.groups[groups["LOAD"].group_name].comms["cpu"] is load_comm,
        switch_s=report.switch_s,
        wrong=wrong,
    )


def _leaver(rank, n, store):
    before = _reduce_all(rank, _groups(rank))
    store.set(f"ready/{rank}", "1")
    store.wait(["leave"])
    return dict(before=before)


def _joiner(rank, n, store):
    groups = _groups(rank)
    time.sleep(0.5)  # phase 1 on the stayers must overlap their training loop
    t0 = time.perf_counter()
    nccl_delta.current_world().join(EPOCH)
    join_s = time.perf_counter() - t0
    return dict(after=_reduce_all(rank, groups), join_s=join_s)


def test_swap_under_load_is_bit_identical():
    store = harness.host_store()
    queue = harness.CTX.Queue()
    config = harness.test_config(**CONFIG)
    stayers = harness.spawn(4, _stayer, ranks=[0, 1, 2], store=store, queue=queue, config=config)
    leaver = harness.spawn(4, _leaver, ranks=[3], store=store, queue=queue, config=config)
    try:
        store.wait([f"ready/{r}" for r in range(4)])
        store.set("go", "1")
        joiner = harness.spawn(
            4, _joiner, ranks=[3], keys=["joiner"], store=store, queue=queue, config=config, join_epoch=EPOCH
        )
        both = harness.Ranks(procs={**stayers.procs, **joiner.procs}, queue=queue, store=store)
        results = both.results(timeout=120)
        store.set("leave", "1")
        results.update(harness.Ranks(procs=leaver.procs, queue=queue, store=store).results(timeout=30))
    finally:
        for ranks in (stayers, leaver):
            ranks.kill_all()

    old3 = results[3]["before"]
    new3 = results["joiner"]["after"]
    assert new3 == old3, "the joiner's results differ bitwise from the leaver's"
    for rank in (0, 1, 2):
        r = results[rank]
        assert r["after"] == r["before"], f"rank {rank}: results after the swap differ bitwise"
        assert r["wrong"] == 0, "the load group computed a wrong sum"
        assert r["during_phase1"] >= 10, f"rank {rank}: only {r['during_phase1']} ops overlapped phase 1"
        assert r["max_latency"] < 0.3, f"rank {rank}: a LOAD all-reduce blocked for {r['max_latency']:.3f}s"
        assert r["load_kept"], f"rank {rank}: LOAD (without rank 3) got a new communicator"
    # Only the groups with rank 3 are swapped: rank 0 (C), rank 1 (B), rank 2 (B); and WORLD's ring
    # links to 3: ranks 0 and 2 are its neighbours in WORLD's ring.
    assert [results[r]["groups_switched"] for r in (0, 1, 2)] == [1, 1, 1]
    assert [results[r]["links_touched"] for r in (0, 1, 2)] == [1, 0, 1]
