"""Fixtures for control-plane tests: real etcd servers on free loopback ports, stopped by pid."""

from __future__ import annotations

import pytest

from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig
from trainmover_ext.kv import EtcdClientConfig, EtcdKV


@pytest.fixture
def etcd(tmp_path):
    """A single real etcd member with fast raft timings."""
    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd", heartbeat_ms=10, election_ms=100))
    server.start(timeout=15)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kv(etcd):
    """A client of the ``etcd`` fixture."""
    client = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=3.0))
    try:
        yield client
    finally:
        client.close()
