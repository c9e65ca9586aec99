"""``--ckpt-format torch_dist`` under ``--trainmover``: the job's groups run on nccl_delta, whose
collectives (its scatter among them) carry megatron-core's planning. Real processes, real etcd,
dropout 0.1."""

from __future__ import annotations

import os

from helpers import (
    ITERS,
    fell_back,
    losses_by_iteration,
    read_metrics,
    replaced,
    run_job,
    tiny_args,
    tm_args,
    trajectory,
)


def test_a_trainmover_job_writes_torch_dist_that_resumes_bit_identically(tmp_path, corpus, reference):
    """TP2·PP2·DP2 under --trainmover saves torch_dist every 4 iterations while rank 5 is replaced after
    a SIGKILL (bit-identical to the fault-free run); a plain job resumed from its checkpoint 8 trains
    9..12 bit-identically to that run too."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    ckpt = tmp_path / "ckpt"
    dist = ["--ckpt-format", "torch_dist", "--save", str(ckpt), "--save-interval", "4"]
    job = run_job(
        tmp_path, 8, tm_args(corpus, extra=dist + ["--tm-inject-fault", "5:6:backward"]), name="tm_dist", timeout=400
    )
    got = trajectory(job.metrics_path)
    assert {it: got[it] for it in ref if got.get(it) != ref[it]} == {}, "not bit-identical to the fault-free run"
    assert [r["rank"] for r in replaced(job, "failure")] == [5] and not fell_back(job)
    for it in (4, 8, ITERS):
        assert os.path.isfile(ckpt / f"iter_{it:07d}" / "metadata.json"), it
    (ckpt / "latest_checkpointed_iteration.txt").write_text("8")
    resumed = run_job(
        tmp_path,
        8,
        tiny_args(corpus, tp=2, pp=2, iters=ITERS, extra=["--load", str(ckpt)]),
        name="resumed",
    )
    assert read_metrics(resumed.metrics_path, "startup")[0]["resumed_iteration"] == 8
    losses = losses_by_iteration(resumed.metrics_path)
    assert sorted(losses) == list(range(9, ITERS + 1))
    assert all(losses[it] == ref[it][0] for it in losses), {it: (losses[it], ref[it][0]) for it in losses}


def test_no_replica_left_falls_back_to_the_torch_dist_checkpoint(tmp_path, corpus, reference):
    """TP2·PP2 with one replica (DP1): rank 1 dies in iteration 6, no rank holds its state, so every rank
    (the joiner too) loads the torch_dist checkpoint of iteration 4 over nccl_delta and re-runs 5 and 6,
    bit-identical to the fault-free run."""
    ref = reference("tp2pp2", 4, tm_args(corpus, gbs=4))
    dist = ["--ckpt-format", "torch_dist", "--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    job = run_job(
        tmp_path, 4, tm_args(corpus, gbs=4, extra=dist + ["--tm-inject-fault", "1:6:backward"]), name="fallback"
    )
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert {it: got[it] for it in ref if got[it] != ref[it]} == {}, "not bit-identical to the fault-free run"
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [4]
    assert not fell_back(job)
