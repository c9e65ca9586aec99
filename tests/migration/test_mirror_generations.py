"""The holder's side of the optimizer-shard mirror, without processes: generations, commits, refusals.

A torch Adam stands for megatron's optimizer (a unit test of the mirror's bookkeeping; the jobs in
test_optimizer_mirror.py run the real thing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainmover_ext.migration.mirror import (
    Generation,
    Mirror,
    MirrorRefused,
    holder_and_ward,
    holder_offset,
    ward_of,
)

MANIFEST = [[[3, 4], "torch.float32"], [[], "torch.float32"], [[5], "torch.bfloat16"]]


def _mirror() -> Mirror:
    param = torch.nn.Parameter(torch.zeros(4))
    session = SimpleNamespace(
        optimizer=SimpleNamespace(optimizer=torch.optim.Adam([param])),
        layout=SimpleNamespace(rank=3),
        args=SimpleNamespace(iteration=0),
    )
    return Mirror(session, holder=1, ward=1)  # type: ignore[arg-type]


def _land(mirror: Mirror, iteration: int, fill: float) -> Generation:
    """What :meth:`Mirror.exchange` does on the holder's side once every byte of ``iteration`` landed."""
    gen = mirror._slot_for(iteration)
    gen.checksum, gen.iteration, gen.record = None, iteration, {"iteration": iteration}
    gen.shape_for(MANIFEST)
    for view in gen.views:
        view.fill_(fill)
    gen.checksum = gen.crc()
    return gen


def test_two_generations_the_oldest_overwritten_and_a_rerun_in_place():
    mirror = _mirror()
    for k in (4, 5, 6):
        _land(mirror, k, float(k))
    assert mirror.report()["mirror"]["iterations"] == [5, 6]
    assert mirror.committed(6).views[0][0, 0].item() == 6.0
    again = _land(mirror, 6, 60.0)  # iteration 6 sent again after a rollback: the same slot
    assert mirror.committed(6) is again and mirror.report()["mirror"]["iterations"] == [5, 6]
    mirror.forget_after(5)
    assert mirror.report()["mirror"]["iterations"] == [5]


def test_an_uncommitted_generation_is_not_offered():
    mirror = _mirror()
    _land(mirror, 4, 4.0)
    gen = mirror._slot_for(5)
    gen.checksum, gen.iteration = None, 5  # its bytes still on the way
    assert mirror.report()["mirror"]["iterations"] == [4]
    with pytest.raises(MirrorRefused, match="holds no committed mirror of rank 1 at iteration 5"):
        mirror.committed(5)


def test_host_memory_that_changed_since_the_commit_is_refused():
    mirror = _mirror()
    gen = _land(mirror, 7, 7.0)
    assert gen.buffer is not None
    _land(mirror, 6, 6.0)
    gen.buffer[3] ^= 0x10  # one flipped bit
    # The report checks before it offers: the controller never plans a copy from it.
    assert mirror.report()["mirror"]["iterations"] == [6]
    with pytest.raises(MirrorRefused, match="fails its checksum"):
        gen.checksum = gen.crc() ^ 1  # had it been offered, serving it is refused all the same
        mirror.committed(7)


def test_views_are_aligned_and_typed():
    gen = Generation()
    gen.shape_for(MANIFEST)
    assert [tuple(v.shape) for v in gen.views] == [(3, 4), (), (5,)]
    assert [v.dtype for v in gen.views] == [torch.float32, torch.float32, torch.bfloat16]
    assert all(v.data_ptr() % 64 == 0 for v in gen.views)


@pytest.mark.parametrize(
    "dp,stride,per_node,expected",
    [(2, 2, 8, 1), (4, 1, 8, 1), (4, 2, 4, 2), (8, 1, 4, 4), (2, 1, 1, 1)],
)
def test_the_holder_is_on_another_node_where_there_is_one(dp, stride, per_node, expected):
    assert holder_offset(dp, stride, per_node) == expected


@pytest.mark.parametrize("pp_before_dp", [False, True])
@pytest.mark.parametrize("tp,pp,dp,per_node", [(2, 2, 2, 8), (1, 2, 4, 8), (2, 2, 4, 4), (1, 1, 8, 2)])
def test_holders_form_a_ring_over_each_shard_and_leave_the_node(tp, pp, dp, per_node, pp_before_dp):
    """Every rank holds exactly one ward's shard, of its own (tp, pp) coordinates; ward_of inverts
    holder_and_ward; the holder is on another node whenever the shard spans nodes."""
    holders, wards, coords = {}, {}, {}
    for rank in range(tp * pp * dp):
        tp_rank = rank % tp
        pp_rank, dp_rank = (
            ((rank // tp) % pp, rank // (tp * pp)) if pp_before_dp else (rank // (tp * dp), (rank // tp) % dp)
        )
        layout = SimpleNamespace(
            rank=rank, tp_size=tp, pp_size=pp, dp_size=dp, dp_rank=dp_rank, pp_before_dp=pp_before_dp
        )
        holders[rank], wards[rank] = holder_and_ward(layout, per_node)
        assert ward_of(layout, holders[rank]) == wards[rank]
        coords[rank] = (tp_rank, pp_rank)
    for rank, holder in holders.items():
        assert coords[holder] == coords[rank] and holder != rank  # a data-parallel peer of the same shard
        peers_elsewhere = any(coords[r] == coords[rank] and r // per_node != rank // per_node for r in coords)
        if peers_elsewhere:
            assert holder // per_node != rank // per_node, (rank, holder)
    assert sorted(holders.values()) == sorted(holders) and all(holders[w] == r for r, w in wards.items())
