"""Framing keeps groups apart on a pair without tags.

NCCL matches a pair's sends and receives in posting order per direction, with no tags. On CPU that is
a gloo pair driven with a single tag (:class:`SingleTag`, which is what the NCCL pair did before it was
framed); :class:`nccl_delta.framing.FramedPair` over such a pair must deliver every message to the
receive of its own tag. Each check has a companion that shows it can fail: the same interleaving over
the raw single-tag pair delivers the wrong payloads. The ``gpu`` tests run the same scenarios on the
real NCCL link (2 GPUs, ``scripts/gpu_check_multi.sh``).
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from nccl_delta.errors import CommLinkError
from nccl_delta.framing import FramedPair, FramingError, decode_header, encode_header
from nccl_delta.group import P2P_TAG_LIMIT, tag_base
from nccl_delta.links import Link, LinkId
from nccl_delta.transport_gloo import connect_gloo_pair

from . import harness

# Three groups' tags on one link, as megatron's TP, DP and PP groups would use them.
TP, DP, PP = tag_base("tp") + P2P_TAG_LIMIT, tag_base("dp") + P2P_TAG_LIMIT, tag_base("pp") + 3


class SingleTag:
    """A gloo pair matched like NCCL: every op on one tag, in posting order (the unframed NCCL pair)."""

    def __init__(self, raw):
        self.raw = raw

    def isend(self, tensor, tag):
        return self.raw.isend(tensor, 0)

    def irecv(self, tensor, tag):
        return self.raw.irecv(tensor, 0)

    def wait(self, work, timeout):
        self.raw.wait(work, timeout)

    def sever(self):
        self.raw.sever()

    def close(self):
        self.raw.close()


def _gloo_link(rank, store, *, framed, op_timeout_s):
    raw = connect_gloo_pair(store, "framing/", rank, datetime.timedelta(seconds=30), "127.0.0.1")
    timeout = datetime.timedelta(seconds=op_timeout_s)
    handle = FramedPair(raw, device=torch.device("cpu"), timeout=timeout) if framed else SingleTag(raw)
    return Link(
        link_id=LinkId(group="framing", a=0, b=1, generation=0),
        me=rank,
        peer=1 - rank,
        handle=handle,
        op_timeout_s=op_timeout_s,
    )


def _nccl_link(rank, store, *, framed, op_timeout_s):
    from nccl_delta.transport_nccl import connect_nccl_pair

    torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=op_timeout_s)
    pair = connect_nccl_pair(store, "framing/", rank, datetime.timedelta(seconds=60), timeout)
    return Link(
        link_id=LinkId(group="framing", a=0, b=1, generation=0, transport="nccl"),
        me=rank,
        peer=1 - rank,
        handle=pair if framed else pair.raw,  # raw: NCCL's own matching, no tags
        op_timeout_s=op_timeout_s,
    )


def _end(rank, world_size, store, scenario, framed, op_timeout_s, transport):
    """One end: build the link, run ``scenario(rank, link)``, report its result and leftover threads."""
    connect = _nccl_link if transport == "nccl" else _gloo_link
    link = connect(rank, store, framed=framed, op_timeout_s=op_timeout_s)
    result = scenario(rank, link)
    # Both ends finish before either closes: closing releases a peer's pending ops too, and the
    # sever and deadline tests must see the peer released by the sever itself.
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"], datetime.timedelta(seconds=40))
    link.close(wait=True)  # retires the link as a switch does: its demultiplexer must exit
    thread = getattr(link.handle, "_thread", None)
    result["demux_alive"] = thread is not None and thread.is_alive()
    return result


def _run(scenario, *, framed, op_timeout_s=30.0, transport="gloo", timeout=90.0):
    return harness.run(2, _end, scenario, framed, op_timeout_s, transport, init=False, timeout=timeout)


# --- messages ------------------------------------------------------------------


def _message(sender, tag, k, device, same_size):
    """The k-th message ``sender`` sends on ``tag``; every one differs from every other.

    ``same_size``: all 12 bytes, so that the raw pair delivers a wrong payload instead of failing
    on a size mismatch. Otherwise also 0-element and large messages."""
    seed = sender * 1000 + tag % 997 * 10 + k
    shapes = [(torch.float32, (3,)), (torch.bfloat16, (2, 3)), (torch.int32, (3,)), (torch.uint8, (12,))]
    if not same_size:
        shapes += [(torch.int64, (0,)), (torch.float64, (40, 25)), (torch.bool, (5,)), (torch.float16, (0, 4))]
    dtype, shape = shapes[((TP, DP, PP).index(tag) * 2 + k + sender * 3) % len(shapes)]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=gen) + seed
    if dtype == torch.bool:
        return (values % 2 == 1).to(device)
    return values.to(dtype).to(device)


# Posting orders: (tag, k) per direction. The receiver posts its receives in another order than the
# sender posted the sends, across tags; within one tag, both keep the order (as programs do).
SENDS = {
    0: [(TP, 0), (DP, 0), (PP, 0), (TP, 1), (PP, 1), (DP, 1)],
    1: [(PP, 0), (TP, 0), (TP, 1), (DP, 0), (PP, 1), (DP, 1)],
}
RECVS = {  # what rank r receives from the other rank, in r's posting order
    0: [(DP, 0), (TP, 0), (DP, 1), (PP, 0), (TP, 1), (PP, 1)],
    1: [(PP, 0), (PP, 1), (DP, 0), (TP, 0), (DP, 1), (TP, 1)],
}


def _interleave(same_size):
    def scenario(rank, link):
        device = torch.device("cuda", rank) if link.link_id.transport == "nccl" else torch.device("cpu")
        peer = 1 - rank
        recvs = []
        # Receives and sends interleaved, in this end's own order.
        for i in range(6):
            tag, k = RECVS[rank][i]
            expect = _message(peer, tag, k, device, same_size)
            buf = torch.zeros_like(expect)
            recvs.append((tag, k, expect, buf, link.irecv(buf, tag, f"recv(tag={tag})")))
            tag, k = SENDS[rank][i]
            work = link.isend(_message(rank, tag, k, device, same_size), tag, f"send(tag={tag})")
            recvs.append((None, None, None, None, work))
        for *_, work in recvs:
            work.wait()
        wrong = [
            (tag, k)
            for tag, k, expect, buf, _ in recvs
            if tag is not None and not (buf.dtype == expect.dtype and torch.equal(buf.cpu(), expect.cpu()))
        ]
        return dict(wrong=wrong, sent=dict(link.sent), received=dict(link.received))

    return scenario


@pytest.mark.parametrize("same_size", [True, False], ids=["12-byte", "mixed-sizes"])
def test_interleaved_groups_get_their_own_payloads(same_size):
    results = _run(_interleave(same_size), framed=True)
    for rank, result in results.items():
        assert result["wrong"] == [], f"rank {rank} got another group's payload for (tag, k) {result['wrong']}"
        assert not result["demux_alive"], f"rank {rank}: the demultiplexer outlived close()"
    # The ledgers recover() compares stay true: every message counted once, on its own tag.
    assert results[0]["sent"] == results[1]["received"] and results[1]["sent"] == results[0]["received"]
    assert results[0]["sent"] == {TP: 2, DP: 2, PP: 2}


def test_companion_the_raw_single_tag_pair_mixes_groups_up():
    """The bug itself: without framing, the same interleaving hands payloads to the wrong receives."""
    results = _run(_interleave(True), framed=False)
    for rank, result in results.items():
        assert len(result["wrong"]) >= 4, f"rank {rank}: expected mixed-up payloads, got {result['wrong']}"


def _staged(rank, link):
    """Rank 0 sends DP then TP; rank 1 waits for TP first, so DP's frame is staged, then claims it."""
    device = torch.device("cuda", rank) if link.link_id.transport == "nccl" else torch.device("cpu")
    if rank == 0:
        works = [link.isend(torch.full((4,), 7.0, device=device), DP, "send(dp)")]
        works.append(link.isend(torch.full((4,), 3.0, device=device), TP, "send(tp)"))
        for work in works:
            work.wait()
        return {}
    tp = torch.zeros(4, device=device)
    link.irecv(tp, TP, "recv(tp)").wait()
    staged = link.handle.staged() if isinstance(link.handle, FramedPair) else None
    dp = torch.zeros(4, device=device)
    work = link.irecv(dp, DP, "recv(dp)")
    done_at_post = getattr(work.work, "done", None)
    work.wait()
    return dict(
        tp=tp.cpu().tolist(),
        dp=dp.cpu().tolist(),
        staged=staged,
        done_at_post=bool(done_at_post.is_set()) if done_at_post is not None else None,
    )


