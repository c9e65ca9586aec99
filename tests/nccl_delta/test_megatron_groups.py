"""megatron-core's parallel_state builds every group on nccl_delta, and the groups carry traffic.

megatron is imported by the test process so the forked ranks share it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nccl_delta

from . import harness

ps = pytest.importorskip("megatron.core.parallel_state")


def _layout(rank, n, store, tp, pp):
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, create_gloo_process_groups=False
    )
    try:
        groups = dist.distributed_c10d._world.pg_map
        foreign = [repr(g) for g in groups if not isinstance(g, nccl_delta.DeltaProcessGroup)]
        world = nccl_delta.current_world()
        named = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "mp": ps.get_model_parallel_group(),
            "embedding": ps.get_embedding_group(),
        }
        kinds = {k: type(g).__name__ for k, g in named.items()}
        sums = {}
        for key, group in named.items():
            ranks = dist.get_process_group_ranks(group)
            t = torch.full((5,), float(rank + 1))
            dist.all_reduce(t, group=group)
            sums[key] = (t[0].item(), float(sum(r + 1 for r in ranks)))
        # megatron's PP=2 path sends one direction over WORLD: stage 0 -> stage 1 by global rank.
        pp_ranks = (
            ps.get_pipeline_model_parallel_global_ranks()
            if hasattr(ps, "get_pipeline_model_parallel_global_ranks")
            else dist.get_process_group_ranks(named["pp"])
        )
        me = pp_ranks.index(rank)
        got = None
        if me == 0:
            dist.send(torch.full((3,), float(rank)), dst=pp_ranks[1])
        elif me == 1:
            buf = torch.empty(3)
            dist.recv(buf, src=pp_ranks[0])
            got = (buf[0].item(), float(pp_ranks[0]))
        return foreign, kinds, sums, got, len(world.groups)
    finally:
        ps.destroy_model_parallel()


def _check(results):
    for rank, (foreign, kinds, sums, got, n_groups) in results.items():
        assert not foreign, f"rank {rank} has groups not on nccl_delta: {foreign}"
        assert set(kinds.values()) == {"DeltaProcessGroup"}, kinds
        for key, (value, expected) in sums.items():
            assert value == expected, f"rank {rank} all_reduce on {key}: {value} != {expected}"
        if got is not None:
            assert got[0] == got[1]
        assert n_groups > 5


def test_initialize_model_parallel_tp2_pp2():
    _check(harness.run(4, _layout, 2, 2))


@pytest.mark.slow
def test_initialize_model_parallel_tp2_pp2_dp2():
    _check(harness.run(8, _layout, 2, 2, timeout=300))
