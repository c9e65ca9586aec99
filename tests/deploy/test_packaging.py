"""``pip wheel .`` ships what users run and nothing of the tests or the benchmarks."""

from __future__ import annotations

import glob
import subprocess
import sys
import zipfile

from harness.jobs import REPO_ROOT

SHIPPED = ("trainmover_ext/", "nccl_delta/", "trainmover_training/", "trainmover_ext/patches/", "pretrain_gpt.py")
"""Every file of the wheel's code lies under one of these."""

NOT_SHIPPED = ("harness", "tests/", "benchmarks/", "conftest", "test_", "member_main", "promotion", "jobs.py")
"""Names that mark a test or benchmark harness."""


def harness_files(names: list[str]) -> list[str]:
    """The wheel entries that are harnesses or lie outside :data:`SHIPPED` (metadata excepted)."""
    code = [n for n in names if ".dist-info/" not in n]
    return [n for n in code if any(mark in n for mark in NOT_SHIPPED) or not n.startswith(SHIPPED)]


def test_the_wheel_holds_the_runtime_and_no_harness(tmp_path):
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", REPO_ROOT, "-w", str(out)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = glob.glob(str(out / "trainmover-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "trainmover_ext/cli.py",
        "trainmover_ext/migration/worker.py",
        "trainmover_ext/patches/__init__.py",
        "nccl_delta/errors.py",
        "trainmover_training/training.py",
        "pretrain_gpt.py",
    ):
        assert needed in names
    assert harness_files(names) == []


def test_a_harness_in_the_wheel_is_caught():
    names = [
        "trainmover_ext/cli.py",
        "trainmover_ext/sandbox/harness.py",
        "trainmover_ext/jobs.py",
        "benchmarks/harness/jobs.py",
        "scripts/demo.py",
        "trainmover-0.1.0.dist-info/RECORD",
    ]
    assert harness_files(names) == names[1:5]
