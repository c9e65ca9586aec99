"""The README is short and links onward; the docs describe the present.

- README.md is under 200 lines, says what a user needs first (the two commands, install, one machine,
  Slurm, the container, monitoring, what is supported and what is not, which paths have only run on
  CPU), and every relative link of it and of the docs resolves.
- The figures block that benchmarks/render_figures.py owns is there once, markers together.
- No page is dated or speaks of its own history (history is in git). Each check has a companion that
  feeds it a broken text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.jobs import REPO_ROOT

ROOT = Path(REPO_ROOT)
README = ROOT / "README.md"
MAX_LINES = 200
FIGURES = re.compile(r"<!-- figures:begin.*?<!-- figures:end -->", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HISTORY = re.compile(
    r"\b(used to|no longer|previously|was (?:changed|renamed|replaced|removed|fixed)|until recently|"
    r"this (?:week|round|session)|the earlier setup|seen once in CI)\b",
    re.I,
)
MUST_SAY = (
    "make demo",
    "make test",
    "## Install",
    "## Run on one machine",
    "## Slurm",
    "## Container",
    "## Monitoring",
    "MoE",
    "context parallelism",
    "Megatron-LM fork",
    "run on CPU so far",  # what has run on a GPU, said plainly
)


def readme_problems(text: str) -> list[str]:
    problems = []
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines >= MAX_LINES:
        problems.append(f"README.md has {lines} lines (keep it under {MAX_LINES}; move detail to docs/)")
    problems += [f"README.md does not say {needle!r}" for needle in MUST_SAY if needle not in text]
    blocks = FIGURES.findall(text)
    if len(blocks) != 1 or text.count("<!-- figures:begin") != 1 or text.count("<!-- figures:end -->") != 1:
        problems.append("README.md must hold the figures block once, with both markers")
    return problems


def page_problems(name: str, text: str) -> list[str]:
    text = FIGURES.sub("", text)  # rendered from benchmarks/results by its own script
    problems = [f"{name} is dated: {m.group(0)}" for m in DATE.finditer(text)]
    problems += [f"{name} speaks of its own history: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    return problems


def broken_links(path: Path) -> list[str]:
    text = FIGURES.sub("", path.read_text())
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            out.append(f"{path.name} links to {target}, which does not exist")
    return out


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short_and_says_what_a_user_needs_first():
    problems = readme_problems(README.read_text())
    assert not problems, problems


def test_links_of_the_readme_and_the_docs_resolve():
    problems = [p for page in _pages() for p in broken_links(page)]
    assert not problems, problems
    linked = {m.group(1) for m in LINK.finditer(README.read_text())}
    for page in ("docs/recovery.md", "docs/slurm.md", "docs/container.md", "docs/monitoring.md", "docs/flags.md"):
        assert page in linked, f"README.md does not link to {page}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_no_page_is_dated_or_tells_its_history(page):
    problems = page_problems(page.name, page.read_text())
    assert not problems, problems


def test_companions_the_checks_catch_broken_texts(tmp_path):
    text = README.read_text()
    assert readme_problems(text + "\n" * MAX_LINES), "a long README passed"
    assert readme_problems(text.replace("MoE", "mixture of experts")), "a README silent on MoE passed"
    assert readme_problems(FIGURES.sub("", text)), "a README without the figures block passed"
    assert page_problems("x.md", "## 2026-12-03\nThe flag used to be called --x."), "a diary page passed"
    page = tmp_path / "page.md"
    page.write_text("See [the guide](docs/nowhere.md) and [web](https://example.org/).")
    assert broken_links(page) and len(broken_links(page)) == 1


def test_the_install_block_is_where_the_install_test_reads_it():
    from support.readme_install import readme_install_lines

    lines = readme_install_lines()
    assert any(line.startswith("pip install") for line in lines) and "trainmover --version" in lines
    assert not any("-c constraints.txt" in line or "torch" in line.split() for line in lines), lines


def test_docs_listed_in_ownership_exist():
    for name in ("recovery.md", "testing.md", "monitoring.md"):
        assert os.path.getsize(ROOT / "docs" / name) > 500, name
