"""``--ckpt-format torch_dist``: megatron-core dist checkpoints, with real processes.

Each acceptance check has a companion that must fail it: a perturbed tensor changes the loss, a
broken checkpoint raises instead of training from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

from harness.jobs import PRETRAIN, REPO_ROOT
from helpers import losses_by_iteration, read_metrics, run_job, start_job, tiny_args

ITERS = 6
SAVE_AT = 3
DIST = ["--ckpt-format", "torch_dist"]
PERTURBED = "decoder.final_layernorm.weight"
"""The tensor the negative checks scale in a saved checkpoint (on the last pipeline stage)."""
PERTURB_FACTOR = 8.0
"""Near initialisation the logits are small, so the loss moves little with the last norm's scale: doubling
it moved the first loss by only 4e-4."""
MCORE_WRITER = os.path.join(REPO_ROOT, "tests", "support", "mcore_checkpoint.py")


def _iter_dir(root, iteration: int) -> str:
    return os.path.join(str(root), f"iter_{iteration:07d}")


def _perturbed_copy(src_root, dst_root, iteration: int, key: str = PERTURBED) -> str:
    """A copy of the torch_dist checkpoint of ``iteration`` under ``dst_root`` with the tensor ``key``
    times :data:`PERTURB_FACTOR` and everything else as saved (re-written in one process by torch's DCP, objects such as
    the RNG states as megatron-core stores them: pickled bytes)."""
    import io

    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, dst = _iter_dir(src_root, iteration), _iter_dir(dst_root, iteration)
    os.makedirs(dst)
    for name in os.listdir(src):  # megatron-core's own files (common.pt, metadata.json: which, by version)
        if not name.endswith(".distcp") and name != ".metadata":
            shutil.copy(os.path.join(src, name), dst)
    whole = os.path.join(str(dst_root), "whole.pt")
    dcp_to_torch_save(src, whole)
    state = torch.load(whole, weights_only=False)  # written just above, by this test
    assert key in state, sorted(state)[:20]
    state[key] = state[key] * PERTURB_FACTOR
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            buf = io.BytesIO()
            torch.save(value, buf)
            state[name] = buf
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(dst),
        planner=MCoreSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    with open(os.path.join(str(dst_root), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return str(dst_root)


def _resumed_losses(tmp_path, nproc: int, args: list[str], name: str) -> dict[int, float]:
    """Run a job that resumes from the checkpoint of :data:`SAVE_AT`; its losses, which must be those of
    iterations SAVE_AT+1..ITERS."""
    job = run_job(tmp_path, nproc, args, name=name)
    assert read_metrics(job.metrics_path, "startup")[0]["resumed_iteration"] == SAVE_AT
    got = losses_by_iteration(job.metrics_path)
    assert sorted(got) == list(range(SAVE_AT + 1, ITERS + 1))
    return got


def _max_difference(got: dict[int, float], want: dict[int, float]) -> float:
    assert sorted(got) and set(got) <= set(want), (sorted(got), sorted(want))
    return max(abs(got[it] - want[it]) for it in got)


def test_exact_resume_in_the_same_layout_is_bit_identical(tmp_path, corpus):
    """TP2·PP2 with dropout: save at 3 in torch_dist, resume; 4..6 bit-identical to an uninterrupted
    run. Negative: the same resume from a checkpoint with one weight scaled changes the loss."""
    args = tiny_args(corpus, tp=2, pp=2, iters=ITERS, extra=DIST + ["--save-interval", str(SAVE_AT)])
    ckpt = tmp_path / "ckpt"
    ref = run_job(tmp_path, 4, args + ["--save", str(ckpt)], name="uninterrupted")
    assert os.path.isfile(os.path.join(_iter_dir(ckpt, SAVE_AT), "metadata.json"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    # the resumed job saves too (iteration 6): a job resumed from torch_dist writes torch_dist
    resumed = run_job(tmp_path, 4, args + ["--load", str(ckpt), "--save", str(tmp_path / "again")], name="resumed")
    assert read_metrics(resumed.metrics_path, "startup")[0]["resumed_iteration"] == SAVE_AT
    want, got = losses_by_iteration(ref.metrics_path), losses_by_iteration(resumed.metrics_path)
    assert sorted(got) == list(range(SAVE_AT + 1, ITERS + 1))
    for it in got:
        assert got[it] == want[it], (it, got[it], want[it])
    print("same-layout resume: iterations", sorted(got), "bit-identical")
    assert os.path.isfile(os.path.join(_iter_dir(tmp_path / "again", ITERS), "metadata.json"))

    no_saving = tiny_args(corpus, tp=2, pp=2, iters=ITERS, extra=DIST)
    perturbed = _perturbed_copy(ckpt, tmp_path / "perturbed", SAVE_AT)
    broken = run_job(tmp_path, 4, no_saving + ["--load", perturbed], name="perturbed")
    worst = _max_difference(losses_by_iteration(broken.metrics_path), want)
    print(f"same-layout resume from a checkpoint with {PERTURBED} scaled: loss differs by up to {worst:.3e}")
    assert worst > 1e-3


def test_fp16_checkpoint_before_adams_first_step_resumes_bit_identically(tmp_path, corpus):
    """fp16 from the default loss scale skips every step through iteration 6 (the gradients overflow),
    so the checkpoint of iteration 3 holds Adam's step 0, which megatron-core leaves out of a saved
    state: the resume must still load, and 4..6 match an uninterrupted run in loss and loss scale
    (the scale halves each iteration, so a scaler not restored shows at once)."""
    args = tiny_args(corpus, pp=2, iters=ITERS, extra=DIST + ["--fp16", "--save-interval", str(SAVE_AT)])
    ckpt = tmp_path / "ckpt"
    ref = run_job(tmp_path, 2, args + ["--save", str(ckpt)], name="uninterrupted")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    no_saving = tiny_args(corpus, pp=2, iters=ITERS, extra=DIST + ["--fp16"])
    resumed = run_job(tmp_path, 2, no_saving + ["--load", str(ckpt)], name="resumed")

    def records(job) -> dict:
        return {r["iteration"]: (r["loss"], r["loss_scale"]) for r in read_metrics(job.metrics_path)}

    want, got = records(ref), records(resumed)
    assert sorted(got) == list(range(SAVE_AT + 1, ITERS + 1))
    assert want[SAVE_AT][1] < want[1][1], "no step was skipped: the case this test is about did not happen"
    for it in got:
        assert got[it] == want[it], (it, got[it], want[it])
    print("fp16 resume at Adam step 0:", {it: got[it] for it in sorted(got)})


def test_resume_under_another_layout_matches_the_saving_layout(tmp_path, corpus):
    """Saved at TP2·PP2 (4 ranks), resumed at TP1·PP4 (4 ranks): 4..6 within 1e-5 of the TP2·PP2
    continuation (dropout off: TP ranks draw their own masks). Negative: the same resume from a
    checkpoint with one weight scaled is off by more than 1e-3."""
    flags = DIST + ["--save-interval", str(SAVE_AT)]
    ckpt = tmp_path / "ckpt"
    ref = run_job(
        tmp_path,
        4,
        tiny_args(corpus, tp=2, pp=2, iters=ITERS, dropout=0, extra=flags) + ["--save", str(ckpt)],
        name="tp2pp2",
    )
    want = losses_by_iteration(ref.metrics_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    pp4 = tiny_args(corpus, tp=1, pp=4, iters=ITERS, dropout=0, extra=DIST)
    got = _resumed_losses(tmp_path, 4, pp4 + ["--load", str(ckpt)], "tp1pp4")
    worst = _max_difference(got, want)
    print(f"TP2·PP2 -> TP1·PP4 resume: iterations {sorted(got)}, worst loss difference {worst:.3e}")
    assert worst <= 1e-5, (got, want)

    perturbed = _perturbed_copy(ckpt, tmp_path / "perturbed", SAVE_AT)
    broken = run_job(tmp_path, 4, pp4 + ["--load", perturbed], name="tp1pp4_perturbed")
    worst = _max_difference(losses_by_iteration(broken.metrics_path), want)
    print(f"TP1·PP4 resume from a checkpoint with {PERTURBED} scaled: loss differs by up to {worst:.3e}")
    assert worst > 1e-3


DISTOPT = ["--use-distributed-optimizer"]
FP32_MAIN = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param"
"""The distributed optimizer's fp32 main parameters of one gradient bucket of the last pipeline stage,
as megatron-core keys them in bucket space (``dp_reshardable``)."""


def test_distributed_optimizer_state_resumes_bit_identically(tmp_path, corpus):
    """PP2·DP2, bf16, dropout 0.1, the distributed optimizer: save at 3 in torch_dist (its fp32 main
    shards and Adam moments by gradient bucket, its step), resume; 4..6 bit-identical (an Adam step
    not restored, or shared between parameters, shows from 5 on). Negative: the same resume with one
    bucket's fp32 main parameters scaled differs from iteration 5 on (the model's own weights are as
    saved, so iteration 4 still agrees: the optimizer state is what was read)."""
    flags = DIST + DISTOPT + ["--bf16"]
    args = tiny_args(corpus, pp=2, iters=ITERS, extra=flags + ["--save-interval", str(SAVE_AT)])
    ckpt = tmp_path / "ckpt"
    ref = run_job(tmp_path, 4, args + ["--save", str(ckpt)], name="uninterrupted")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    plain = tiny_args(corpus, pp=2, iters=ITERS, extra=flags)
    want = losses_by_iteration(ref.metrics_path)
    got = _resumed_losses(tmp_path, 4, plain + ["--load", str(ckpt)], "resumed")
    diffs = {it: (got[it], want[it]) for it in got if got[it] != want[it]}
    assert not diffs, f"not bit-identical: {diffs}"
    print("distributed-optimizer resume: iterations", sorted(got), "bit-identical")

    perturbed = _perturbed_copy(ckpt, tmp_path / "perturbed", SAVE_AT, key=FP32_MAIN)
    broken = losses_by_iteration(run_job(tmp_path, 4, plain + ["--load", perturbed], name="perturbed").metrics_path)
    print(f"with {FP32_MAIN} scaled: {broken} against {want}")
    assert broken[SAVE_AT + 1] == want[SAVE_AT + 1], "the model's own weights were not the saved ones"
    assert _max_difference(broken, want) > 1e-3


def test_distributed_optimizer_state_resumes_at_another_data_parallel_size(tmp_path, corpus):
    """Saved at PP2·DP2 (4 ranks), resumed at PP2·DP1 (2 ranks) and PP2·DP4 (8 ranks): each rank reads
    the bucket ranges its new shard covers, and 4..6 are within 1e-6 of the DP2 continuation
    (fp32, dropout off: another layout draws other masks and sums its micro-batches in another order).
    Negative: the DP1 resume with the optimizer left fresh is off by more than 1e-3. Another pipeline
    layout is refused with what to do (this state is laid out by gradient bucket)."""
    flags = DIST + DISTOPT
    args = tiny_args(corpus, pp=2, iters=ITERS, dropout=0, extra=flags + ["--save-interval", str(SAVE_AT)])
    ckpt = tmp_path / "ckpt"
    want = losses_by_iteration(run_job(tmp_path, 4, args + ["--save", str(ckpt)], name="dp2").metrics_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    plain = tiny_args(corpus, pp=2, iters=ITERS, dropout=0, extra=flags)
    for ranks in (2, 8):
        got = _resumed_losses(tmp_path, ranks, plain + ["--load", str(ckpt)], f"dp{ranks // 2}")
        worst = _max_difference(got, want)
        print(f"PP2·DP2 -> PP2·DP{ranks // 2} resume: worst loss difference {worst:.3e}")
        assert worst <= 1e-6, (got, want)

    # Negative: the same DP1 resume with the optimizer fresh (--no-load-optim) is far off.
    fresh = run_job(tmp_path, 2, plain + ["--load", str(ckpt), "--no-load-optim"], name="dp1_fresh")
    worst = _max_difference(losses_by_iteration(fresh.metrics_path), want)
    print(f"PP2·DP1 resume with a fresh optimizer: worst loss difference {worst:.3e}")
    assert worst > 1e-3
    # Bucket-space state does not load under another pipeline layout: refused before any iteration.
    pp1 = tiny_args(corpus, pp=1, iters=ITERS, dropout=0, extra=flags) + ["--load", str(ckpt)]
    job = start_job(tmp_path, 2, pp1, name="pp1")
    assert job.wait(300) == 2, job.stderr()[-3000:]
    assert "loads at another data-parallel size but not under another model-parallel layout" in job.stderr()
    assert "pipeline-model-parallel-size saved=2 now=1" in job.stderr()
    assert read_metrics(job.metrics_path) == []


def _pretrain_one_rank(tmp_path, flags: list[str], name: str) -> subprocess.CompletedProcess:
    """``pretrain_gpt.py`` as one process (no launcher), its metrics in ``NAME.metrics.jsonl``."""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    metrics = str(tmp_path / f"{name}.metrics.jsonl")
    cmd = [sys.executable, PRETRAIN, *flags, "--tm-metrics-file", metrics]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_mcore_checkpoint(out, flags: list[str], perturb: bool = False) -> float:
    """Run the plain megatron-core writer (tests/support/mcore_checkpoint.py); its model's loss."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    cmd = [
        sys.executable,
        MCORE_WRITER,
        str(out),
        *(["--perturb", str(PERTURB_FACTOR)] if perturb else []),
        "--",
        *flags,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])["loss"]