def test_a_frame_that_arrives_before_its_receive_is_staged_then_delivered():
    result = _run(_staged, framed=True)[1]
    assert result["staged"] == 1, "the DP frame should have been staged while rank 1 waited for TP"
    assert result["done_at_post"], "a staged frame completes its receive when the receive is posted"
    assert result["tp"] == [3.0] * 4 and result["dp"] == [7.0] * 4
    assert not result["demux_alive"], "the demultiplexer outlived close()"


def test_companion_without_framing_the_early_frame_lands_in_the_wrong_receive():
    result = _run(_staged, framed=False)[1]
    assert result["tp"] == [7.0] * 4 and result["dp"] == [3.0] * 4


def _timed_wait(work) -> dict:
    """How a wait ended: the error's type and message (None when it completed) and how long it took."""
    start = time.monotonic()
    try:
        work.wait()
    except CommLinkError as exc:
        return dict(error=type(exc).__name__, message=str(exc), after_s=time.monotonic() - start)
    return dict(error=None, after_s=time.monotonic() - start)


def _sever_during_receive(rank, link):
    """Both ends wait for a frame nobody sends; rank 0 severs its link from another thread."""
    device = torch.device("cuda", rank) if link.link_id.transport == "nccl" else torch.device("cpu")
    work = link.irecv(torch.zeros(4, device=device), PP, f"recv(tag={PP}) in group 'pp'")
    if rank == 0:
        threading.Timer(1.0, link.sever, args=("abandoned by the test",)).start()
    return _timed_wait(work)


