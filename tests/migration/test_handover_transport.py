"""The planned hand-over's transport: NCCL between two distinct GPUs, gloo otherwise (NCCL refuses two
ranks of one communicator on one device), agreed by both ends through the store; over gloo the state
crosses as it is on CPU. The GPU side runs in scripts/gpu_check.sh."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch
from torch.distributed import HashStore

from trainmover_ext.migration.handover_transport import (
    DeviceInfo,
    HandoverChannel,
    choose_transport,
    connect_handover,
)

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


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        # Two node names on one machine's GPUs (loopback nodes, or a standby machine sharing them).
        (DeviceInfo(node="n1", device="cuda:0", nccl=True, uuid="GPU-a"), "gloo"),
        # Another CUDA_VISIBLE_DEVICES: cuda:1 there is this end's GPU.
        (DeviceInfo(node="n0", device="cuda:1", nccl=True, uuid="GPU-a"), "gloo"),
        (DeviceInfo(node="n0", device="cuda:0", nccl=True, uuid="GPU-b"), "nccl"),
    ],
)
def test_the_gpu_uuid_decides_which_device_an_end_is_on(other, expected):
    mine = DeviceInfo(node="n0", device="cuda:0", nccl=True, uuid="GPU-a")
    assert choose_transport(mine, other) == expected
    assert choose_transport(other, mine) == expected, "both ends must agree"


def _exchange(results, device: str = "cpu") -> None:
    """Both ends in this (forked) process, on threads: agree, connect, send the state, compare."""
    try:
        store = HashStore()
        out: dict[int, object] = {}

        def end(side: int) -> None:
            try:
                out[side] = connect_handover(store, "7/3", side, 30.0, torch.device(device))
            except BaseException as exc:  # noqa: BLE001 - reported below
                out[side] = exc

        threads = [threading.Thread(target=end, args=(side,)) for side in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        leaver, joiner = out.get(0), out.get(1)
        if not isinstance(leaver, HandoverChannel) or not isinstance(joiner, HandoverChannel):
            results.send({"error": repr(out)})
            return
        sent = [
            torch.arange(10, dtype=torch.float32, device=device) * 1.5,
            torch.tensor([1, 2, 3], dtype=torch.int64, device=device),
        ]
        got = [torch.zeros(10, device=device), torch.zeros(3, dtype=torch.int64, device=device)]
        recvs = [joiner.recv(t, tag) for tag, t in enumerate(got)]
        leaver.wait_sends([leaver.send(t, tag) for tag, t in enumerate(sent)])
        for work in recvs:
            work.wait()
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(sent, got, strict=True))
        results.send({"transports": [leaver.transport, joiner.transport], "same": same})
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.send({"error": repr(exc)})
    finally:
        os._exit(0)  # no gloo teardown at exit: the pairs die with the process


def _exchange_in_child(device: str) -> dict:
    """In a child process: gloo pairs (and their device's threads) never live in the test runner."""
    ctx = mp.get_context("spawn" if device != "cpu" else "fork")
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_exchange, args=(theirs, device))
    child.start()
    try:
        assert mine.poll(120), "the child process reported nothing within 120 s"
        got = mine.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return got


def test_two_cpu_ends_agree_on_gloo_and_the_state_crosses_intact():
    got = _exchange_in_child("cpu")
    assert "error" not in got, got
    assert got["transports"] == ["gloo", "gloo"]
    assert got["same"], "the state did not cross intact"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_state_on_one_gpu_crosses_through_host_memory():
    """Both ends on one GPU (a same-node standby in the leaver's slot): NCCL refuses that, so the pair is
    gloo and the CUDA tensors are staged through host memory on both ends, and land intact."""
    got = _exchange_in_child("cuda:0")
    assert "error" not in got, got
    assert got["transports"] == ["gloo", "gloo"]
    assert got["same"], "the state did not cross intact"
