"""``--tm-compile`` on CPU: compiled job ranks record, compiled standbys replay bit-identically."""

from __future__ import annotations

import pytest

from sandbox_jobs import RECORD_ITERS, pp3_argv, record_job


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


def test_compiled_collectives_stay_visible_to_the_recorder():
    from trainmover_ext.sandbox import harness

    seen = harness.fork_children({"c": (_compiled_collective_goes_through_the_group,)}).results(300)["c"]
    assert seen == ["allreduce", "allreduce"]


@pytest.mark.slow
def test_compiled_standby_replays_compiled_job(tmp_path, corpus):
    from trainmover_ext.sandbox import harness

    job = record_job(tmp_path, pp3_argv(corpus, "--tm-compile"), timeout=600)
    standby = harness.fork_children({"s": (harness.standby_process, job.argv, 3, job.record_dir)}).results(600)["s"]
    assert all(r["compiled"] for r in standby["results"])
    for role in ("first", "middle", "last"):
        real = {s["iteration"]: s for s in job.recorder(role)["steps"]}
        shadow = [s for s in standby["shadow"] if s["role"] == role]
        assert len(shadow) == RECORD_ITERS
        for s in shadow:
            assert (s["loss"], s["grad"], s["param"]) == tuple(real[s["iteration"]][k] for k in ("loss", "grad", "param"))
