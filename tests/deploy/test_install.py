"""The README's install lines, run as written in a Python environment that already has its own torch.

A cluster installs TrainMover "in the Python environment of your Megatron-core training": that torch
build (a site's, or an NGC image's) must stay. The test makes a fresh venv holding a torch of another
version than ``constraints.txt`` pins, standing in for the site's build: the CPU torch of ``.venv``,
hard-linked (no copy, no download) and relabelled ``2.13.1+site``. It then runs every ``pip`` line of
the README's install block in that venv, from a copy of the source, and checks that torch is the same
distribution, untouched (same files), and that ``trainmover --version`` runs there.

The companion asks pip what the README's old line (``-c constraints.txt``, which pins torch) would do
in the same venv: it would replace the site's torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.jobs import REPO_ROOT
from support.readme_install import readme_install_lines

pytestmark = pytest.mark.slow  # about a minute: a venv, and pip resolving and installing ~15 packages

SITE_TORCH = "2.13.1+site"
SOURCE = ("setup.py", "pyproject.toml", "constraints.txt", "pretrain_gpt.py", "README.md")
PACKAGES = ("trainmover_ext", "trainmover_training", "patches", "nccl_delta")


def _link_distribution(name: str, site: Path, relabel: str | None = None) -> None:
    """Hard-link an installed distribution of this interpreter into ``site`` (``relabel``: a new version)."""
    dist = importlib.metadata.distribution(name)
    root = Path(dist.locate_file(""))
    info_old = next(str(f).split("/")[0] for f in dist.files if str(f).endswith(".dist-info/METADATA"))
    info_new = info_old.replace(dist.version, relabel) if relabel else info_old
    for f in dist.files:
        src = root / f
        rel = str(f)
        if rel.startswith(info_old + "/"):
            rel = info_new + rel[len(info_old) :]
        dst = site / rel
        if not src.is_file() or ".." in rel:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if relabel and (rel.startswith(info_new + "/") or rel == "torch/version.py"):
            text = src.read_text().replace(dist.version, relabel).replace(info_old, info_new)
            dst.write_text(text)  # a file of its own: the .venv's copy is never written through a link
        else:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)  # another file system: copy


def _site_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv with the stand-in site torch and torch's own requirements; returns (bin dir, torch/__init__.py)."""
    venv = tmp_path / "site-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    _link_distribution("torch", site, relabel=SITE_TORCH)
    for req in importlib.metadata.requires("torch") or []:
        if "extra ==" not in req:
            dep = re.split(r"[ ;<>=!~\[]", req)[0]
            if dep != "setuptools":
                _link_distribution(dep, site)
    for dep in ("mpmath", "MarkupSafe"):  # sympy's and jinja2's
        _link_distribution(dep, site)
    return venv / "bin", site / "torch" / "__init__.py"


def _torch_version(bin_dir: Path) -> str:
    return subprocess.check_output(
        [str(bin_dir / "python"), "-c", "import importlib.metadata as m; print(m.version('torch'))"], text=True
    ).strip()


def _source_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCE:
        shutil.copy2(os.path.join(REPO_ROOT, name), src / name)
    for name in PACKAGES:
        shutil.copytree(
            os.path.join(REPO_ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    return src


def _env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_CONSTRAINT")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_readme_install_keeps_the_site_torch(tmp_path):
    lines = readme_install_lines()
    pips = [line for line in lines if line.startswith("pip ")]
    assert pips and "trainmover --version" in lines, lines
    bin_dir, torch_init = _site_venv(tmp_path)
    assert _torch_version(bin_dir) == SITE_TORCH
    before = os.stat(torch_init)
    src = _source_copy(tmp_path)
    for line in pips:
        res = subprocess.run(line, shell=True, cwd=src, env=_env(bin_dir), capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"`{line}` failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert _torch_version(bin_dir) == SITE_TORCH, "the README's install replaced the environment's torch"
    after = os.stat(torch_init)
    assert (after.st_ino, after.st_mtime) == (before.st_ino, before.st_mtime), "torch's files were rewritten"
    res = subprocess.run(
        "trainmover --version", shell=True, env=_env(bin_dir), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and f"torch {SITE_TORCH}" in res.stdout, res.stdout + res.stderr


def test_companion_the_old_install_line_would_replace_the_site_torch(tmp_path):
    """pip's own plan for the README's old line: `-c constraints.txt` pins torch==2.13.0."""
    bin_dir, _ = _site_venv(tmp_path)
    report = tmp_path / "report.json"
    old = (
        f"pip install --dry-run --quiet --report {report} -c {os.path.join(REPO_ROOT, 'constraints.txt')} "
        "megatron-core etcd-sdk-python prometheus_client grpcio protobuf"
    )
    res = subprocess.run(old, shell=True, env=_env(bin_dir), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    planned = {item["metadata"]["name"]: item["metadata"]["version"] for item in json.load(open(report))["install"]}
    assert planned.get("torch", "").startswith("2.13.0"), planned
