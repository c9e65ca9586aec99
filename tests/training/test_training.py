"""Training correctness with real processes: layout parity and exact resume."""

from __future__ import annotations

from helpers import LLAMA, kill_quietly, losses_by_iteration, read_metrics, run_job, start_job, tiny_args, wait_for


def test_tp2_pp2_dp2_matches_single_rank(tmp_path, corpus):
    """8 ranks TP2xPP2xDP2 (with and without the distributed optimizer) = 1 rank, within 1e-5.
    Dropout off: TP ranks draw their own masks, so layouts differ by design with it on."""
    single = run_job(tmp_path, 1, tiny_args(corpus, dropout=0), name="tp1pp1")
    grid = run_job(tmp_path, 8, tiny_args(corpus, tp=2, pp=2, dropout=0), name="tp2pp2dp2")
    dist = run_job(
        tmp_path, 8, tiny_args(corpus, tp=2, pp=2, dropout=0, extra=["--use-distributed-optimizer"]), name="distopt"
    )
    ref = losses_by_iteration(single.metrics_path)
    assert sorted(ref) == list(range(1, 11))
    for job in (grid, dist):
        got = losses_by_iteration(job.metrics_path)
        assert sorted(got) == sorted(ref)
        for it in ref:
            assert abs(got[it] - ref[it]) <= 1e-5, (job.metrics_path, it, got[it], ref[it])
    # training actually learns something: the loss moves
    assert ref[10] < ref[1]


def test_llama_architecture_matches_across_layouts(tmp_path, corpus):
    """RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no linear biases, untied output: TP2 x
    PP2 x DP2 = 1 rank within 1e-5 (dropout off), so the layout-independent initialisation lays out the
    SwiGLU gate/up rows and the query groups of each TP shard the way megatron-core reads them."""
    single = run_job(tmp_path, 1, tiny_args(corpus, dropout=0, extra=LLAMA), name="llama_tp1")
    grid = run_job(tmp_path, 8, tiny_args(corpus, tp=2, pp=2, dropout=0, extra=LLAMA), name="llama_tp2pp2")
    ref, got = losses_by_iteration(single.metrics_path), losses_by_iteration(grid.metrics_path)
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    for it in ref:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
    assert ref[10] < ref[1]


def test_resume_after_sigkill_is_bit_identical(tmp_path, corpus):
    """Save at 5, SIGKILL every rank, resume: 6.. are bit-identical and consumed samples match."""
    iters = 12
    args = tiny_args(corpus, tp=2, pp=2, iters=iters, extra=["--save-interval", "5"])
    ref_dir, run_dir = tmp_path / "ref_ckpt", tmp_path / "ckpt"
    ref = run_job(tmp_path, 8, args + ["--save", str(ref_dir)], name="reference")

    job = start_job(tmp_path, 8, args + ["--save", str(run_dir)], name="killed")
    latest = run_dir / "latest_checkpointed_iteration.txt"
    wait_for(lambda: latest.exists() and latest.read_text().strip() == "5", 240, what="checkpoint 5")
    pids = job.rank_pids()[0]
    for pid in pids:
        kill_quietly(pid)
    kill_quietly(job.popen.pid)
    job.popen.wait(30)
    done = [r["iteration"] for r in read_metrics(job.metrics_path)]
    assert max(done) < iters, "the job finished before it was killed; the test proved nothing"

    resumed = run_job(tmp_path, 8, args + ["--save", str(run_dir), "--load", str(run_dir)], name="resumed")
    startup = read_metrics(resumed.metrics_path, "startup")
    assert startup[0]["resumed_iteration"] == 5
    ref_recs = {r["iteration"]: r for r in read_metrics(ref.metrics_path)}
    res_recs = {r["iteration"]: r for r in read_metrics(resumed.metrics_path)}
    assert sorted(res_recs) == list(range(6, iters + 1))
    for it in range(6, iters + 1):
        assert res_recs[it]["loss"] == ref_recs[it]["loss"], (it, res_recs[it]["loss"], ref_recs[it]["loss"])
        assert res_recs[it]["consumed_samples"] == ref_recs[it]["consumed_samples"]
