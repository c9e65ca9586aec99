"""The test session's etcd servers keep their data on tmpfs (``support.etcd_tmpfs``): a disk's fsync stall
must not expire the leases of live ranks. The server is the real etcd; only where its data lives changes."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from support import etcd_tmpfs
from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig
from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV


def _root():
    wrapper = os.environ.get("TRAINMOVER_ETCD_BINARY", "")
    if not wrapper.startswith(str(etcd_tmpfs.SHM / etcd_tmpfs.ROOT_PREFIX)):
        if os.environ.get("TM_TEST_ETCD_ON_DISK") == "1" or not etcd_tmpfs.SHM.is_dir():
            pytest.skip("this session keeps etcd on disk (TM_TEST_ETCD_ON_DISK=1, or no /dev/shm)")
        if shutil.disk_usage(etcd_tmpfs.SHM).free < etcd_tmpfs.MIN_FREE_BYTES:
            pytest.skip("this session keeps etcd on disk: /dev/shm has too little room")
        pytest.fail(f"/dev/shm has room but the session's etcd binary is {wrapper!r}, not the tmpfs wrapper")
    return os.path.dirname(wrapper)


def _fs_type(path: str) -> str:
    best = ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, fstype)
    return best[1]


def _put_get(server: EmbeddedEtcd, value: bytes | None) -> bytes | None:
    with EtcdKV(EtcdClientConfig(endpoints=server.endpoints, timeout_s=5)) as kv:
        if value is not None:
            kv.put("/k", value)
        entry = kv.get("/k")
        return None if entry is None else entry.value


def test_a_server_keeps_its_data_on_tmpfs_across_a_restart_and_starts_empty_once_deleted(tmp_path):
    root = _root()
    data = tmp_path / "etcd"
    server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=data)).start(timeout=60)
    try:
        real = os.path.realpath(data)
        assert os.path.dirname(real) == root and _fs_type(real) == "tmpfs", (real, _fs_type(real))
        assert os.path.isdir(os.path.join(real, "member", "wal"))
        assert _put_get(server, b"v1") == b"v1"
        server.kill(signal.SIGKILL)
        server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=data)).start(timeout=60)
        assert _put_get(server, None) == b"v1", "a restart on the same data directory lost the data"
        server.stop()
        assert etcd_tmpfs.sweep(Path(root)) == [Path(real)]
        assert not os.path.exists(real), "the sweep left a stopped server's data in memory"
        os.unlink(data)  # as a script that deletes its data directory before starting again
        server = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=data)).start(timeout=60)
        assert _put_get(server, None) is None
    finally:
        server.stop()


def test_the_sweep_keeps_a_running_servers_data(tmp_path):
    root = _root()
    with EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd")) as server:
        server.start(timeout=60)
        real = os.path.realpath(tmp_path / "etcd")
        assert real not in map(str, etcd_tmpfs.sweep(Path(root)))
        assert _put_get(server, b"v") == b"v"


def test_an_existing_data_directory_stays_on_disk(tmp_path):
    _root()
    (tmp_path / "etcd").mkdir()
    with EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp_path / "etcd")) as server:
        server.start(timeout=60)
        assert not os.path.islink(tmp_path / "etcd") and os.path.isdir(tmp_path / "etcd" / "member")
    shutil.rmtree(tmp_path / "etcd")
