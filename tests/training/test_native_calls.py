"""Each op on a native group is one backend call; megatron's overlapped gradient reduction is one per bucket.

A counting proxy stands in front of the native backend (torch's ProcessGroupGloo here) of the
data-parallel groups and records every method called on it. Ranks are forked by the communicator's own
test harness (tests/nccl_delta/harness.py); this test lives with the training layer because megatron's
DDP runs on CPU only with TrainMover's patches installed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import nccl_delta
from nccl_delta.native_group import NativeWork
from tests.nccl_delta import harness


class Counting:
    """Stands in front of a native backend and records the name of every method called on it."""

    def __init__(self, backend: Any):
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            self.calls.append(name)
            return attr(*a, **kw)

        return counted


def _count(*groups: dist.ProcessGroup) -> Counting:
    """One counter in front of the backends of ``groups`` (calls on any of them are recorded)."""
    counting = Counting(None)
    for group in groups:
        comm = nccl_delta.current_world().groups[group.group_name].comms["cpu"]
        comm.backend = Counting(comm.backend)
        comm.backend.calls = counting.calls  # one shared record
    return counting


def _calls_per_op(rank, n, store):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    import trainmover_ext.patches as patches

    patches.install()
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    dp = ps.get_data_parallel_group()
    # megatron's DDP reduces over the data-parallel group with context parallelism (its own group,
    # with the same members here): count calls on both.
    counting = _count(dp, ps.get_data_parallel_group(with_context_parallel=True))
    out: dict[str, Any] = {}

    def calls(fn) -> list[str]:
        before = len(counting.calls)
        fn()
        return counting.calls[before:]

    t = torch.full((1000,), float(rank + 1))
    out["all_reduce"] = calls(lambda: dist.all_reduce(t, group=dp))
    work: list[Any] = []
    out["all_reduce_async"] = calls(lambda: work.append(dist.all_reduce(t, group=dp, async_op=True)))
    out["async_work"] = type(work[0]).__name__
    work[0].wait()

    def bucket() -> None:  # the form megatron's DDP uses for one bucket
        with dist._coalescing_manager(dp, async_ops=True) as cm:
            dist.all_reduce(t, group=dp, async_op=True)
        cm.wait()

    out["coalesced_bucket"] = calls(bucket)
    big = torch.arange(2 * 64, dtype=torch.float32)
    mine = big[rank * 64 : (rank + 1) * 64]
    out["reduce_scatter_in_place"] = calls(lambda: dist.reduce_scatter_tensor(mine, big, group=dp))
    full = torch.zeros(2 * 64)
    own = full[rank * 64 : (rank + 1) * 64]
    out["all_gather_in_place"] = calls(lambda: dist.all_gather_into_tensor(full, own, group=dp))
    two = [torch.zeros(8), torch.zeros(8)]
    with_two = [torch.ones(16), torch.ones(16)]

    def two_reduce_scatters() -> None:
        with dist._coalescing_manager(dp, async_ops=True) as cm:
            for o, i in zip(two, with_two, strict=True):
                dist.reduce_scatter_tensor(o, i, group=dp, async_op=True)
        cm.wait()

    out["coalesced_two_reduce_scatters"] = calls(two_reduce_scatters)

    # megatron's DDP with its gradient reduction overlapped with backward: one bucket, one call
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True),
        module=module,
    )
    ddp.zero_grad_buffer()

    def train_step() -> None:
        ddp(torch.full((4, 32), float(rank))).sum().backward()
        ddp.finish_grad_sync()

    out["ddp_overlapped_step"] = calls(train_step)
    out["buckets"] = sum(len(g.buckets) for g in ddp.bucket_groups)
    out["grad"] = [p.main_grad.sum().item() for p in ddp.module.parameters()]
    return out


def test_each_op_is_one_backend_call_and_a_bucket_is_one_all_reduce():
    results = harness.run(2, _calls_per_op, timeout=180)
    for rank, r in results.items():
        assert r["all_reduce"] == ["allreduce"], (rank, r)
        assert r["all_reduce_async"] == ["allreduce"] and r["async_work"] == NativeWork.__name__, (rank, r)
        assert r["coalesced_bucket"] == ["allreduce_coalesced"], (rank, r)
        assert r["reduce_scatter_in_place"] == ["_reduce_scatter_base"], (rank, r)
        assert r["all_gather_in_place"] == ["_allgather_base"], (rank, r)
        assert r["buckets"] == 1 and r["ddp_overlapped_step"] == ["allreduce_coalesced"], (rank, r)
        # Companion: the counter does see several calls where several are made (gloo has no
        # coalesced reduce-scatter: two tensors are two calls).
        assert r["coalesced_two_reduce_scatters"] == ["_reduce_scatter_base"] * 2, (rank, r)
    assert results[0]["grad"] == results[1]["grad"], "the data-parallel replicas' gradients differ"
