"""torchrun's conventions: underscore flags, --nproc-per-node cpu, per-rank log files (real processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.jobs import PRETRAIN, REPO_ROOT
from helpers import tiny_args
from trainmover_ext.netutil import free_port


def _launch(tmp_path, *flags: str, script_args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "launch",
        *flags,
        "--run-dir",
        str(tmp_path / "run"),
        PRETRAIN,
        *script_args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def test_per_rank_log_files_with_redirects(tmp_path, corpus):
    """`--nproc_per_node 4 --log-dir D --redirects 3`: one stdout.log and stderr.log per rank, and the
    ranks' output goes to the files only (the console keeps the launcher's own lines)."""
    logs = tmp_path / "logs"
    res = _launch(
        tmp_path,
        "--nproc_per_node",
        "4",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        script_args=tiny_args(corpus, pp=2, iters=3, gbs=4),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in range(4):
        for stream in ("stdout", "stderr"):
            assert (logs / "attempt_0" / str(rank) / f"{stream}.log").is_file(), (rank, stream)
    logging_rank_out = (logs / "attempt_0" / "2" / "stdout.log").read_text()  # last stage, DP rank 0
    assert "iteration      3/3" in logging_rank_out, logging_rank_out[-2000:]
    assert "iteration " not in res.stdout, "a redirected rank still wrote to the console"
    assert "started 4 ranks" in res.stderr  # the launcher's own lines stay on the console


def test_tee_writes_files_and_console(tmp_path, corpus):
    logs = tmp_path / "logs"
    res = _launch(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--log_dir",
        str(logs),
        "--tee",
        "1",
        script_args=tiny_args(corpus, pp=2, iters=3, gbs=2),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "iteration      3/3" in (logs / "attempt_0" / "1" / "stdout.log").read_text()
    assert "iteration      3/3" in res.stdout


def test_megatron_lm_torchrun_line_runs_under_trainmover_launch(tmp_path, corpus):
    """Megatron-LM's examples: `torchrun --nproc_per_node N --nnodes 1 --node_rank 0 --master_addr localhost
    --master_port P pretrain_gpt.py ...`, with torchrun replaced by `trainmover launch`."""
    port = free_port("127.0.0.1")
    res = _launch(
        tmp_path,
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--node_rank",
        "0",
        "--master_addr",
        "localhost",
        "--master_port",
        str(port),
        script_args=tiny_args(corpus, pp=2, iters=3, gbs=2),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "iteration      3/3" in res.stdout


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nproc-per-node", "gpu"], "no CUDA device is visible"),
        (["--nproc-per-node", "many"], "give a number, 'gpu', 'cpu' or 'auto'"),
        (["--nnodes", "1:4"], "elastic MIN:MAX range is not supported"),
        (["--redirects", "3"], "need --log-dir"),
        (["--log-dir", "x", "--redirects", "7"], "values are 0 (none)"),
    ],
)
def test_bad_torchrun_flags_are_refused_with_a_fix(tmp_path, flags, message):
    res = _launch(tmp_path, *flags, script_args=["--mock-data"], timeout=120)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]


def test_nproc_per_node_cpu_and_auto_count_cores():
    import os

    import torch

    from trainmover_ext.launch.cli import nproc_per_node

    assert nproc_per_node("cpu") == (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert nproc_per_node("auto") == (gpus or os.cpu_count() or 1)
    assert nproc_per_node("8") == 8
