"""GPU: the NCCL transport carries the same collectives (run by scripts/gpu_check_multi.sh: 2+ GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from . import harness

pytestmark = pytest.mark.gpu
# NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"), so a
# 2-rank NCCL link needs 2 devices.
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL allows one rank per device)",
)


def _gpu_ops(rank, n, store):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(100003, dtype=torch.float32, device=dev) * (rank + 1)
    dist.all_reduce(x)
    out = torch.empty(n * 10, device=dev)
    dist.all_gather_into_tensor(out, torch.full((10,), float(rank), device=dev))
    rs = torch.empty(7, device=dev)
    dist.reduce_scatter_tensor(rs, torch.ones(7 * n, device=dev))
    b = torch.full((33,), float(rank), device=dev)
    dist.broadcast(b, 1)
    torch.cuda.synchronize()
    expect = torch.arange(100003, dtype=torch.float32) * sum(range(1, n + 1))
    return dict(
        allreduce=bool(torch.allclose(x.cpu(), expect)),
        allgather=out.cpu().tolist() == [float(r) for r in range(n) for _ in range(10)],
        reduce_scatter=rs.cpu().tolist() == [float(n)] * 7,
        broadcast=bool((b == 1).all()),
    )


@needs_cuda
def test_nccl_transport_collectives():
    results = harness.run(2, _gpu_ops, config=harness.test_config(transport="nccl"), timeout=300)
    for rank, checks in results.items():
        assert all(checks.values()), (rank, checks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_transport_is_nccl_with_cuda():
    import nccl_delta

    assert nccl_delta.DeltaConfig(transport="auto").resolved_transport() == "nccl"
