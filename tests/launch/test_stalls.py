"""The progress watchdog (``launch.stalls``) on real processes: a rank whose main thread blocks outside a
collective is named; one that waits in a collective, one that computes, and one in a save are not."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainmover_ext.launch import progress
from trainmover_ext.launch.stalls import StallWatch

RANK = """
import sys, time
from trainmover_ext.launch import progress
progress.start(sys.argv[1])
for i in range({iters}):  # iterations: the pace is known
    progress.mark("control", i)
    progress.mark("forward")
    time.sleep({pause})
progress.mark("control", {iters})
progress.mark({phase!r})
{then}
"""
BLOCK = "time.sleep(60)"
WAIT = "with progress.waiting('dp-0', 41):\n    time.sleep(60)"
SPIN = "t = time.time()\nwhile time.time() - t < 60:\n    pass"


def _start(tmp_path, name: str, phase: str, then: str, iters: int, pause: float) -> tuple[subprocess.Popen, str]:
    path = tmp_path / name
    path.write_bytes(b"\0" * 8)
    script = RANK.format(phase=phase, then=then, iters=iters, pause=pause)
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)])
    return proc, str(path)


def _watch(watch: StallWatch, procs: dict[str, tuple[subprocess.Popen, str]], seconds: float) -> dict[str, float]:
    """Poll like the agent (every 50 ms) for ``seconds``; when each key was first found stalled (and the
    bound it was judged by, in ``watch.judged_by``)."""
    found: dict[str, float] = {}
    watch.judged_by = {}  # type: ignore[attr-defined]
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        live = {k: (p.pid, i, path) for i, (k, (p, path)) in enumerate(procs.items()) if k not in found}
        for key, why in watch.stalled(live):
            found[key] = time.monotonic() - t0
            watch.judged_by[key] = watch.bound(key)  # type: ignore[attr-defined]
            procs[key][0].kill()
            assert "main thread stalled" in why
        time.sleep(0.05)
    return found


@pytest.fixture
def procs(tmp_path):
    started: dict[str, tuple[subprocess.Popen, str]] = {}

    def start(name: str, phase: str, then: str, iters: int = 3, pause: float = 0.05):
        return started.setdefault(name, _start(tmp_path, name, phase, then, iters, pause))

    yield start
    for proc, _ in started.values():
        proc.kill()
        proc.wait(10)


def test_the_blocked_rank_is_named_and_its_waiting_peer_is_not(procs):
    culprit = procs("culprit", "forward", BLOCK)
    waiter = procs("waiter", "backward", WAIT)
    saver = procs("saver", "save", BLOCK)
    found = _watch(StallWatch(1.0), {"culprit": culprit, "waiter": waiter, "saver": saver}, 4.0)
    assert set(found) == {"culprit"}
    assert found["culprit"] < 3.0  # the bound (1 s) after its imports, and a poll


def test_a_computing_main_thread_is_judged_only_at_three_bounds(procs):
    spinner = procs("spinner", "forward", SPIN)
    found = _watch(StallWatch(0.6), {"spinner": spinner}, 5.0)
    assert "spinner" in found
    blocker = procs("blocker", "forward", BLOCK)
    quick = _watch(StallWatch(0.6), {"blocker": blocker}, 5.0)
    # Both start with ~1 s of imports before their last mark; the spinner needs 1.8 s more, the blocker 0.6 s.
    assert found["spinner"] - quick["blocker"] > 0.8


def test_the_default_bound_follows_the_pace_and_needs_it(procs):
    watch = StallWatch()
    slow = procs("slow", "forward", BLOCK, iters=4, pause=1.2)  # 1.2 s iterations: a bound of 4.8 s
    assert watch.bound("slow") is None
    found = _watch(watch, {"slow": slow}, 16.0)
    assert "slow" in found
    assert watch.judged_by["slow"] == pytest.approx(4.8, abs=0.4)  # type: ignore[attr-defined]
    assert found["slow"] >= 4 * 1.2 + 4.8  # four iterations, then the bound


def test_a_torn_or_missing_record_reads_as_none(tmp_path):
    path = tmp_path / "beat"
    path.write_bytes(b"\0" * 8)
    assert progress.read(str(path)) is None
    progress.start(str(path))
    try:
        progress.mark("step", 7)
        record = progress.read(str(path))
        assert record is not None and (record.phase, record.iteration, record.group) == ("step", 7, None)
        with progress.waiting("tp-1", 9):
            inside = progress.read(str(path))
        assert inside is not None and (inside.group, inside.op) == ("tp-1", 9)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # the trailing generation no longer matches the leading one
        path.write_bytes(bytes(raw))
        assert progress.read(str(path)) is None
    finally:
        progress._writer = None
