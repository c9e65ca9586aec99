"""Pure pieces without processes: config validation, chunk layout, reducers, the NCCL import."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import nccl_delta
from nccl_delta import ring, transport_nccl
from nccl_delta.errors import CommLinkError, DeltaConfigError


def test_config_rejects_bad_values():
    with pytest.raises(DeltaConfigError, match="NCCL_DELTA_TRANSPORT"):
        nccl_delta.DeltaConfig(transport="mpi")
    with pytest.raises(DeltaConfigError):
        nccl_delta.DeltaConfig(op_timeout_s=0)
    with pytest.raises(DeltaConfigError):
        nccl_delta.DeltaConfig(segment_bytes=10)


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("NCCL_DELTA_TRANSPORT", "gloo")
    monkeypatch.setenv("NCCL_DELTA_OP_TIMEOUT_S", "7")
    cfg = nccl_delta.DeltaConfig.from_env(link_host="127.0.0.1")
    assert (cfg.transport, cfg.op_timeout_s, cfg.link_host) == ("gloo", 7.0, "127.0.0.1")
    assert nccl_delta.DeltaConfig(transport="auto").resolved_transport() == (
        "nccl" if torch.cuda.is_available() else "gloo"
    )


@pytest.mark.parametrize("numel,n", [(0, 3), (5, 3), (12, 4), (13, 4), (1, 8)])
def test_chunk_bounds_cover_everything_once(numel, n):
    bounds = ring.chunk_bounds(numel, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_reducers_and_avg():
    acc = torch.tensor([1.0, 5.0])
    ring.reducer(dist.ReduceOp.MAX)(acc, torch.tensor([3.0, 2.0]))
    assert acc.tolist() == [3.0, 5.0]
    ints = torch.tensor([7, -7])
    ring.finish_avg(ints, 2)
    assert ints.tolist() == [3, -3]  # truncation, as NCCL does
    with pytest.raises(NotImplementedError):
        ring.reducer(dist.ReduceOp.PREMUL_SUM)


def test_nccl_transport_imports_without_cuda():
    assert transport_nccl.nccl_available() == (
        torch.cuda.is_available() and transport_nccl.ProcessGroupNCCL is not None
    )


def test_op_name_reads_through_reduce_op_wrappers():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    assert ring.op_name(opts.reduceOp) == "MAX"
    assert ring.op_name(dist.ReduceOp.SUM) == "SUM"


class _FakeHandle:
    def __init__(self):
        self.closed_by = None
        self.done = threading.Event()

    def close(self):
        self.closed_by = threading.current_thread().name
        self.done.set()


def test_close_retires_at_once_and_tears_down_off_the_caller_thread():
    from nccl_delta.links import Link, LinkId

    handle = _FakeHandle()
    link = Link(link_id=LinkId(group="g", a=0, b=1, generation=0), me=0, peer=1, handle=handle, op_timeout_s=1.0)
    link.close()
    assert link.state == "closed"  # ops fail from now on, even before the reaper ran
    with pytest.raises(CommLinkError, match="closed by switch"):
        link.isend(torch.zeros(1), 0, "send")
    assert handle.done.wait(5.0), "the reaper never closed the handle"
    assert handle.closed_by == "nccl_delta_reaper"
    sync = _FakeHandle()
    Link(link_id=LinkId(group="g", a=0, b=1, generation=0), me=0, peer=1, handle=sync, op_timeout_s=1.0).close(
        wait=True
    )
    assert sync.closed_by == threading.current_thread().name


class _ProbeRacedByAbandon:
    """A pair whose probe is raced by an abandon: while the probe (a receive that times out, which
    closes a live gloo pair) is in progress, the control plane quiesces the link."""

    def __init__(self):
        self.link = None
        self.quiesced_during_probe = None
        self.severed = False

    def peer_closed(self):
        self.quiesced_during_probe = self.link.quiesce("epoch 1 abandoned")
        return False

    def sever(self):
        self.severed = True


def test_a_probed_link_is_severed_even_when_an_abandon_races_the_probe():
    """The race behind a rare hang after recovery: a ring's neighbour failed, the ring probed its other
    link while the abandon quiesced it, the probe's time-out closed the pair, and recover() then kept
    the closed pair (its ledgers matched). The probe now marks the link broken first."""
    from nccl_delta.links import Link, LinkId

    handle = _ProbeRacedByAbandon()
    link = handle.link = Link(
        link_id=LinkId(group="g", a=0, b=1, generation=0), me=0, peer=1, handle=handle, op_timeout_s=1.0
    )
    assert link.probe_then_sever("allreduce failed on a neighbouring link") is False
    assert handle.quiesced_during_probe is False, "the abandon quiesced a link under probe"
    assert handle.severed and link.state == "broken" and link.ledger() is None
    quiet = Link(
        link_id=LinkId(group="g", a=0, b=1, generation=0), me=0, peer=1, handle=_ProbeRacedByAbandon(), op_timeout_s=1.0
    )
    assert quiet.quiesce("epoch 1 abandoned")
    assert quiet.probe_then_sever("x") is False and not quiet.handle.severed  # recover() may keep a quiet link
    assert quiet.ledger() is not None


def test_a_link_is_kept_only_when_both_ledgers_match():
    from nccl_delta.ledgers import ledgers_match

    a = {"generation": 0, "pair": 3, "sent": {"5": 2, "1029": 7}, "received": {"1029": 7}}
    b = {"generation": 0, "pair": 3, "sent": {"1029": 7}, "received": {"5": 2, "1029": 7}}
    assert ledgers_match(a, b) and ledgers_match(b, a)
    assert not ledgers_match(a, None) and not ledgers_match(None, b)  # one end was busy or broken
    assert not ledgers_match(a, dict(b, received={"5": 1, "1029": 7}))  # a message still in the pair
    assert not ledgers_match(a, dict(b, pair=2))
    assert not ledgers_match(a, dict(b, generation=1))


def test_a_late_abandon_leaves_the_new_epoch_alone():
    """The runtime abandons from its watch thread whenever it sees a failure plan, and it sees the
    same plan again each time a step is marked on it. An abandon of epoch e that comes once the
    process entered e (recover started) must not quiesce the links e is building."""
    from torch.distributed import HashStore

    from nccl_delta.world import DeltaWorld

    class NewLink:
        quiesced = severed = False

        def quiesce(self, reason):
            self.quiesced = True
            return True

        def sever(self, reason, abandoned=True):
            self.severed = True

    world = DeltaWorld(rank=0, world_size=2, store=HashStore(), config=nccl_delta.DeltaConfig(link_host="127.0.0.1"))
    world.abandon(1, "rank 1 failed", dead={1})
    assert world.abandoned is not None
    world.recover(1, replaced={1})  # no links, no groups: nothing to keep or rebuild
    link = NewLink()
    world.links[("gloo", 1)] = link  # as if recover had just built it
    assert world.abandon(1, "the same plan, seen again") == 0
    assert world.abandoned is None and not link.quiesced and not link.severed
    world.abandon(2, "the next failure", dead={1})
    assert world.abandoned is not None and link.severed


class _NeverDone:
    """A gloo collective's work whose op never completes (what gloo was seen to do with a pair op after a
    sever): like c10d's, a wait with a timeout raises when it runs out and leaves the op pending."""

    completed = False

    def is_completed(self):
        return self.completed

    def wait(self, timeout=None):
        if timeout is None:
            raise AssertionError("wait() on a work that never completes would block")
        if self.completed:
            return True
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")


