"""Compute time on the device's timeline: the pure bookkeeping over a scripted timeline (always), and the same
over real CUDA events on one GPU (scripts/gpu_check.sh; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from trainmover_ext.launch import progress
from trainmover_ext.launch.device_time import PENDING, CudaTimeline, IterationTimes


class ScriptedTimeline:
    """A device whose clock the test moves: a mark is the device time it will be passed at."""

    def __init__(self) -> None:
        self.queued = 0.0  # device time of the work queued so far
        self.now = 0.0  # how far the device got

    def run(self, seconds: float) -> None:
        self.queued += seconds

    def mark(self) -> float:
        return self.queued

    def reached(self, mark: float) -> bool:
        return self.now >= mark

    def between(self, first: float, last: float) -> float:
        assert self.reached(last), "read before the device got there"
        return last - first


def test_compute_is_the_iterations_device_time_less_its_stalls_by_peer():
    tl = ScriptedTimeline()
    times = IterationTimes(tl)
    times.begin()
    tl.run(0.3)  # forward
    times.stall_begin(peer=2)
    tl.run(0.2)  # the stream waits for rank 2's activations
    times.stall_end()
    tl.run(0.4)
    times.stall_begin()  # a collective: waited, on no one peer
    times.stall_begin(peer=5)  # nested: counted once
    tl.run(0.1)
    times.stall_end()
    times.stall_end()
    tl.run(0.1)
    times.end(7)
    assert times.ready() == []  # the device is not there yet: nothing is read, nothing waits
    tl.now = 10.0
    ((iteration, compute_s, on_peer),) = times.ready()
    assert iteration == 7 and compute_s == pytest.approx(0.8) and on_peer == {2: pytest.approx(0.2)}
    assert times.ready() == []


def test_a_cut_iteration_makes_no_sample_and_a_far_behind_device_drops_the_oldest():
    tl = ScriptedTimeline()
    times = IterationTimes(tl)
    times.begin()
    tl.run(1.0)
    times.cancel()  # a save in between
    times.end(1)
    for i in range(2, PENDING + 4):
        times.begin()
        tl.run(0.5)
        times.end(i)
    tl.now = tl.queued
    assert [s[0] for s in times.ready()] == list(range(4, PENDING + 4))  # 2 and 3 dropped


def test_progress_publishes_device_samples_once_the_device_passed_them(tmp_path, monkeypatch):
    path = tmp_path / "beat"
    path.write_bytes(b"\0" * 8)
    monkeypatch.setattr(progress, "_writer", None)
    progress.start(str(path))
    tl = ScriptedTimeline()
    progress.use_device_timeline(tl)
    for i in (1, 2):
        progress.mark("iteration")
        tl.run(0.25)
        with progress.waiting("pp-0", i, peer=3):
            tl.run(0.5)
        progress.iteration_done(i)
        if i == 1:
            assert progress.read_compute(str(path)) == []
            tl.now = tl.queued  # the device caught up with iteration 1 only
    samples = progress.read_compute(str(path))
    assert [(s.iteration, round(s.compute_s, 6), s.links) for s in samples] == [(1, 0.25, ((3, 0.5),))]
    monkeypatch.setattr(progress, "_writer", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_cuda_events_split_a_gpu_iteration_into_compute_and_stalls():
    """On one GPU: 0.2 s of kernels, then a 0.1 s kernel inside a stall (a stand-in for a collective the
    stream waits in), read without blocking the host."""
    times = IterationTimes(CudaTimeline())
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1000 * 0.1)  # about 0.1 s of spinning
    times.begin()
    torch.cuda._sleep(2 * cycles)
    times.stall_begin(peer=1)
    torch.cuda._sleep(cycles)
    times.stall_end()
    times.end(1)
    torch.cuda.synchronize()
    ((iteration, compute_s, on_peer),) = times.ready()
    assert iteration == 1
    assert on_peer[1] > 0.03 and compute_s > 1.5 * on_peer[1], (compute_s, on_peer)
