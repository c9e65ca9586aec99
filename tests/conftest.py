"""Shared fixtures: the small real corpus (Python stdlib docstrings) built once, and a real etcd."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Prefix of a real indexed dataset (append ``_text_document`` for --data-path)."""
    from harness.jobs import ensure_corpus

    return ensure_corpus(str(tmp_path_factory.mktemp("corpus") / "corpus"))


@pytest.fixture
def etcd(tmp_path):
    """A single real etcd member on free loopback ports, stopped by pid after the test."""
    from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig

    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd")).start(timeout=60)
    try:
        yield server
    finally:
        server.stop()
