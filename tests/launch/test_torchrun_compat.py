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
        (["--nnodes", "2", "--master-port", "29500"], "needs --node-rank on every node"),
        (["--rdzv-conf", "join_timeout=900"], "--rdzv-conf 'join_timeout=900': torchrun's rendezvous options"),
        (["-m"], "-m/--module: give the script's path"),
        (["--no-python"], "--no-python: the agent forks its ranks"),
        (["--monitor-interval", "0"], "--monitor-interval 0.0: give a positive number"),
        (["--local-ranks-filter", "a"], "--local-ranks-filter 'a'"),
        (["--rdzv-backend", "c10d"], "drop --rdzv-backend c10d"),
    ],
)
def test_bad_torchrun_flags_are_refused_with_a_fix(tmp_path, flags, message):
    res = _launch(tmp_path, *flags, script_args=["--mock-data", "--trainmover"], timeout=120)
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


def _build(*argv: str):
    from trainmover_ext.cli import build_parser, place_launch_flags
    from trainmover_ext.launch.cli import build

    parser = build_parser()
    args = parser.parse_args(place_launch_flags(["launch", *argv], parser))
    return build(args)[0]


def test_torchrun_flags_that_take_effect(tmp_path, monkeypatch):
    from trainmover_ext.launch.agent import Agent

    monkeypatch.chdir(tmp_path)
    config = _build("--monitor_interval", "0.2", "--local_addr", "10.1.2.3", "--rdzv_id", "run7", PRETRAIN)
    assert config.monitor_interval_s == 0.2 and config.recordings_host == "10.1.2.3"
    assert Agent(config).rank_env(0, 29500)["TORCHELASTIC_RUN_ID"] == "run7"
    assert _build(
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        "2",
        "--tm-job-token",
        "T",
        "--rdzv-backend",
        "tcp",
        PRETRAIN,
    ).node_rank
    assert _build("--local-ranks-filter", "0,3", PRETRAIN).logs.console_ranks == {0, 3}


def _tiny_script(tmp_path, code: str) -> str:
    script = tmp_path / "tiny.py"
    script.write_text("import os, sys\n" + code)
    return str(script)


def test_local_ranks_filter_keeps_other_ranks_off_the_console(tmp_path):
    # One write per line: the ranks share the console, and a pipe keeps a write of under PIPE_BUF bytes whole
    # (print's separate writes of its arguments interleave when the interpreter runs unbuffered).
    script = _tiny_script(tmp_path, "os.write(1, f\"hello from local rank {os.environ['LOCAL_RANK']}\\n\".encode())\n")
    cmd = [sys.executable, "-m", "trainmover_ext.cli", "launch", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    cmd += ["--start-method", "spawn"]  # no warm parent needed for a script this small
    res = subprocess.run(
        [*cmd, "--local-ranks-filter", "1", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "hello from local rank 1" in res.stdout and "local rank 0" not in res.stdout, res.stdout
    res = subprocess.run([*cmd, script], capture_output=True, text=True, timeout=120, cwd=tmp_path)  # companion
    assert "hello from local rank 0" in res.stdout and "hello from local rank 1" in res.stdout, res.stdout


def test_a_failed_launch_prints_a_failure_summary(tmp_path):
    """As torchrun's: every failure, and the first as the root cause, with rank, exit code, pid and log."""
    script = _tiny_script(
        tmp_path, "import time\nr = int(os.environ['RANK'])\ntime.sleep(0.5 * (1 - r))\nsys.exit(3 + r)\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "trainmover_ext.cli", "launch", "--nproc-per-node", "2", "--rdzv-backend", "tcp"]
        + ["--start-method", "spawn", "--log-dir", str(tmp_path / "logs"), script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 4, res.stderr
    root = res.stderr.split("Root Cause (first observed failure):")[1]
    assert "tiny.py FAILED" in res.stderr
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 4 (exit code 4" in root, res.stderr
    assert str(tmp_path / "logs" / "attempt_0" / "1" / "stderr.log") in root


def test_the_summary_renders_nothing_without_failures():
    """The companion of the summary check: a clean run prints none."""
    from trainmover_ext.launch.summary import FailureLog

    assert FailureLog("x.py").render() == []


def test_a_layout_error_is_reported_before_anything_starts(tmp_path):
    """TP 2 on 3 ranks: refused in well under 3 s, before etcd or any rank started (no run dir)."""
    import time

    t0 = time.monotonic()
    res = _launch(
        tmp_path,
        "--nproc-per-node",
        "3",
        script_args=tiny_args(None, tp=2, iters=2) + ["--trainmover"],
        timeout=60,
    )
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    assert "pretrain_gpt.py on 3 ranks: world size 3 is not divisible by TP x PP" in res.stderr, res.stderr
    assert took < 3.0, f"the layout error took {took:.1f} s"
    assert not (tmp_path / "run").exists(), "something started before the layout was checked"


def test_version_and_log_level_after_the_subcommand():
    res = subprocess.run([sys.executable, "-m", "trainmover_ext.cli", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("trainmover 0.") and "torch" in res.stdout, res
    res = subprocess.run(
        [sys.executable, "-m", "trainmover_ext.cli", "launch", "--log-level", "INFO", "--nnodes", "1:2", "x.py"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "elastic MIN:MAX" in res.stderr, res.stderr  # --log-level was accepted