def test_a_sever_frees_a_pair_all_reduce_gloo_never_completes():
    """The pair all-reduce is waited for in slices on the caller's thread; the sever cancels it."""
    import datetime

    from nccl_delta.transport_gloo import GlooPair, _Collective
    from nccl_delta.waiter import WaitCancelled

    pair = GlooPair(None, 0, {}, datetime.timedelta(seconds=60))
    outcome = {}

    def waiter():
        try:
            pair.wait(_Collective(_NeverDone()), datetime.timedelta(seconds=60))
        except WaitCancelled as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), "the wait must block until the op completes or is cancelled"
    pair.sever()
    thread.join(5.0)
    assert not thread.is_alive() and "severed" in str(outcome["error"])
    with pytest.raises(WaitCancelled):  # a severed pair takes no new wait
        pair.wait(_Collective(_NeverDone()), datetime.timedelta(seconds=60))

    done = _NeverDone()
    done.completed = True
    GlooPair(None, 0, {}, datetime.timedelta(seconds=60)).wait(_Collective(done), datetime.timedelta(seconds=1))


class _EndsLater(_NeverDone):
    """A collective's work that ends ``after_s`` from now, with ``error`` (None: success)."""

    def __init__(self, after_s: float, error: BaseException | None = None):
        self.end, self.error = time.monotonic() + after_s, error

    def is_completed(self):
        return time.monotonic() >= self.end

    def wait(self, timeout=None):
        left = self.end - time.monotonic()
        if left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, left))
        if self.error is not None:
            raise self.error
        return True


