"""``make demo`` end to end (shortened): failover, /metrics counters, timeline.png, bit-identical losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from harness.jobs import REPO_ROOT

pytestmark = pytest.mark.slow


def test_demo_shows_the_mission(tmp_path, corpus):
    run_dir = tmp_path / "demo"
    cmd = [
        sys.executable,
        os.path.join(REPO_ROOT, "scripts", "demo.py"),
        "--iters",
        "10",
        "--fault",
        "5:5:backward",
        "--data-prefix",
        corpus,
        "--run-dir",
        str(run_dir),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 5 -> standby" in out and "exited with code -9" in out, out[-4000:]
    counters = re.search(r"iteration counter (\d+) -> (\d+), failure migrations 0 -> 1", out)
    assert counters and int(counters.group(2)) > int(counters.group(1)), out[-3000:]
    assert re.search(r"  first_iteration +\d+\.\d ms", out) and "  total " in out, out[-3000:]
    assert "10/10 iterations bit-identical" in out, out[-3000:]
    with open(run_dir / "timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