def test_sever_during_a_pending_receive_fails_both_ends_at_once():
    results = _run(_sever_during_receive, framed=True, op_timeout_s=60.0)
    for rank, result in results.items():
        assert result["error"] is not None, f"rank {rank}: the receive completed after a sever"
        assert f"recv(tag={PP}) in group 'pp' with peer rank {1 - rank}" in result["message"], result
        assert result["after_s"] < 10.0, f"rank {rank} waited {result['after_s']:.1f}s: the sever did not unblock it"
        assert not result["demux_alive"], f"rank {rank}: the demultiplexer outlived the sever"
    assert results[0]["error"] == "CommAbandoned"


def _deadline(rank, link):
    """Rank 1 (1 s deadline) waits for a frame nobody sends; rank 0 (60 s) waits too."""
    device = torch.device("cuda", rank) if link.link_id.transport == "nccl" else torch.device("cpu")
    if rank == 1:
        link._timeout = datetime.timedelta(seconds=1.0)
    work = link.irecv(torch.zeros(2, device=device), DP, f"recv(tag={DP})")
    return _timed_wait(work)


def test_a_deadline_passes_with_a_clear_error_and_releases_the_peer():
    results = _run(_deadline, framed=True, op_timeout_s=60.0)
    late = results[1]
    assert late["error"] == "CommTimeout", late
    assert f"recv(tag={DP}) with peer rank 0 failed" in late["message"] and "imed out" in late["message"], late
    assert late["after_s"] < 8.0, late
    # A passed deadline severs the pair, as a timed-out gloo receive closes its pair: the peer fails
    # now instead of at its own 60 s deadline.
    assert results[0]["error"] is not None and results[0]["after_s"] < 15.0, results[0]
    assert not any(r["demux_alive"] for r in results.values())


