"""The committed docs/flags.md matches the argument parsers, and the docs it links to exist."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.jobs import REPO_ROOT

GEN = os.path.join(REPO_ROOT, "scripts", "gen_flag_reference.py")


def test_flag_reference_is_current():
    env = dict(os.environ, TRAINMOVER_JOB="must-not-leak", TRAINMOVER_ETCD_ENDPOINTS="10.0.0.1:2379")
    proc = subprocess.run(
        [sys.executable, GEN, "--check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_check_catches_a_stale_reference(tmp_path):
    stale = tmp_path / "flags.md"
    with open(os.path.join(REPO_ROOT, "docs", "flags.md")) as f:
        stale.write_text(f.read().replace("`--tensor-model-parallel-size", "`--tp-renamed", 1))
    proc = subprocess.run(
        [sys.executable, GEN, "--check", "--output", str(stale)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "gen_flag_reference.py" in proc.stderr, proc.stderr


def test_reference_covers_every_parser():
    text = open(os.path.join(REPO_ROOT, "docs", "flags.md")).read()
    for needle in (
        "## `pretrain_gpt.py`",
        "`--tensor-model-parallel-size",
        "`--trainmover`",
        "`--tm-etcd-endpoints",
        "### `trainmover launch`",
        "`--nproc-per-node",
        "### `trainmover status`",
        "### `trainmover migrate`",
    ):
        assert needle in text, f"docs/flags.md lacks {needle}"
    assert "must-not-leak" not in text and "/work/" not in text


def test_production_docs_exist():
    for name in ("slurm.md", "container.md", "troubleshooting.md", "flags.md"):
        path = os.path.join(REPO_ROOT, "docs", name)
        assert os.path.getsize(path) > 500, f"docs/{name} is missing or nearly empty"
