"""Session fixtures: the small real corpus (Python stdlib docstrings) built once."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Prefix of a real indexed dataset (append ``_text_document`` for --data-path)."""
    from trainmover_ext.jobs import ensure_corpus

    return ensure_corpus(str(tmp_path_factory.mktemp("corpus") / "corpus"))