def test_a_megatron_core_checkpoint_resumes_under_pretrain_gpt(tmp_path, corpus):
    """A GPTModel built and saved by plain megatron-core (its own random init) resumes under
    pretrain_gpt.py: the first iteration's loss is the plain model's loss on that batch. Negative: a
    checkpoint that is not the model whose loss was measured (one weight scaled after measuring)
    gives another loss."""
    flags = tiny_args(corpus, iters=2, dropout=0, extra=["--lr-warmup-iters", "1"])
    plain_loss = _write_mcore_checkpoint(tmp_path / "mcore", flags)
    res = _pretrain_one_rank(tmp_path, flags + ["--load", str(tmp_path / "mcore")], "resumed")
    assert res.returncode == 0, res.stderr[-3000:]
    first = losses_by_iteration(str(tmp_path / "resumed.metrics.jsonl"))[1]
    print(f"megatron-core checkpoint: plain loss {plain_loss!r}, first loss under pretrain_gpt {first!r}")
    assert abs(first - plain_loss) <= 1e-6

    measured = _write_mcore_checkpoint(tmp_path / "mcore_perturbed", flags, perturb=True)
    res = _pretrain_one_rank(tmp_path, flags + ["--load", str(tmp_path / "mcore_perturbed")], "perturbed")
    assert res.returncode == 0, res.stderr[-3000:]
    first = losses_by_iteration(str(tmp_path / "perturbed.metrics.jsonl"))[1]
    print(f"perturbed megatron-core checkpoint: measured {measured!r}, loaded {first!r}")
    assert abs(first - measured) > 1e-4