class _CompositeFails(_NeverDone):
    """gloo's reduce-scatter (a LambdaWork): its wait ignores the timeout and waits for an inner
    all-reduce, and it never reports itself completed, even once that all-reduce failed."""

    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")


def test_a_pending_wait_ends_once_by_its_outcome_or_a_cancel():
    """Whichever comes first wins: a cancel after the outcome changes nothing, an outcome after a cancel
    is refused; a waiter thread's caller wakes at either, and only then."""
    import datetime

    from nccl_delta.waiter import Pending

    minute = datetime.timedelta(seconds=60)
    done = Pending(_NeverDone(), minute)
    assert not done.wait_ended(0.05)
    assert done._finish(None)
    done.cancel("too late")
    assert done.wait_ended(0.0) and done.wait_ended(0.0)  # every caller returns once it ended
    assert (done.cancelled, done.error) == (None, None)

    cut = Pending(_NeverDone(), minute)
    threading.Timer(0.1, cut.cancel, args=("the group was cut",)).start()
    start = time.monotonic()
    assert cut.wait_ended(5.0)
    assert 0.1 <= time.monotonic() - start < 1.0
    assert not cut._finish(ValueError("the op's outcome, after the cancel"))
    assert (cut.cancelled, cut.error) == ("the group was cut", None)


def test_a_sliced_wait_returns_the_op_s_own_outcome_and_ends_at_a_cancel():
    """A collective's wait on the caller's thread: the slices running out are not the op's outcome."""
    import datetime

    from nccl_delta.waiter import SLICE_S, Pending, WaitCancelled, wait_sliced

    minute = datetime.timedelta(seconds=60)
    wait_sliced(Pending(_EndsLater(3.5 * SLICE_S), minute))  # three slices ran out, then success
    with pytest.raises(ValueError, match="peer closed"):
        wait_sliced(Pending(_EndsLater(2.5 * SLICE_S, ValueError("peer closed")), minute))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="closed by peer"):  # its own error at once, with no cancel
        wait_sliced(Pending(_CompositeFails(), minute))
    assert time.monotonic() - start < SLICE_S

    pending = Pending(_NeverDone(), minute)
    threading.Timer(0.2, pending.cancel, args=("the group was cut",)).start()
    start = time.monotonic()
    with pytest.raises(WaitCancelled, match="was cut"):
        wait_sliced(pending)
    assert 0.2 <= time.monotonic() - start < 0.2 + 3 * SLICE_S

    with pytest.raises(WaitCancelled, match="outlived its timeout"):  # the op's timeout, plus 5 s
        wait_sliced(Pending(_NeverDone(), datetime.timedelta(seconds=-4.8)))


