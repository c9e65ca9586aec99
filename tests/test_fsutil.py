"""write_private: a secret file ends with exactly its content and mode, whatever was there before."""

from __future__ import annotations

import os
import stat

import pytest

from trainmover_ext.fsutil import write_private


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_existing_world_readable_file_becomes_private(tmp_path):
    path = tmp_path / "job-token"
    path.write_text("an old, longer token\n")
    os.chmod(path, 0o644)
    assert write_private(path, "new\n") == str(path)
    assert path.read_text() == "new\n" and _mode(path) == 0o600
    assert os.listdir(tmp_path) == ["job-token"], "a temporary file was left behind"


def test_bytes_and_a_public_mode(tmp_path):
    path = tmp_path / "ca.pem"
    write_private(path, b"\x00pem", 0o644)
    assert path.read_bytes() == b"\x00pem" and _mode(path) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "etcd-root-password"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_private(path, 12345)  # not str or bytes: nothing is renamed over the old file
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["etcd-root-password"]
