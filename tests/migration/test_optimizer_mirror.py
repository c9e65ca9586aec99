"""The distributed optimizer without a rollback: each rank's optimizer shard mirrored in a peer's host
memory (``--tm-optimizer-mirror``, on by default), and a lost rank replaced from that copy.

Real processes, a real etcd, SIGKILL, bf16 with megatron's default dropout (0.1); every faulted run's
loss trajectory is compared bit for bit with a fault-free run of the same flags. No job here saves a
checkpoint unless it says so: recovering at all proves the state came from the mirror.
"""

from __future__ import annotations

import pytest
import torch

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
from trainmover_ext.migration.mirror_copy import HELPER_ENV

DISTOPT = ["--bf16", "--use-distributed-optimizer"]


def _mirror_copies(job) -> set[tuple[int, int]]:
    """(holder, ward) of every shard served from a mirror."""
    return {(t.rank, t.peer) for t in transfers(job) if t.side == "sent" and t.mirror}


LAYOUTS = {2: 2, 4: 1}
"""Data-parallel size -> tensor-parallel size of the 8-rank jobs (pipeline 2)."""

CELLS = [
    # dp, victim, iteration, phase, resumed at
    (2, 5, 7, "backward", 6),  # nobody stepped: no rollback
    (2, 5, 7, "step", 6),  # the other groups completed 7 and roll back; rank 7 stepped in place: its own copy
    (2, 5, 6, "in-gather", 5),
    (2, 5, 7, "mirror", 6),  # its copy of 7 never lands: everyone goes back to 6, from their own copies
    (4, 6, 7, "forward", 6),
    (4, 6, 7, "allreduce", 6),  # before its gradient reduce-scatter
    (4, 6, 6, "in-gather", 5),  # its peers stepped their shards: they roll back from their holders
]


@pytest.mark.parametrize(
    "dp,victim,iteration,phase,resumed",
    [pytest.param(*c, id=f"dp{c[0]}-{c[3]}", marks=() if i == 0 else pytest.mark.slow) for i, c in enumerate(CELLS)],
)
def test_a_lost_rank_takes_its_shard_from_the_mirror(
    tmp_path, corpus, reference, dp, victim, iteration, phase, resumed
):
    """8 ranks (TP2 x PP2 x DP2, or TP1 x PP2 x DP4), no checkpoint: the victim's holder serves its shard
    of the resume iteration, ranks ahead of it roll back, the parameters are rebuilt from the main
    ones, and the job goes on bit-identically; with no rollback every iteration is logged once."""
    _kill_and_recover(tmp_path, corpus, reference, dp, victim, iteration, phase, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [CELLS[3], CELLS[6]], ids=["dp2-mirror", "dp4-in-gather"])
def test_the_sends_posted_from_the_helper_thread(tmp_path, corpus, reference, cell):
    """The path an accelerator's copy takes (``mirror_copy``): every rank's send of its copy is posted
    from the helper thread while the training thread goes on. A victim killed between its header and
    its copy's post (its copy never lands: everyone goes back one step), and peers that stepped rolling
    back from their holders' copies, recover bit-identically as on the direct path."""
    job = _kill_and_recover(tmp_path, corpus, reference, *cell, env={HELPER_ENV: "1"})
    assert "posted from a helper thread" in job.stdout(), job.stdout()[-3000:]


def _kill_and_recover(tmp_path, corpus, reference, dp, victim, iteration, phase, resumed, env=None):
    base = tm_args(corpus, tp=LAYOUTS[dp], extra=DISTOPT)
    ref = reference(f"tp{LAYOUTS[dp]}pp2dp{dp}-bf16-distopt", 8, base)
    job = run_job(
        tmp_path, 8, base + ["--tm-inject-fault", f"{victim}:{iteration}:{phase}"], name=f"mirror_{phase}", env=env
    )
    if phase.startswith("in-"):
        assert "inside all_gather" in job.stdout(), job.stdout()[-3000:]
    else:
        assert_killed(job, victim)
    assert_recovered(job, ref, victim)
    assert state_sources(job, victim) == ["mirror"]
    holders = {5: 7, 6: 7}  # DP2: the peer; DP4: the next data-parallel rank (one node)
    assert (holders[victim], victim) in _mirror_copies(job), job.stdout()[-3000:]
    assert [r["resumed_iteration"] for r in read_metrics(job.metrics_path, "recovered")] == [resumed]
    if phase in ("forward", "backward", "allreduce"):  # nobody stepped: nothing is re-run
        logged = [r["iteration"] for r in read_metrics(job.metrics_path, "iteration")]
        assert sorted(logged) == sorted(set(logged)), f"an iteration was logged twice: {logged}"
    return job


@pytest.mark.slow
def test_holder_and_ward_lost_together_fall_back_to_the_checkpoint(tmp_path, corpus, reference):
    """DP=2: ranks 5 and 7 hold each other's shard; killed in the same iteration, neither shard has a
    copy, so every rank reloads checkpoint 4 (torch_dist, with the distributed optimizer's state, as
    Megatron-LM writes it), and the plan says why (the two deaths may land in one plan or two: the
    second then finds the first's replacement holding no copy yet)."""
    base = tm_args(corpus, extra=DISTOPT)
    ref = reference("tp2pp2dp2-bf16-distopt", 8, base)
    ckpt = str(tmp_path / "ckpt")
    two = list(base)
    two[two.index("--tm-standbys") + 1] = "2"
    job = run_job(
        tmp_path,
        8,
        two
        + ["--save", ckpt, "--save-interval", "4", "--ckpt-format", "torch_dist"]
        + ["--tm-inject-fault", "5:7:backward,7:7:backward"],
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


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (DP=2 on NCCL)"
)
def test_a_lost_rank_takes_its_shard_from_the_mirror_on_gpus(tmp_path, corpus):
    """2 GPUs (scripts/gpu_check_multi.sh), TP1 x PP1 x DP2 on NCCL, bf16: each rank's shard is copied from
    the device on a side stream into page-locked memory and sent from the helper thread; rank 1 is
    killed in its backward, its replacement takes the shard from rank 0's host memory, and the job goes
    on bit-identically."""
    base = tm_args(corpus, tp=1, pp=1, extra=DISTOPT)
    ref = trajectory(run_job(tmp_path, 2, base, name="ref").metrics_path)
    job = run_job(tmp_path, 2, base + ["--tm-inject-fault", "1:7:backward"], name="gpu_mirror")
    assert_killed(job, 1)
    assert_recovered(job, ref, 1)
    assert state_sources(job, 1) == ["mirror"]
    out = job.stdout()
    assert "copied from the device on a side stream, posted from a helper thread" in out, out[-3000:]
