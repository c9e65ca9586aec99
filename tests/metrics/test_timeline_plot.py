"""``trainmover events --plot``: a valid PNG from a real job's migration records and iteration metrics."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from harness.jobs import REPO_ROOT
from support.scraped_job import JOB, TOKEN
from trainmover_ext.errors import ConfigError
from trainmover_ext.timeline_plot import plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_events_plot_from_a_real_failover(failover_run, tmp_path):
    out = tmp_path / "timeline.png"
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "events",
        "--tm-etcd-endpoints",
        failover_run.endpoints,
        "--tm-job",
        JOB,
        "--tm-job-token",
        TOKEN,
        "--plot",
        str(out),
        "--metrics-file",
        failover_run.job.metrics_path,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the event table, then the migration's phases with durations
    assert "migration_planned" in proc.stdout and "epoch 1 (failure, done): rank 1:" in proc.stdout, proc.stdout
    for phase in ("decided", "joined", "transferred", "first_iteration", "total"):
        assert f"  {phase} " in proc.stdout, proc.stdout
    width, height = png_size(out)
    assert width >= 800 and height >= 400 and os.path.getsize(out) > 10_000


def test_plot_without_data_says_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="--metrics-file"):
        plot_timeline([], [], str(tmp_path / "x.png"))
