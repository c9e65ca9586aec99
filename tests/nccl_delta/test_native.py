"""Groups on their native communicators: failures and recovery.

Every group but WORLD runs on torch's own ProcessGroupGloo here (ProcessGroupNCCL on a GPU). These tests
check that a dead member is named, that an abandon unblocks an op waiting on a hung peer, and that a
recovery keeps the idle groups and rebuilds the others. That each op is one backend call (megatron's
overlapped gradient reduction one call per bucket) is tests/training/test_native_calls.py: it needs
megatron's DDP, which runs on CPU only with TrainMover's patches.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import nccl_delta
from nccl_delta.errors import CommAbandoned, CommLinkError
from nccl_delta.native_group import ledgers_agree

from . import harness

# --- failures -----------------------------------------------------------------------------------


def _loop_on_group(rank, n, store):
    world = nccl_delta.current_world()
    group = dist.new_group(list(range(n)))
    watcher_store = store.clone()

    def watch():
        watcher_store.wait(["abandon"])
        world.abandon(1, "test control plane declared rank 2 gone", dead={2})

    threading.Thread(target=watch, daemon=True).start()
    t = torch.ones(50000)
    store.set(f"looping/{rank}", "1")
    while True:
        try:
            dist.all_reduce(t, group=group)
        except CommLinkError as exc:
            described = world.describe()  # what a stall dump prints: the cut group, its state
            return dict(
                at=time.time(), kind=type(exc).__name__, msg=str(exc), peers=list(exc.peers), described=described
            )
        t.fill_(1.0)


def test_sigkill_in_a_group_collective_names_the_dead_rank():
    """Rank 2 of a 4-rank group is killed in a loop of all-reduces: a member whose connection to it
    closed raises CommLinkError naming rank 2 at once. gloo then closes that member's other connections
    of the group, so a third member may name it instead (a suspicion the control plane checks with the
    suspect's agent); every live member is free within a second of the control plane's abandon."""
    ranks = harness.spawn(4, _loop_on_group)
    try:
        ranks.store.wait([f"looping/{r}" for r in range(4)])
        time.sleep(0.3)
        killed_at = time.time()
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        time.sleep(1.0)
        abandoned_at = time.time()
        ranks.store.set("abandon", "1")
        results = ranks.results(timeout=60, expect={0, 1, 3})
    finally:
        ranks.kill_all()
    named = [r for r in (0, 1, 3) if 2 in results[r]["peers"]]
    assert named, f"no member named rank 2: {results}"
    for rank in named:
        assert results[rank]["peers"] == [2] and results[rank]["kind"] == "CommLinkError", results[rank]
        assert results[rank]["at"] - killed_at < 1.0, results[rank]
    for rank in (0, 1, 3):
        assert results[rank]["at"] < abandoned_at + 1.0, (rank, results[rank])


def test_abandon_unblocks_a_group_collective_waiting_on_a_hung_peer():
    results, abandoned_at = harness.hang_then_abandon(_loop_on_group)
    for rank in (0, 1, 3):
        r = results[rank]
        assert abandoned_at <= r["at"] < abandoned_at + 1.0, f"rank {rank} unblocked {r['at'] - abandoned_at:.2f}s"
        assert r["kind"] in ("CommAbandoned", "CommLinkError"), r
        # What a stall dump prints: the cut group and its state (broken when the peer's close came first).
        assert "NativeGroup('" in r["described"] and (", aborted)" in r["described"] or ", broken)" in r["described"])
    assert any(results[r]["kind"] == "CommAbandoned" for r in (0, 1, 3)), results


def _blocked_on_the_hung_rank(rank, n, store, op="mixed"):
    """Until the abandon cuts the group: rank 0 receives from rank 2, rank 1 sends it 16 MB and rank 3
    all-reduces (``mixed``); or every rank but the hung one runs ``op`` (the distributed optimizer's
    gradient reduce-scatter or parameter all-gather)."""
    world = nccl_delta.current_world()
    group = dist.new_group(list(range(n)))
    dist.all_reduce(torch.ones(8), group=group)  # builds the communicator
    severable = world.groups[group.group_name].comms["cpu"].severable
    watcher_store = store.clone()

    def watch():
        watcher_store.wait(["abandon"])
        world.abandon(1, "test control plane declared rank 2 gone", dead={2})

    threading.Thread(target=watch, daemon=True).start()
    store.set(f"looping/{rank}", "1")
    if rank == 2:
        time.sleep(120)  # stopped by the test
    try:
        if op == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(torch.zeros(1024), torch.ones(1024 * n), group=group)
        elif op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(torch.zeros(1024 * n), torch.ones(1024), group=group)
        elif rank == 0:
            dist.recv(torch.zeros(4), src=2, group=group)
        elif rank == 1:
            dist.send(torch.ones(4 << 20), dst=2, group=group)
        else:
            dist.all_reduce(torch.ones(4), group=group)
    except CommLinkError as exc:
        return dict(at=time.time(), kind=type(exc).__name__, severable=severable)
    return dict(at=None, kind="completed", severable=severable)


def _each_unblocked_within_a_second(results, abandoned_at):
    for rank in (0, 1, 3):
        r = results[rank]
        assert r["severable"], f"rank {rank}: the group's sockets were not identified; this tests nothing"
        assert r["kind"] in ("CommAbandoned", "CommLinkError"), (rank, r)
        assert abandoned_at <= r["at"] < abandoned_at + 1.0, f"rank {rank} unblocked {r['at'] - abandoned_at:.2f}s"


def test_an_abandon_ends_a_receive_a_send_and_a_collective_blocked_on_a_hung_peer():
    """The abandon's socket cut itself ends every kind of op pending on a hung peer, each within a second:
    sooner than the cancel of a wait gloo leaves pending (``ABORT_SETTLE_S`` after the cut)."""
    _each_unblocked_within_a_second(*harness.hang_then_abandon(_blocked_on_the_hung_rank))


@pytest.mark.parametrize("op", ["reduce_scatter_tensor", "all_gather_into_tensor"])
def test_an_abandon_ends_the_distributed_optimizer_s_collectives_at_once(op):
    """gloo's reduce-scatter is a composite work that never reports itself completed: its failure after
    the cut must end the wait at once, not at the cancel ``ABORT_SETTLE_S`` (2 s) later. Seen failing,
    every rank 2.02 s after the abandon, with the failure taken for a slice that ran out (a stayer of a
    distributed-optimizer job then reached recovery 2 s late)."""
    _each_unblocked_within_a_second(*harness.hang_then_abandon(_blocked_on_the_hung_rank, op))


def _late_peer(rank, n, store):
    from nccl_delta.waiter import SLICE_S

    group = dist.new_group(list(range(n)))
    dist.all_reduce(torch.ones(4), group=group)  # builds the communicator
    t = torch.full((1000,), float(rank + 1))
    if rank == 1:
        time.sleep(8 * SLICE_S)
    started = time.monotonic()
    dist.all_reduce(t, group=group)
    waited = time.monotonic() - started
    after = torch.full((4,), float(rank + 1))
    dist.all_reduce(after, group=group)
    message = torch.full((4,), 7.0) if rank == 0 else torch.zeros(4)
    dist.send(message, dst=1, group=group) if rank == 0 else dist.recv(message, src=0, group=group)
    state = nccl_delta.current_world().groups[group.group_name].state
    return dict(
        waited=waited,
        slices=waited / SLICE_S,
        sum=t[0].item(),
        after=after[0].item(),
        message=message[0].item(),
        state=state,
    )


def test_a_collective_waited_for_in_slices_keeps_its_communicator():
    """A gloo collective is waited for on the training thread in slices (c10d's timed wait raises when a
    slice runs out and leaves the op running; gloo's own timed-out send or receive would close its pair):
    a member that waits through several slices for a late peer gets the right sum, and the same group
    then runs an all-reduce, a send and a receive."""
    results = harness.run(2, _late_peer)
    assert results[0]["slices"] >= 5, f"the wait never outlasted a slice; this tests nothing: {results[0]}"
    for rank in (0, 1):
        r = results[rank]
        assert (r["sum"], r["after"], r["message"], r["state"]) == (3.0, 3.0, 7.0, "open"), (rank, r)


# --- recovery: what is kept, what is rebuilt ----------------------------------------------------

EPOCH = 1
SPECS = {"A": [0, 1], "B": [1, 2], "C": [0, 3], "D": [0, 1, 2], "E": [0, 1, 2, 3]}


def _make_groups(rank):
    made = {}
    for name, members in SPECS.items():
        group = dist.new_group(members)
        if rank in members:
            made[name] = group
    return made


def _stayer(rank, n, store):
    """Groups A (busy at the abandon), B and D (idle), C (with the replaced rank 3), E (the whole job:
    dropped, and built again by its next op)."""
    world = nccl_delta.current_world()
    groups = _make_groups(rank)
    for group in groups.values():
        dist.all_reduce(torch.ones(100), group=group)
    before = {name: world.groups[g.group_name].comms["cpu"] for name, g in groups.items()}
    if rank == 0:
        dist.isend(torch.ones(4), dst=1, group=groups["A"])  # never waited for: A is busy at the abandon
    elif rank == 1:
        dist.irecv(torch.zeros(4), src=0, group=groups["A"])
    store.set(f"idle/{rank}", "1")
    store.wait(["abandon"])
    world.abandon(EPOCH, "rank 3 left", dead={3})
    try:
        dist.all_reduce(torch.ones(4), group=groups.get("B", groups.get("D")))
        refused = None
    except CommAbandoned as exc:
        refused = type(exc).__name__
    report = world.recover(EPOCH, replaced={3})
    unbuilt = sorted(name for name, g in groups.items() if not world.groups[g.group_name].comms)
    kept = sorted(name for name, g in groups.items() if world.groups[g.group_name].comms.get("cpu") is before[name])
    sums = {}
    for name, group in groups.items():
        x = torch.full((1001,), float(rank + 1))
        dist.all_reduce(x, group=group)
        sums[name] = x[0].item()
    return dict(
        kept=kept,
        unbuilt=unbuilt,
        refused=refused,
        sums=sums,
        report=(report.groups_kept, report.groups_rebuilt, report.members_rebuilt),
    )


def _leaver(rank, n, store):
    groups = _make_groups(rank)
    for group in groups.values():
        dist.all_reduce(torch.ones(100), group=group)
    store.set(f"idle/{rank}", "1")
    return "left"


def _joiner(rank, n, store):
    groups = _make_groups(rank)
    nccl_delta.current_world().join(EPOCH)
    sums = {}
    for name in ("C", "E"):
        x = torch.full((1001,), float(rank + 1))
        dist.all_reduce(x, group=groups[name])
        sums[name] = x[0].item()
    return sums


def test_recover_keeps_idle_groups_and_rebuilds_the_busy_ones_and_those_of_the_replaced_rank():
    store = harness.host_store()
    queue = harness.CTX.Queue()
    stayers = harness.spawn(4, _stayer, ranks=[0, 1, 2], store=store, queue=queue)
    leaver = harness.spawn(4, _leaver, ranks=[3], keys=["leaver"], store=store, queue=queue)
    try:
        store.wait([f"idle/{r}" for r in range(4)])
        assert leaver.results(timeout=30) == {"leaver": "left"}
        store.set("abandon", "1")
        joiner = harness.spawn(4, _joiner, ranks=[3], keys=["joiner"], store=store, queue=queue, join_epoch=EPOCH)
        both = harness.Ranks(procs={**stayers.procs, **joiner.procs}, queue=queue, store=store)
        results = both.results(timeout=90)
    finally:
        stayers.kill_all()
    assert results["joiner"] == {"C": 5.0, "E": 10.0}  # ranks 0 and 3 in C; everyone in E
    assert results[0]["kept"] == ["D"] and results[1]["kept"] == ["B", "D"] and results[2]["kept"] == ["B", "D"]
    # (groups kept, groups rebuilt, their members): rank 0 rebuilt A (busy) and C (rank 3's)
    assert [results[r]["report"] for r in (0, 1, 2)] == [(1, 2, 4), (2, 1, 2), (2, 0, 0)], results
    assert all(results[r]["refused"] == "CommAbandoned" for r in (0, 1, 2)), results
    assert all(results[r]["unbuilt"] == ["E"] for r in (0, 1, 2)), "the whole job's group was rebuilt"
    expected = {"A": 3.0, "B": 5.0, "C": 5.0, "D": 6.0, "E": 10.0}
    for rank in (0, 1, 2):
        assert results[rank]["sums"] == {k: v for k, v in expected.items() if k in results[rank]["sums"]}


def _stayer_abandoned_again_while_it_rebuilds(rank, n, store):
    """Ranks 0 and 1 share group A, busy at epoch 1's abandon, so recover(1) rebuilds it. On rank 0 the
    control plane abandons epoch 2 while A's new communicator is being built (after the build, before the
    install), as CI's cascade saw when the joiner of epoch 1 died in its promotion."""
    import nccl_delta.delta as delta

    world = nccl_delta.current_world()
    group = dist.new_group([0, 1])
    dist.new_group([1, 2])
    if rank < 2:
        dist.all_reduce(torch.ones(100), group=group)
        if rank == 0:
            dist.isend(torch.ones(4), dst=1, group=group)  # never waited for: A is busy at the abandon
        else:
            dist.irecv(torch.zeros(4), src=0, group=group)
    store.set(f"idle/{rank}", "1")
    store.wait(["abandon"])
    world.abandon(EPOCH, "a rank failed")
    if rank == 0:
        built = delta.build_groups

        def build_then_abandon_again(*args, **kwargs):
            comms = built(*args, **kwargs)
            world.abandon(EPOCH + 1, "the joiner of epoch 1 died")
            return comms

        delta.build_groups = build_then_abandon_again
    try:
        world.recover(EPOCH)
        outcome = "recovered"
    except CommAbandoned as exc:
        outcome = str(exc)
    states = {"A": world.groups[group.group_name].state} if rank < 2 else {}
    return dict(outcome=outcome, states=states)


def test_an_abandon_that_comes_while_recover_rebuilds_leaves_nothing_open():
    """A newer epoch's abandon that comes while ``recover`` builds its epoch's communicators is not undone
    by their install: recover cuts what it reopened and says it was superseded, so the rank recovers the
    newer epoch with its peers instead of training on in the old one (where it would wait on a peer that
    left for the newer epoch until the joiner's deadline). The other member, abandoned after its recover,
    recovered as usual; the newer abandon reaches it the usual way."""
    store = harness.host_store()
    ranks = harness.spawn(3, _stayer_abandoned_again_while_it_rebuilds, store=store)
    try:
        store.wait([f"idle/{r}" for r in range(3)])
        store.set("abandon", "1")
        results = ranks.results(timeout=60)
    finally:
        ranks.kill_all()
    assert "recover(1) superseded while it rebuilt: epoch 2 abandoned" in results[0]["outcome"], results
    assert results[0]["states"]["A"] in ("quiet", "aborted"), results  # not open behind epoch 2's back
    assert results[1] == {"outcome": "recovered", "states": {"A": "open"}}, results
    assert results[2]["outcome"] == "recovered", results


# --- the keep rule (pure) -----------------------------------------------------------------------


def _ledger(coll=3, gen=0, sent=None, received=None):
    return {"generation": gen, "collectives": coll, "sent": sent or {}, "received": received or {}}


def test_a_group_is_kept_only_when_every_members_ledger_agrees():
    assert ledgers_agree({0: _ledger(), 1: _ledger(), 2: _ledger()})
    assert ledgers_agree({0: _ledger(sent={"1": 2}), 1: _ledger(received={"0": 2})})
    assert not ledgers_agree({0: _ledger(), 1: None}), "a member that cut the group"
    assert not ledgers_agree({0: _ledger(coll=3), 1: _ledger(coll=4)}), "a collective one member did not issue"
    assert not ledgers_agree({0: _ledger(gen=1), 1: _ledger(gen=0)}), "two generations"
    assert not ledgers_agree({0: _ledger(sent={"1": 2}), 1: _ledger(received={"0": 1})}), "a message left in flight"
    assert not ledgers_agree({0: _ledger(), 1: _ledger(sent={"0": 1})}), "a message nobody received"
