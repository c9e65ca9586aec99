"""The planned hand-over's transport: NCCL between two distinct GPUs, gloo otherwise (NCCL refuses two
ranks of one communicator on one device), agreed by both ends through the store; over gloo the state
crosses as it is on CPU. The GPU side runs in scripts/gpu_check.sh."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import HashStore

from trainmover_ext.migration.handover_transport import DeviceInfo, choose_transport, connect_handover

GPU0 = DeviceInfo(node="n0", device="cuda:0", nccl=True)


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        (DeviceInfo(node="n1", device="cuda:0", nccl=True), "nccl"),  # a standby machine's slot 0
        (DeviceInfo(node="n0", device="cuda:1", nccl=True), "nccl"),  # another slot of the same node
        (DeviceInfo(node="n0", device="cuda:0", nccl=True), "gloo"),  # a same-node standby on the leaver's GPU
        (DeviceInfo(node="n1", device="cuda:0", nccl=False), "gloo"),  # a torch without NCCL
        (DeviceInfo(node="n1", device="cpu", nccl=False), "gloo"),
    ],
)
def test_both_ends_choose_the_same_transport(other, expected):
    assert choose_transport(GPU0, other) == expected
    assert choose_transport(other, GPU0) == expected, "both ends must agree"


def test_two_cpu_ends_agree_on_gloo_and_the_state_crosses_intact():
    store = HashStore()
    out: dict[int, object] = {}

    def end(side: int) -> None:
        try:
            out[side] = connect_handover(store, "7/3", side, 30.0, torch.device("cpu"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[side] = exc

    threads = [threading.Thread(target=end, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    leaver, joiner = out[0], out[1]
    assert not isinstance(leaver, BaseException) and not isinstance(joiner, BaseException), out
    assert leaver.transport == joiner.transport == "gloo"
    sent = [torch.arange(10, dtype=torch.float32) * 1.5, torch.tensor([1, 2, 3], dtype=torch.int64)]
    got = [torch.zeros(10), torch.zeros(3, dtype=torch.int64)]
    recvs = [joiner.recv(t, tag) for tag, t in enumerate(got)]
    leaver.wait_sends([leaver.send(t, tag) for tag, t in enumerate(sent)])
    for work in recvs:
        work.wait()
    assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
    leaver.close()
    joiner.close()
