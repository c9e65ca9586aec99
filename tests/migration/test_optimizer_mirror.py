"""The distributed optimizer without a rollback: each rank's optimizer shard mirrored in a peer's host
memory (``--tm-optimizer-mirror``, on by default), and a lost rank replaced from that copy.

Real processes, a real etcd, SIGKILL, bf16 with megatron's default dropout (0.1); every faulted run's
loss trajectory is compared bit for bit with a fault-free run of the same flags. No job here saves a
checkpoint unless it says so: recovering at all proves the state came from the mirror.
"""

from __future__ import annotations

import pytest

from helpers import (
    assert_killed,
    assert_recovered,
    read_metrics,
    run_job,
    state_sources,
    tm_args,
    trajectory,
    transfers,
)

DISTOPT = ["--bf16", "--use-distributed-optimizer"]


def _mirror_copies(job) -> set[tuple[int, int]]:
    """(holder, ward) of every shard served from a mirror."""
    return {(t.rank, t.peer) for t in transfers(job) if t.side == "sent" and t.mirror}


@pytest.mark.parametrize("phase", ["backward", "step"])
def test_a_lost_rank_takes_its_shard_from_the_mirror(tmp_path, corpus, reference, phase):
    """TP2 x PP2 x DP2, no checkpoint: rank 5 dies in iteration 7; its holder (rank 7, its data-parallel
    peer) serves the shard of iteration 6, and the job goes on from there bit-identically."""
    base = tm_args(corpus, extra=DISTOPT)
    ref = reference("tp2pp2dp2-bf16-distopt", 8, base)
    job = run_job(tmp_path, 8, base + ["--tm-inject-fault", f"5:7:{phase}"], name=f"mirror_{phase}")
    assert_recovered(job, ref, 5)
    assert_killed(job, 5)
    assert state_sources(job, 5) == ["mirror"]
    assert (7, 5) in _mirror_copies(job), job.stdout()[-3000:]
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [6]


def test_dp4_kill_in_the_parameter_all_gather(tmp_path, corpus, reference):
    """TP1 x PP2 x DP4: rank 6 dies inside the all-gather of the updated parameters, after its peers
    stepped their shards. Their shards are one step ahead of what the job can resume at: they roll
    back from their own holders' mirrors, and the model parameters are rebuilt from the main ones."""
    base = tm_args(corpus, tp=1, extra=DISTOPT)
    ref = reference("tp1pp2dp4-bf16-distopt", 8, base)
    job = run_job(tmp_path, 8, base + ["--tm-inject-fault", "6:6:in-gather"], name="mirror_gather")
    assert "inside all_gather" in job.stdout(), job.stdout()[-3000:]
    assert_recovered(job, ref, 6)
    assert state_sources(job, 6) == ["mirror"]
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [5]


def test_holder_and_ward_lost_together_fall_back_to_the_checkpoint(tmp_path, corpus, reference):
    """DP=2: ranks 5 and 7 hold each other's shard; killed in the same iteration, neither shard has a
    copy, so every rank reloads checkpoint 4, and the plan says why (the two deaths may land in one
    plan or two: the second then finds the first's replacement holding no copy yet)."""
    base = tm_args(corpus, extra=DISTOPT)
    ref = reference("tp2pp2dp2-bf16-distopt", 8, base)
    ckpt = str(tmp_path / "ckpt")
    two = list(base)
    two[two.index("--tm-standbys") + 1] = "2"
    job = run_job(
        tmp_path,
        8,
        two + ["--save", ckpt, "--save-interval", "4", "--tm-inject-fault", "5:7:backward,7:7:backward"],
        name="mirror_both",
    )
    assert trajectory(job.metrics_path) == ref
    sources = [
        r["state_source"]
        for p in job.migrations()
        for r in p["replacements"]
        if r["rank"] in (5, 7) and p["reason"] == "failure"
    ]
    assert sources[-1]["kind"] == "checkpoint" and "lost too" in sources[-1]["why"], sources
    assert 4 in [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")]
