"""A rank whose main thread hangs while its process lives (lease and heartbeat go on) is found by its
agent's progress watchdog (``launch.stalls``), named, fenced and replaced bit-identically; the ranks
that wait for it in a collective are not replaced. Default settings: lease TTL, progress bound, dropout."""

from __future__ import annotations

import re

from helpers import assert_recovered, replaced, run_job, tm_args


def _stalled_whys(job) -> list[tuple[int, str]]:
    return [(r["rank"], r["why"]) for r in replaced(job, "failure")]


def test_a_main_thread_hang_in_forward_is_fenced_and_replaced(tmp_path, corpus, reference):
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", "2:6:forward:HANG"]), name="hang_fwd", timeout=300
    )
    assert_recovered(job, ref, 2)
    whys = _stalled_whys(job)
    assert len(whys) == 1 and whys[0][0] == 2, whys
    assert re.match(
        r"link broken: hung: main thread stalled in forward of iteration 6 for [\d.]+s \(blocked", whys[0][1]
    ), whys
    assert re.search(r"rank 2 \(worker-n0-2-\w+\) hung: main thread stalled", job.stderr()), job.stderr()[-3000:]


def test_a_hang_inside_the_gradient_all_reduce_names_the_culprit(tmp_path, corpus, reference):
    """Rank 3 hangs right after it issued its first data-parallel gradient all-reduce: its peers finish
    that one and wait in the next collective it never issues. Only rank 3 is replaced."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(
        tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", "3:6:in-reduce:HANG"]), name="hang_reduce", timeout=300
    )
    assert_recovered(job, ref, 3)
    whys = _stalled_whys(job)
    assert len(whys) == 1 and whys[0][0] == 3, whys
    assert "main thread stalled in backward of iteration 6" in whys[0][1], whys
