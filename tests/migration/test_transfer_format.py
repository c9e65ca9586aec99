"""The state transfer's metadata is data, never code, and a target refuses tensors that do not fit it.

Pure-logic tests over an in-memory channel (the real transfer runs in every migration test)."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from trainmover_ext.errors import MigrationAborted
from trainmover_ext.migration import transfer


class _Done:
    def wait(self):
        return None


class MemoryChannel:
    """Messages by tag, in order; ``recv`` fills the tensor from what was sent."""

    def __init__(self):
        self.sent: dict[int, list[torch.Tensor]] = {}

    def send(self, tensor, tag):
        self.sent.setdefault(tag, []).append(tensor.clone())
        return _Done()

    def recv(self, tensor, tag):
        tensor.copy_(self.sent[tag].pop(0))
        return _Done()

    def wait_sends(self, works):
        return None


def _raw(channel: MemoryChannel, data: bytes) -> None:
    channel.send(torch.tensor([len(data)], dtype=torch.int64), 0)
    channel.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), 1)


def test_metadata_round_trips_as_data():
    ch = MemoryChannel()
    meta = {"iteration": 7, "rng": {"torch": torch.get_rng_state()}, "layout": [("tensor", (2, 3), "torch.float32")]}
    transfer.send_record(ch, meta)
    got = transfer.recv_record(ch)
    assert got["iteration"] == 7 and torch.equal(got["rng"]["torch"], meta["rng"]["torch"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/trainmover_pwned",))


def test_a_peer_that_sends_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = "/tmp/trainmover_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    buf = io.BytesIO()
    torch.save({"format": transfer.META_FORMAT, "version": transfer.META_VERSION, "x": _Evil()}, buf)
    for payload in (buf.getvalue(), pickle.dumps(_Evil())):
        ch = MemoryChannel()
        _raw(ch, payload)
        with pytest.raises(MigrationAborted, match="not a TrainMover state record"):
            transfer.recv_record(ch)
    assert not os.path.exists(marker), "the peer's code ran"


@pytest.mark.parametrize(
    "payload,match",
    [
        ({"format": "other", "version": 1}, "not a TrainMover state record"),
        ({"format": transfer.META_FORMAT, "version": 99}, "version 99"),
    ],
)
def test_foreign_or_newer_records_are_refused(payload, match):
    ch = MemoryChannel()
    buf = io.BytesIO()
    torch.save(payload, buf)
    _raw(ch, buf.getvalue())
    with pytest.raises(MigrationAborted, match=match):
        transfer.recv_record(ch)


def test_an_oversized_announcement_is_refused_before_allocating():
    ch = MemoryChannel()
    ch.send(torch.tensor([transfer.MAX_META_BYTES + 1], dtype=torch.int64), 0)
    with pytest.raises(MigrationAborted, match="refusing"):
        transfer.recv_record(ch)


def test_tensors_that_differ_from_the_targets_are_named():
    ours = transfer.manifest([torch.zeros(4, 8), torch.zeros(8, dtype=torch.bfloat16)])
    transfer.check_manifest(ours, ours, rank=3)
    with pytest.raises(MigrationAborted, match=r"tensor 0: \[4, 16\] torch.float32 sent, \[4, 8\] torch.float32 here"):
        transfer.check_manifest(
            transfer.manifest([torch.zeros(4, 16), torch.zeros(8, dtype=torch.bfloat16)]), ours, rank=3
        )
    with pytest.raises(MigrationAborted, match="torch.float32 sent, \\[8\\] torch.bfloat16 here"):
        transfer.check_manifest(transfer.manifest([torch.zeros(4, 8), torch.zeros(8)]), ours, rank=3)
    with pytest.raises(MigrationAborted, match="sends 1 tensors, this process holds 2"):
        transfer.check_manifest(transfer.manifest([torch.zeros(4, 8)]), ours, rank=3)
