"""--overlap-grad-reduce (megatron's asynchronous gradient reduction, bucket by bucket during the backward
pass) with a rank killed inside the gradient reduction: the stayers have reductions in flight on the
communicator the abandoned iteration leaves behind, and megatron's DDP must not wait for them again.
Real processes, real etcd, bf16, dropout 0.1, the default settings."""

from __future__ import annotations

from helpers import assert_recovered, run_job, tm_args


def test_a_kill_during_an_overlapped_gradient_reduction_is_bit_identical(tmp_path, corpus, reference):
    extra = ["--overlap-grad-reduce", "--bf16"]
    ref = reference("tp2pp2dp2-bf16-overlap", 8, tm_args(corpus, extra=extra))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=[*extra, "--tm-inject-fault", "5:6:allreduce"]), name="overlap")
    assert_recovered(job, ref, victim=5)