def test_a_broken_torch_dist_checkpoint_is_a_clear_error(tmp_path, corpus):
    """Corrupt metadata, missing metadata, another model shape: exit 2 with a CheckpointError that says
    what to do, and no iteration trained. (The companion, a sound checkpoint of the same model
    loading, is the test above.)"""
    flags = tiny_args(corpus, iters=2, dropout=0, extra=["--lr-warmup-iters", "1"])
    good = tmp_path / "good"
    _write_mcore_checkpoint(good, flags)

    def broken_copy(name: str) -> str:
        shutil.copytree(good, tmp_path / name)
        return str(tmp_path / name)

    corrupt = broken_copy("corrupt")
    with open(os.path.join(_iter_dir(corrupt, 0), "metadata.json"), "w") as f:
        f.write("{not json")
    missing = broken_copy("missing")
    os.remove(os.path.join(_iter_dir(missing, 0), "metadata.json"))
    cases = [
        ("corrupt", flags + ["--load", corrupt], "cannot read the torch_dist checkpoint"),
        ("missing", flags + ["--load", missing], "holds neither per-rank files"),
        (
            "shape",
            tiny_args(corpus, iters=2, dropout=0, extra=["--lr-warmup-iters", "1", "--ffn-hidden-size", "64"])
            + ["--load", str(good)],
            "cannot load the torch_dist checkpoint",
        ),
    ]
    for name, case_flags, message in cases:
        res = _pretrain_one_rank(tmp_path, case_flags, name)
        assert res.returncode == 2, (name, res.returncode, res.stderr[-3000:])
        assert message in res.stderr, (name, res.stderr[-3000:])
        assert read_metrics(str(tmp_path / f"{name}.metrics.jsonl")) == [], name
        print(f"{name}: {res.stderr.strip().splitlines()[-1][:300]}")
