"""Every collective megatron issues, on nccl_delta, against torch's own gloo in the same ranks.

Random shapes and dtypes (seeded per case, identical on every rank); tensors
are small, and the pipeline segment is shrunk to 4 KiB so that small tensors
still take the segmented ring path. Results must be allclose to gloo's
(exact for integers, max and min) and bit-identical across ranks.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from . import harness

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SHAPES = [(1,), (7,), (3, 5), (1031,), (64, 33), (2, 3, 257), (0,), (5000,)]


def _values(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = TOL[a.dtype]
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * 4)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _cases(rank, n, store, n_cases):
    ref = dist.new_group(backend="gloo")
    failures, digests = [], []

    def check(name, ours, theirs, digest=True):
        if not _close(ours, theirs):
            diff = (ours.double() - theirs.double()).abs().max().item() if ours.shape == theirs.shape else "shape"
            failures.append(f"rank {rank} {name}: max diff {diff}")
        if digest:
            digests.append((name, _digest(ours)))

    for case in range(n_cases):
        g = torch.Generator().manual_seed(1000 * n + case)
        dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
        shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
        root = int(torch.randint(n, (1,), generator=g))
        x = _values(shape, dtype, seed=case * 97 + rank)
        tag = f"case{case}[{dtype},{shape}]"

        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op, group=ref)
            check(f"{tag} all_reduce {op}", ours, theirs)
        if dtype.is_floating_point:
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours, op=dist.ReduceOp.AVG)
            dist.all_reduce(theirs, group=ref)  # gloo has no AVG
            check(f"{tag} all_reduce AVG", ours, (theirs.double() / n).to(dtype))

        if x.dim() >= 2:  # non-contiguous input is copied back correctly
            ours, theirs = x.clone().transpose(0, 1), x.clone().transpose(0, 1)
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=ref)
            check(f"{tag} all_reduce transposed", ours, theirs)

        flat = x.reshape(-1)
        ours, theirs = torch.empty(n * flat.numel(), dtype=dtype), torch.empty(n * flat.numel(), dtype=dtype)
        dist.all_gather_into_tensor(ours, flat)
        dist.all_gather_into_tensor(theirs, flat, group=ref)
        check(f"{tag} all_gather_into_tensor", ours, theirs)

        ours_list = [torch.empty_like(x) for _ in range(n)]
        theirs_list = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(ours_list, x)
        dist.all_gather(theirs_list, x, group=ref)
        for k in range(n):
            check(f"{tag} all_gather[{k}]", ours_list[k], theirs_list[k])

        big = _values((n * max(1, flat.numel()),), dtype, seed=case * 31 + rank)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            ours, theirs = torch.empty(big.numel() // n, dtype=dtype), torch.empty(big.numel() // n, dtype=dtype)
            before = big.clone()
            dist.reduce_scatter_tensor(ours, big, op=op)
            dist.reduce_scatter_tensor(theirs, big, op=op, group=ref)
            check(f"{tag} reduce_scatter_tensor {op}", ours, theirs, digest=False)
            if not torch.equal(before, big):
                failures.append(f"rank {rank} {tag} reduce_scatter modified its input")

        ours, theirs = x.clone(), x.clone()
        dist.broadcast(ours, src=root)
        dist.broadcast(theirs, src=root, group=ref)
        check(f"{tag} broadcast(src={root})", ours, theirs)

        # Point to point around the ring, as megatron's batched p2p does it.
        recv = torch.empty_like(x)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x.contiguous(), (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        )
        for req in reqs:
            req.wait()
        check(f"{tag} batch_isend_irecv", recv, _values(shape, dtype, seed=case * 97 + (rank - 1) % n), digest=False)

        # Coalesced all-reduce (DDP's bucket path) of two dtypes at once.
        a, b = x.clone(), _values((11,), torch.float32, seed=case + rank)
        ra, rb = a.clone(), b.clone()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        cm.wait()
        dist.all_reduce(ra, group=ref)
        dist.all_reduce(rb, group=ref)
        check(f"{tag} coalesced a", a, ra)
        check(f"{tag} coalesced b", b, rb)

    dist.barrier()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "payload": list(range(rank))})
    if objs != [{"rank": k, "payload": list(range(k))} for k in range(n)]:
        failures.append(f"rank {rank} all_gather_object: {objs}")
    lst = [f"from-{rank}", rank] if rank == 1 % n else [None, None]
    dist.broadcast_object_list(lst, src=1 % n)
    if lst != [f"from-{1 % n}", 1 % n]:
        failures.append(f"rank {rank} broadcast_object_list: {lst}")
    # scatter (torch.distributed.checkpoint plans with it): member k gets the root's k-th input
    root = (n - 1) % n
    got = torch.empty(3, dtype=torch.float64)
    inputs = [torch.full((3,), 10.0 * k + 0.5, dtype=torch.float64) for k in range(n)]
    dist.scatter(got, inputs if rank == root else None, src=root)
    if got.tolist() != [10.0 * rank + 0.5] * 3:
        failures.append(f"rank {rank} scatter: {got.tolist()}")
    out = [None]
    dist.scatter_object_list(out, [{"to": k} for k in range(n)] if rank == 0 else None, src=0)
    if out != [{"to": rank}]:
        failures.append(f"rank {rank} scatter_object_list: {out}")
    return failures, digests


def _check(results):
    failures = [f for fs, _ in results.values() for f in fs]
    assert not failures, "\n".join(failures[:20])
    digests = {rank: d for rank, (_, d) in results.items()}
    first = digests[0]
    for rank, d in digests.items():
        assert d == first, f"rank {rank} results differ bitwise from rank 0"


SMALL_SEGMENTS = dict(segment_bytes=4096, small_bytes=256)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_gloo(world_size):
    _check(harness.run(world_size, _cases, 6, config=harness.test_config(**SMALL_SEGMENTS)))


def test_collectives_match_gloo_8_ranks():
    _check(harness.run(8, _cases, 2, config=harness.test_config(**SMALL_SEGMENTS), timeout=180))


def test_collectives_default_segments():
    """Default segment and small-message sizes (the production path) on a 3-rank ring."""
    _check(harness.run(3, _cases, 4))


def _large(rank, n, store):
    """All-reduces whose chunks are split (two segments and more, odd sizes) at the default segment size,
    each twice so the second reuses the reduce-scatter scratch."""
    from nccl_delta import ring

    ref = dist.new_group(backend="gloo")
    failures, digests = [], []
    for numel, dtype in (
        (n * 262_147 + 5, torch.float32),
        (n * 1_500_001, torch.float32),
        (n * 700_003 + 1, torch.bfloat16),
    ):
        for repeat in range(2):
            x = _values((numel,), dtype, seed=numel + 7 * rank + repeat)
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=ref)
            if not _close(ours, theirs):
                failures.append(
                    f"rank {rank} all_reduce {numel} {dtype} #{repeat}: "
                    f"max diff {(ours.double() - theirs.double()).abs().max().item()}"
                )
            digests.append((f"{numel} {dtype} #{repeat}", _digest(ours)))
    scratch = ring._local.scratch[torch.device("cpu")].numel()
    if scratch != ring.RECV_DEPTH * (4 << 20):
        failures.append(f"rank {rank}: reduce-scatter scratch is {scratch} bytes, not RECV_DEPTH segments")
    return failures, digests


def test_large_all_reduce_default_segments():
    """The production segmenting of large tensors: chunks split in two or more, receives through the
    reused scratch; allclose to gloo and bit-identical on every rank."""
    _check(harness.run(3, _large))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [5, 6, 7, 8])
def test_collectives_match_gloo_many_cases(world_size):
    _check(harness.run(world_size, _cases, 16, config=harness.test_config(**SMALL_SEGMENTS), timeout=240))


def _in_place(rank, n, store):
    """megatron's distributed optimizer: reduce-scatter into, and all-gather from, this rank's own chunk."""
    ref = dist.new_group(backend="gloo")
    out = {}
    for numel in (6 * n, 1000 * n + 0):  # below and above the small-message threshold
        grads = _values((numel,), torch.float32, seed=rank + numel)
        ours, theirs = grads.clone(), grads.clone()
        k = numel // n
        dist.reduce_scatter_tensor(ours[rank * k : (rank + 1) * k], ours)
        dist.reduce_scatter_tensor(theirs[rank * k : (rank + 1) * k], theirs, group=ref)
        out[f"reduce_scatter {numel}"] = torch.equal(ours[rank * k : (rank + 1) * k], theirs[rank * k : (rank + 1) * k])
        params = torch.zeros(numel)
        params[rank * k : (rank + 1) * k] = float(rank + 1)
        dist.all_gather_into_tensor(params, params[rank * k : (rank + 1) * k])
        out[f"all_gather {numel}"] = params.tolist() == [float(r + 1) for r in range(n) for _ in range(k)]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_reduce_scatter_and_all_gather(world_size):
    for rank, checks in harness.run(world_size, _in_place, config=harness.test_config(**SMALL_SEGMENTS)).items():
        assert all(checks.values()), (rank, checks)
