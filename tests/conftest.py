"""Shared fixtures: the small real corpus (Python stdlib docstrings) built once, and a real etcd."""

from __future__ import annotations

import pytest

from support import etcd_tmpfs

_ETCD_ROOT = None


def pytest_sessionstart(session):
    """Every etcd the tests start keeps its data on tmpfs (why: :mod:`support.etcd_tmpfs`)."""
    global _ETCD_ROOT
    _ETCD_ROOT = etcd_tmpfs.install()


def pytest_sessionfinish(session, exitstatus):
    if _ETCD_ROOT is not None:
        etcd_tmpfs.remove(_ETCD_ROOT)


@pytest.fixture(autouse=True)
def _etcd_tmpfs_sweep():
    """After each test, free the tmpfs of the etcd servers that test left stopped."""
    yield
    if _ETCD_ROOT is not None:
        etcd_tmpfs.sweep(_ETCD_ROOT)


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