def _pair_end(port: int, side: int, queue) -> None:
    """One end of a pair in a forked child (the test process must never own a gloo device: every
    later fork would inherit it without its thread). Side 0 sees every fd number taken before
    its constructor, as if each had held another socket a moment before."""
    import datetime
    import os

    from torch.distributed import TCPStore

    from nccl_delta import transport_gloo

    code = 1
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        if side == 0:
            real_fds, calls = transport_gloo._socket_fds, []

            def every_number_was_taken() -> set[int]:
                calls.append(1)
                return real_fds() | (set(range(4096)) if len(calls) == 1 else set())

            transport_gloo._socket_fds = every_number_was_taken
        pair = transport_gloo.connect_gloo_pair(store, "fdreuse/", side, datetime.timedelta(seconds=30), "127.0.0.1")
        queue.put((side, list(pair._sockets.values())))
        store.set(f"done/{side}", "1")
        store.wait([f"done/{1 - side}"])
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((side, repr(exc)))
    finally:
        queue.close()
        queue.join_thread()  # the put is flushed before the exit
        os._exit(code)


def test_the_pair_socket_is_found_when_its_fd_number_held_another_socket_before():
    """Another thread may close a link (freeing its fd number) while a pair connects, and the pair's
    socket may take that number (seen in 4 of 2000 concurrent builds): it must still be identified,
    or a sever could not unblock its ops. Deterministically here: the snapshot taken before the
    constructor sees every fd number in use."""
    import datetime
    import multiprocessing

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    ends = [ctx.Process(target=_pair_end, args=(store.port, side, queue), daemon=True) for side in (0, 1)]
    for end in ends:
        end.start()
    found = dict(queue.get(timeout=60) for _ in ends)
    for end in ends:
        end.join(10)
    assert [end.exitcode for end in ends] == [0, 0], found
    assert len(found[0]) == 1, f"the pair's socket was not identified: a sever could not unblock its ops: {found}"
    ((local, remote),) = found[0]
    assert [list(remote), list(local)] in [[list(a), list(b)] for a, b in found[1]], found


class _StuckWork:
    """A gloo work whose op never ends (gloo left it pending after its pair closed)."""

    def __init__(self, p2p: bool):
        self.p2p = p2p

    def wait(self, timeout=None) -> bool:
        if self.p2p or timeout is None:
            threading.Event().wait(30)  # what gloo's wait does with such an op: nothing
            return True
        time.sleep(timeout.total_seconds())  # a collective's: c10d raises when the timeout runs out
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


@pytest.mark.parametrize("p2p", [False, True], ids=["collective", "send-recv"])
def test_an_abort_frees_a_wait_that_gloo_leaves_pending(p2p):
    from types import SimpleNamespace

    from nccl_delta.config import DeltaConfig
    from nccl_delta.native import NativeComm
    from nccl_delta.native_group import NativeGroup
    from nccl_delta.waiter import WaitCancelled

    world = SimpleNamespace(rank=0, world_size=2, config=DeltaConfig())
    group = NativeGroup(world=world, name="g", members=[0, 1], store=None)  # type: ignore[arg-type]
    comm = NativeComm(backend=None, device_type="cpu", generation=0)
    group.comms = {"cpu": comm}
    cut = threading.Timer(0.2, group.abort, args=("the control plane cut it",))
    cut.start()
    t0 = time.monotonic()
    with pytest.raises(WaitCancelled, match="the control plane cut it"):
        group.wait(_StuckWork(p2p), comm, None, p2p)
    from nccl_delta.native_group import ABORT_SETTLE_S

    assert time.monotonic() - t0 < 2.0 + ABORT_SETTLE_S  # the op gets ABORT_SETTLE_S to end; this one never does
