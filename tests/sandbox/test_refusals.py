"""What the sandbox refuses: corrupt recordings, calls that differ from the recording, and standbys
whose config differs from the job's. Each error names what differs and what to do."""

from __future__ import annotations

import os

import pytest

from support.sandbox_jobs import copy_recording, edit_index, pp3_argv, warm_one_role
from trainmover_ext.errors import ConfigMismatch, RecordingCorrupt, RecordingNotFound
from trainmover_ext.sandbox.recording import Recording


def _in_child(*args):
    from harness import sandbox as harness

    return harness.fork_children({"c": (warm_one_role, *args)}).results(300)["c"]


def test_flipped_byte_is_caught_and_located(pp3_job, tmp_path):
    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))
    data = os.path.join(rec, "middle", "tensors.bin")
    first = Recording(rec, "middle").records[0]["tensors"][0]
    with open(data, "r+b") as f:
        f.seek(first["offset"] + 5)
        byte = f.read(1)
        f.seek(first["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RecordingCorrupt, match=r"tensor 0 of record 0 \(.* iteration 1\) fails its CRC32") as err:
        Recording(rec, "middle")
    assert "record again" in str(err.value).lower()


def test_truncated_data_is_refused(pp3_job, tmp_path):
    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))
    data = os.path.join(rec, "last", "tensors.bin")
    os.truncate(data, os.path.getsize(data) - 4)
    with pytest.raises(RecordingCorrupt, match="truncated"):
        Recording(rec, "last")


def test_index_differing_from_etcd_is_refused(pp3_job, tmp_path):
    from trainmover_ext.sandbox.registry import _summary_from_disk, open_published

    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))
    published = _summary_from_disk(rec, "first")
    edit_index(rec, "first", lambda index: index.update(consumed_samples=999))
    with pytest.raises(RecordingCorrupt, match="not the index the job published in etcd"):
        open_published(published, rec)


def test_corrupt_recording_is_never_replayed(pp3_job, tmp_path):
    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))
    with open(os.path.join(rec, "first", "tensors.bin"), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    out = _in_child(pp3_job.argv, rec, "first")
    assert out["error"] == "RecordingCorrupt", out


def test_replay_mismatch_names_the_call_and_the_difference(pp3_job, tmp_path):
    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))

    def widen_first_recv(index):
        call = next(r for r in index["records"] if r["op"] == "recv")
        call["tensors"][0]["shape"][-1] += 1
        index["_changed_seq"] = call["seq"]

    edit_index(rec, "last", widen_first_recv)
    seq = Recording(rec, "last").index["_changed_seq"]
    out = _in_child(pp3_job.argv, rec, "last")
    assert out["error"] == "ReplayMismatch", out
    msg = out["message"]
    assert f"call #{seq} (recv on group pp)" in msg, msg
    assert "result shapes/dtypes [[[32, 1, 64], 'float32']] != recorded [[[32, 1, 65], 'float32']]" in msg, msg


def test_config_mismatch_names_every_differing_field(pp3_job, tmp_path, corpus):
    rec = copy_recording(pp3_job.record_dir, str(tmp_path / "rec"))
    edit_index(rec, "middle", lambda index: index["fingerprint"].update(megatron_core_version="0.15.0"))
    out = _in_child(pp3_argv(corpus, "--micro-batch-size", "2"), rec, "middle")
    assert out["error"] == "ConfigMismatch", out
    msg = out["message"]
    for field in (
        "megatron_core_version: job '0.15.0', standby '0.16.1'",
        "micro_batch_size: job 1, standby 2",
        "num_microbatches: job 4, standby 2",
    ):
        assert field in msg, msg
    assert "hidden_size" not in msg  # only what differs


def test_fingerprint_covers_model_and_layout():
    from trainmover_ext.sandbox.fingerprint import FINGERPRINT_FIELDS, check_compatible

    for field in (
        "hidden_size",
        "num_layers",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "data_parallel_size",
        "world_size",
        "tm_compile",
    ):
        assert field in FINGERPRINT_FIELDS
    with pytest.raises(ConfigMismatch, match="pipeline_model_parallel_size: job 3, standby 2"):
        check_compatible({"pipeline_model_parallel_size": 3}, {"pipeline_model_parallel_size": 2}, role="first")


def test_waiting_for_recordings_is_bounded(tmp_path):
    from trainmover_ext.sandbox.registry import wait_for_recordings

    with pytest.raises(RecordingNotFound, match=r"role\(s\) \['first', 'last'\].*--tm-record-timeout"):
        wait_for_recordings(record_dir=str(tmp_path), roles=["first", "last"], timeout_s=0.3)
