"""``--use-tp-pp-dp-mapping`` (megatron-core's order ``tp-cp-ep-pp-dp``): consecutive ranks hold whole
pipelines and each data-parallel replica lives on other ranks. Real processes, real etcd, dropout 0.1."""

from __future__ import annotations

from helpers import ITERS, fell_back, read_metrics, replaced, run_job, tm_args, trajectory, transfer_pairs


def test_a_failure_under_the_tp_pp_dp_order_is_bit_identical(tmp_path, corpus, reference):
    """Rank 5 is (tp 1, pp 0, dp 1) in this order: its replica is rank 1, not rank 7 as in the default
    order. The same grid coordinates draw the same samples and dropout masks, so the run equals the
    default order's fault-free run bit for bit."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path,
        8,
        tm_args(corpus, extra=["--use-tp-pp-dp-mapping", "--tm-inject-fault", "5:6:backward"]),
        name="tp_pp_dp",
        timeout=400,
    )
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert {it: got[it] for it in ref if got[it] != ref[it]} == {}, "not bit-identical to the default order's run"
    assert [r["rank"] for r in replaced(job, "failure")] == [5] and not fell_back(job)
    assert transfer_pairs(job) == {(1, 5)}, transfer_pairs(job)
    assert len(read_metrics(job.metrics_path, "startup")) == 1
