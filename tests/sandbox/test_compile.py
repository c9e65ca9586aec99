"""``--tm-compile`` on CPU: compiled job ranks record, compiled standbys replay bit-identically."""

from __future__ import annotations

import pytest

from support.sandbox_jobs import RECORD_ITERS, pp3_argv, record_job


def _compiled_collective_goes_through_the_group() -> list[str]:
    """Child: a compiled module whose forward all-reduces; which group methods saw the call?"""
    import torch
    import torch.distributed as dist

    from trainmover_ext.sandbox.compile import compile_chunk

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: list[str] = []
    original = dist.ProcessGroup.allreduce

    def spy(pg, *args, **kwargs):
        seen.append("allreduce")
        return original(pg, *args, **kwargs)

    dist.ProcessGroup.allreduce = spy

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            dist.all_reduce(y)
            return y.relu().sum()

    net = compile_chunk(Net())
    for _ in range(2):
        net(torch.randn(2, 8)).backward()
    dist.ProcessGroup.allreduce = original
    dist.destroy_process_group()
    return seen


def _compiled_on_nccl_delta_built_quietly() -> bool:
    """Child: a compiled module on nccl_delta (a Python process group), built inside the joiner's
    ``no_collectives`` (which swaps ``torch.distributed.all_reduce`` for the build), runs forward and
    backward, including an ``all_reduce(MAX)`` inside an autograd function as megatron's cross entropy."""
    import torch
    import torch.distributed as dist

    import nccl_delta
    from trainmover_ext.runtime.quiet_build import no_collectives
    from trainmover_ext.sandbox.compile import compile_chunk

    nccl_delta.register(nccl_delta.DeltaConfig(link_host="127.0.0.1"))
    dist.init_process_group(nccl_delta.BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1)

    class Stable(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            peak = y.max(dim=-1)[0]
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            return (y - peak.unsqueeze(-1)).exp().sum()

        @staticmethod
        def backward(ctx, grad):
            return None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            dist.all_reduce(y)
            return Stable.apply(y.relu()) + y.sum()

    with no_collectives():
        net = compile_chunk(Net())
    for _ in range(2):
        net(torch.randn(2, 8)).backward()
    dist.destroy_process_group()
    return True


def test_compiled_model_runs_on_nccl_delta_after_a_quiet_build():
    from harness import sandbox as harness

    assert harness.fork_children({"c": (_compiled_on_nccl_delta_built_quietly,)}).results(300)["c"] is True


def test_compiled_collectives_stay_visible_to_the_recorder():
    from harness import sandbox as harness

    seen = harness.fork_children({"c": (_compiled_collective_goes_through_the_group,)}).results(300)["c"]
    assert seen == ["allreduce", "allreduce"]


@pytest.mark.slow
def test_compiled_standby_replays_compiled_job(tmp_path, corpus):
    from harness import sandbox as harness

    job = record_job(tmp_path, pp3_argv(corpus, "--tm-compile"), timeout=600)
    standby = harness.fork_children({"s": (harness.standby_process, job.argv, 3, job.record_dir)}).results(600)["s"]
    assert all(r["compiled"] for r in standby["results"])
    for role in ("first", "middle", "last"):
        real = {s["iteration"]: s for s in job.recorder(role)["steps"]}
        shadow = [s for s in standby["shadow"] if s["role"] == role]
        assert len(shadow) == RECORD_ITERS
        for s in shadow:
            assert (s["loss"], s["grad"], s["param"]) == tuple(
                real[s["iteration"]][k] for k in ("loss", "grad", "param")
            )
