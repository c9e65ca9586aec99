"""Fixtures for control-plane tests: a client of the real etcd of ``tests/conftest.py``."""

from __future__ import annotations

import pytest

from trainmover_ext.kv import EtcdClientConfig, EtcdKV


@pytest.fixture
def kv(etcd):
    """A client of the ``etcd`` fixture."""
    client = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=3.0))
    try:
        yield client
    finally:
        client.close()
