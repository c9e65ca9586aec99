"""Scheduled rebalancing on a real job: ``--tm-rebalance-interval`` rotates the ranks through the standby pool
with planned moves, one at a time, and training stays bit-identical to the run without them."""

from __future__ import annotations

from helpers import fell_back, finish_job, replaced, start_job, tm_args, trajectory

ITERS = 150


def test_scheduled_moves_rotate_ranks_through_the_pool_bit_identically(tmp_path, corpus, reference):
    """PP2 x DP2 in bf16 at dropout 0.1, one standby, a move every 3 s (0.05 min), the leaver rejoining the
    pool (--tm-leaver-becomes-standby): at least two planned moves, each of the rank served longest, none
    overlapping, and the losses of the run without them."""
    args = tm_args(corpus, tp=1, pp=2, gbs=8, iters=ITERS, extra=["--bf16"])
    ref = reference("tp1pp2dp2-bf16-i150", 4, args)
    extra = ["--tm-rebalance-interval", "0.05", "--tm-leaver-becomes-standby"]
    job = start_job(tmp_path, 4, args + extra, name="rebalance")
    err = finish_job(job, 400)
    asked = [e["detail"]["rank"] for e in job.events("rebalance")]
    moves = replaced(job)
    rejected = [e["detail"] for e in job.events("request_rejected")]
    if len(asked) == len(moves) + 1:  # asked as the job finished: no boundary was left for it
        assert [r["reason"][:22] for r in rejected] == ["the job is finishing: "], (rejected, asked)
        asked = asked[:-1]
    assert len(asked) >= 2, err[-3000:]
    assert [m["rank"] for m in moves] == asked and {m["reason"] for m in moves} == {"planned"}, (moves, asked)
    assert len(set(asked[:4])) == len(asked[:4]), f"a rank moved again before every rank had moved: {asked}"
    assert [m["epoch"] for m in moves] == list(range(1, len(moves) + 1))
    assert not fell_back(job)
    assert trajectory(job.metrics_path) == ref, "a scheduled move changed the numerics"
