"""Mixture-of-experts training with real processes: megatron-core's MoE layer on CPU, its all-to-all and
all-gather token dispatchers, and layout parity across expert-parallel sizes."""

from __future__ import annotations

from helpers import losses_by_iteration, run_job, tiny_args

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]


def test_expert_parallel_sizes_and_both_dispatchers_train_the_same_model(tmp_path, corpus):
    """4 ranks (PP2 x DP2) with EP 1 and EP 2 through the all-to-all dispatcher, and EP 2 through the
    all-gather one, train the same losses within 1e-5 (dropout off, fp32): every EP layout starts from
    the same expert weights (each expert named by its global index) and routes the same tokens. The
    1-rank dense run differs (the companion: the comparison can fail)."""

    def losses(name: str, *extra: str, nproc: int = 4) -> dict[int, float]:
        job = run_job(
            tmp_path, nproc, tiny_args(corpus, pp=2 if nproc > 1 else 1, dropout=0, extra=list(extra)), name=name
        )
        return losses_by_iteration(job.metrics_path)

    ref = losses("ep1", *MOE, "--expert-model-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall")
    assert sorted(ref) == list(range(1, 11)) and ref[10] < ref[1]
    for name, dispatcher in (("ep2_alltoall", "alltoall"), ("ep2_allgather", "allgather")):
        got = losses(name, *MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", dispatcher)
        assert sorted(got) == sorted(ref)
        assert all(abs(got[it] - ref[it]) <= 1e-5 for it in ref), (name, got, ref)
    dense = losses("dense", nproc=1)
    assert any(abs(dense[it] - ref[it]) > 1e-4 for it in ref)
