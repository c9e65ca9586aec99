"""An abandon during an iteration's last collectives (``DeltaWorld.finishing``) ends them alike on every
member: no rank completes a collective that a peer loses (see ``nccl_delta.finishing``).

Four ranks all-reduce 4 MB in a loop, each op inside ``finishing`` as the optimizer step is; the test
process abandons the epoch at a random moment, every rank recovers, and the loop starts again, for
several rounds. Each round, every rank must have completed the same number of all-reduces, and be
free within 5 s of the abandon (the grace is 60 s: a rank waiting on a peer that stopped is
freed by the peer's published ledgers, not by the grace).

The same loop without ``finishing`` severs the links of the op in flight: a rank whose last receive
had arrived keeps the op and its neighbours lose it (``NCCL_DELTA_TEST_NO_FINISHING=1`` runs the
test that way, and it fails in most runs).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import torch
import torch.distributed as dist

import nccl_delta
from nccl_delta.errors import CommLinkError

from . import harness

ROUNDS = 12
WORLD = 4


def _rounds(rank, n, store, use_finishing):
    world = nccl_delta.current_world()
    watcher_store = store.clone()  # its own client: a blocked wait would stall the rank's store

    def watch():
        for epoch in range(1, ROUNDS + 1):
            watcher_store.wait([f"abandon/{epoch}"])
            world.abandon(epoch, f"test round {epoch}")

    threading.Thread(target=watch, daemon=True).start()
    t = torch.ones(1 << 20)
    rounds = []
    for epoch in range(1, ROUNDS + 1):
        done = 0
        store.set(f"looping/{epoch}/{rank}", "1")
        try:
            while True:
                with world.finishing() if use_finishing else contextlib.nullcontext():
                    dist.all_reduce(t)
                t.fill_(1.0)
                done += 1
        except CommLinkError as exc:
            raised, why = time.time(), f"{type(exc).__name__}: {exc}"
        world.recover(epoch)
        rounds.append(dict(done=done, raised=raised, why=why))
    x = torch.ones(1000)
    dist.all_reduce(x)
    return dict(rounds=rounds, sum=x[0].item())


def test_an_abandon_never_splits_a_collective_in_the_finishing_block():
    use_finishing = os.environ.get("NCCL_DELTA_TEST_NO_FINISHING") != "1"
    rng = random.Random(7)
    store = harness.host_store()
    ranks = harness.spawn(WORLD, _rounds, use_finishing, store=store, config=harness.test_config(finish_grace_s=60.0))
    abandoned_at = []
    try:
        for epoch in range(1, ROUNDS + 1):
            store.wait([f"looping/{epoch}/{r}" for r in range(WORLD)])
            time.sleep(rng.uniform(0.05, 0.4))
            abandoned_at.append(time.time())
            store.set(f"abandon/{epoch}", "1")
        results = ranks.results(timeout=120)
    finally:
        ranks.kill_all()
    assert {r: v["sum"] for r, v in results.items()} == dict.fromkeys(range(WORLD), float(WORLD))
    for i, at in enumerate(abandoned_at):
        done = {r: v["rounds"][i]["done"] for r, v in results.items()}
        why = {r: v["rounds"][i]["why"] for r, v in results.items()}
        assert len(set(done.values())) == 1, f"round {i + 1}: all-reduces completed per rank differ: {done} {why}"
        late = {r: round(v["rounds"][i]["raised"] - at, 2) for r, v in results.items()}
        assert max(late.values()) < 5.0, f"round {i + 1}: seconds from the abandon to each rank's error: {late}"
