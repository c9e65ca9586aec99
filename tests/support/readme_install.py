"""The shell lines of the README's install block, as ``tests/deploy/test_install.py`` runs them."""

from __future__ import annotations

import re
from pathlib import Path

from harness.jobs import REPO_ROOT


def readme_install_lines() -> list[str]:
    """The lines of the ```bash code between ``<!-- install:begin`` and ``<!-- install:end -->``, comments cut."""
    text = Path(REPO_ROOT, "README.md").read_text()
    block = re.search(r"<!-- install:begin.*?-->(.*?)<!-- install:end -->", text, re.S)
    assert block, "README.md has no <!-- install:begin --> ... <!-- install:end --> block"
    code = re.search(r"```bash\n(.*?)```", block.group(1), re.S)
    assert code, "the README's install block has no ```bash code"
    return [line.split("  #")[0].strip() for line in code.group(1).splitlines() if line.strip()]
