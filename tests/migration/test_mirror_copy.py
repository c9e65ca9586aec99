"""The mirror's copy and the posting of its send (trainmover_ext.migration.mirror_copy), without processes.

On CPU the copy is done when it returns and the send is posted at once; with the helper thread (the
path an accelerator takes, asked for here by its environment variable) the send is posted on that
thread, in order, and the training thread only waits when it reads the result. The jobs in
test_optimizer_mirror.py run both paths with real gloo sends and kills; the side stream itself runs in
scripts/gpu_check.sh (the GPU test below) and a 2-GPU failover in scripts/gpu_check_multi.sh."""

from __future__ import annotations

import threading

import pytest
import torch

from trainmover_ext.errors import MigrationAborted
from trainmover_ext.migration import mirror_copy
from trainmover_ext.migration.mirror_copy import HELPER_ENV, ShardCopier


def test_a_cpu_copy_is_done_when_it_returns_and_its_send_posted_at_once(monkeypatch):
    monkeypatch.delenv(HELPER_ENV, raising=False)
    copier = ShardCopier()
    src = [torch.arange(6.0).view(2, 3), torch.tensor(7, dtype=torch.int64)]
    views = [torch.zeros(2, 3), torch.zeros((), dtype=torch.int64)]
    copier.copy(views, src)
    assert all(torch.equal(v, s) for v, s in zip(views, src, strict=True))
    future = copier.then(lambda: threading.current_thread())
    assert future.done() and future.result() is threading.current_thread()
    copier.before_step()  # nothing on a device to wait for
    copier.wait()


def test_the_helper_posts_in_order_on_its_own_thread(monkeypatch):
    monkeypatch.setenv(HELPER_ENV, "1")
    copier = ShardCopier()
    gate, seen = threading.Event(), []

    def first():
        gate.wait(5)
        seen.append(("first", threading.current_thread().name))
        return 1

    a = copier.then(first)
    b = copier.then(lambda: seen.append(("second", threading.current_thread().name)) or 2)
    assert not a.done() and not b.done()  # the caller did not wait for the helper
    gate.set()
    assert (copier.result(a), copier.result(b)) == (1, 2)
    assert seen == [("first", "tm-mirror-post"), ("second", "tm-mirror-post")]


def test_a_failed_post_reaches_the_reader_and_a_late_one_is_cancelled(monkeypatch):
    monkeypatch.setenv(HELPER_ENV, "1")
    copier = ShardCopier()

    def cut():
        raise RuntimeError("send(to rank 7) in group 'dp': cut")

    with pytest.raises(RuntimeError, match="cut"):
        copier.result(copier.then(cut))
    monkeypatch.setattr(mirror_copy, "COPY_TIMEOUT_S", 0.2)
    gate, ran = threading.Event(), []
    stuck = copier.then(lambda: gate.wait(5))
    late = copier.then(lambda: ran.append("late"))
    with pytest.raises(MigrationAborted, match="send is cancelled"):
        copier.result(late)  # not started in time: it never runs
    with pytest.raises(MigrationAborted, match="stuck"):
        copier.result(stuck)  # running: waited for once more, then refused
    gate.set()
    assert copier.result(stuck) is True
    assert copier.result(copier.then(lambda: "next")) == "next"  # the helper goes on serving
    assert ran == [], "a cancelled post ran"


def test_a_post_run_at_once_raises_at_once(monkeypatch):
    monkeypatch.delenv(HELPER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="cut"):
        ShardCopier().then(lambda: (_ for _ in ()).throw(RuntimeError("cut")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_copy_runs_on_a_side_stream_and_the_next_step_waits_for_it():
    """One GPU (scripts/gpu_check.sh): the copy is ordered after the training stream's writes, its send
    is posted from the helper once it is done, and a step that writes the shard next waits for it."""
    copier = ShardCopier()
    shard = torch.full((1 << 22,), 1.0, device="cuda")
    views = [torch.empty(1 << 22, pin_memory=True)]  # allocated, and the side stream made, beforehand:
    copier.copy(views, [shard])  # page-locked allocation may synchronize the device
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the training stream is busy; the write below lands after it
    shard.add_(1.0)
    copier.copy(views, [shard])
    posted = copier.then(lambda: views[0].clone())
    assert copier.on_device and copier.posts_from_helper
    copier.before_step()
    shard.mul_(10.0)  # the "step": queued after the copy on the device
    assert torch.equal(copier.result(posted), torch.full((1 << 22,), 2.0))
    torch.cuda.synchronize()
    assert torch.equal(shard.cpu(), torch.full((1 << 22,), 20.0))