def _misfit(rank, link):
    """Both ends disagree on a message's size: a clear error on the receiver, never a hang."""
    device = torch.device("cuda", rank) if link.link_id.transport == "nccl" else torch.device("cpu")
    if rank == 0:
        # Kept: gloo drops a send whose work is freed.
        send = link.isend(torch.ones(4, device=device), TP, "send(tp)")
        try:  # stay until rank 1 breaks the pair, so the frame is not lost with our exit
            link.irecv(torch.zeros(1, device=device), DP, "recv(dp)").wait()
        except CommLinkError:
            pass
        return dict(send_done=send.done)
    try:
        link.irecv(torch.zeros(5, device=device), TP, "recv(tp)").wait()
    except CommLinkError as exc:
        return dict(message=str(exc))
    return dict(message=None)


def test_a_frame_that_does_not_fit_its_receive_fails_clearly():
    result = _run(_misfit, framed=True, op_timeout_s=30.0)[1]
    assert result["message"] is not None and "must post the same sizes" in result["message"], result
    assert "recv(tp) with peer rank 0" in result["message"]


def test_header_round_trip_and_unknown_dtypes():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn):
        header = encode_header(torch.empty(0, 7, dtype=dtype), 12345)
        assert decode_header(header) == (12345, dtype, 0)
    with pytest.raises(FramingError, match="cannot be framed"):
        encode_header(torch.empty(3, dtype=torch.uint64), 1)
    with pytest.raises(FramingError, match="malformed"):
        decode_header(torch.tensor([1, 999, 4]))


def test_a_severed_pair_refuses_new_ops_at_once():
    class Idle:
        severed = 0

        def sever(self):
            self.severed += 1

    raw = Idle()
    pair = FramedPair(raw, device=torch.device("cpu"), timeout=datetime.timedelta(seconds=5))  # type: ignore[arg-type]
    pair.sever()
    pair.sever()
    assert raw.severed >= 1
    with pytest.raises(FramingError, match="severed"):
        pair.irecv(torch.zeros(1), 1)
    with pytest.raises(FramingError, match="severed"):
        pair.isend(torch.zeros(1), 1)
    assert pair._thread is None  # no demultiplexer was started for nothing


def test_a_failed_send_breaks_the_pair_and_severs_the_raw_pair():
    """Part of a frame may be on the wire after a send fails: the pair must not be used again."""

    class FailingSends:
        severed = 0

        def isend(self, tensor, tag):
            return object()

        def wait(self, work, timeout):
            raise RuntimeError("Connection reset by peer")

        def sever(self):
            self.severed += 1

    raw = FailingSends()
    pair = FramedPair(raw, device=torch.device("cpu"), timeout=datetime.timedelta(seconds=5))  # type: ignore[arg-type]
    send = pair.isend(torch.ones(3), 7)
    assert len(send.works) == 2 and len(pair.isend(torch.ones(0), 7).works) == 1  # no payload for 0 elements
    with pytest.raises(RuntimeError, match="reset"):
        pair.wait(send, datetime.timedelta(seconds=1))
    assert raw.severed == 1
    with pytest.raises(FramingError, match="sending a frame failed: Connection reset"):
        pair.irecv(torch.zeros(3), 7)


# --- the real NCCL link (2 GPUs) ----------------------------------------------------

needs_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL allows one rank per device)",
)


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("same_size", [True, False], ids=["12-byte", "mixed-sizes"])
def test_gpu_nccl_link_keeps_groups_apart(same_size):
    results = _run(_interleave(same_size), framed=True, transport="nccl", timeout=300)
    for rank, result in results.items():
        assert result["wrong"] == [], f"rank {rank} got another group's payload for (tag, k) {result['wrong']}"
    staged = _run(_staged, framed=True, transport="nccl", timeout=300)[1]
    assert staged["tp"] == [3.0] * 4 and staged["dp"] == [7.0] * 4 and staged["staged"] == 1


@pytest.mark.gpu
@needs_2_gpus
def test_gpu_companion_raw_nccl_channels_mix_groups_up():
    results = _run(_interleave(True), framed=False, transport="nccl", timeout=300)
    assert all(len(r["wrong"]) >= 4 for r in results.values()), results


@pytest.mark.gpu
@needs_2_gpus
def test_gpu_deadline_on_an_nccl_link():
    late = _run(_deadline, framed=True, op_timeout_s=60.0, transport="nccl", timeout=300)[1]
    assert late["error"] == "CommTimeout" and late["after_s"] < 30.0, late


# --- the whole communicator over framed single-tag links ------------------------------------------


def _framed_world(rank, world_size, store, framed_links):
    """Every link of the world (WORLD's ring) is a gloo pair driven with one tag (NCCL's matching), framed
    or not; WORLD's ring collectives and the groups' native collectives, then p2p of two groups posted in
    different orders between the same two ranks (each group has a communicator of its own, and WORLD's
    p2p goes over the pair communicator: nothing is shared, so nothing can mix up)."""
    import torch.distributed as dist

    from nccl_delta import transport_gloo

    connect_raw = transport_gloo.connect_gloo_pair
    framed = []

    def connect_framed(store, prefix, side, timeout, host):
        raw = connect_raw(store, prefix, side, timeout, host)
        pair = FramedPair(raw, device=torch.device("cpu"), timeout=timeout) if framed_links else SingleTag(raw)
        framed.append(pair)
        return pair

    transport_gloo.connect_gloo_pair = connect_framed
    dist.init_process_group("nccl_delta", store=store, rank=rank, world_size=world_size)
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tps[rank // 2], dps[rank % 2]
    checks = {}
    big = torch.arange(3_000_000, dtype=torch.float32) * (rank + 1)  # several ring segments
    dist.all_reduce(big)
    checks["world_allreduce"] = torch.equal(big, torch.arange(3_000_000, dtype=torch.float32) * 10)
    x = torch.full((1001,), float(rank), dtype=torch.float64)
    dist.all_reduce(x, group=tp)
    pair_sum = float(rank // 2 * 4 + 1)  # ranks 2r' and 2r'+1
    checks["tp_allreduce"] = bool((x == pair_sum).all())
    out = torch.empty(2 * 7, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((7,), float(rank), dtype=torch.bfloat16), group=dp)
    checks["dp_allgather"] = out.tolist() == [float(rank % 2)] * 7 + [float(rank % 2 + 2)] * 7
    # p2p between the two TP ranks on two groups that share their link (TP and WORLD), posted in
    # opposite orders on the two ends; every message has the same size, so a mix-up shows as data.
    peer = rank ^ 1
    mine = {name: torch.full((64,), float(rank * 10 + i)) for i, name in enumerate(("tp", "world"))}
    got = {name: torch.zeros(64) for name in mine}
    order = ("tp", "world") if rank % 2 == 0 else ("world", "tp")
    works = [dist.isend(mine[name], peer, group=tp if name == "tp" else None) for name in order]
    works += [dist.irecv(got[name], peer, group=tp if name == "tp" else None) for name in order]
    for work in works:
        work.wait()
    checks["p2p_apart"] = all(torch.equal(got[n], torch.full((64,), float(peer * 10 + i))) for i, n in enumerate(mine))
    dist.barrier()
    checks["framed_links"] = sum(isinstance(p, FramedPair) for p in framed)
    return checks


def test_the_communicator_runs_over_framed_single_tag_links():
    results = harness.run(4, _framed_world, True, init=False, timeout=180)
    for rank, checks in results.items():
        assert checks.pop("framed_links") >= 2, (rank, "the links were not framed")
        assert all(checks.values()), (rank, checks)
