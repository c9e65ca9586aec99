"""A rank whose main thread hangs while its process lives (lease and heartbeat go on) is found by its
agent's progress watchdog (``launch.stalls``), named, fenced and replaced bit-identically; the ranks
that wait for it in a collective are not replaced. Default settings: lease TTL, progress bound, dropout."""

from __future__ import annotations

import re

from helpers import assert_recovered, replaced, run_job, tm_args


def _hang(tmp_path, corpus, reference, victim: int, drill: str) -> str:
    """Run the job with ``drill``; it must recover bit-identically with only ``victim`` replaced. Returns why."""
    ref = reference("tp2pp2dp2", 8, tm_args(corpus))
    job = run_job(tmp_path, 8, tm_args(corpus, extra=["--tm-inject-fault", drill]), name="hang", timeout=300)
    assert_recovered(job, ref, victim)
    whys = [(r["rank"], r["why"]) for r in replaced(job, "failure")]
    assert len(whys) == 1 and whys[0][0] == victim, whys
    assert re.search(rf"rank {victim} \(worker-n0-{victim}-\w+\) hung: main thread stalled", job.stderr())
    return whys[0][1]


def test_a_main_thread_hang_in_forward_is_fenced_and_replaced(tmp_path, corpus, reference):
    why = _hang(tmp_path, corpus, reference, 2, "2:6:forward:HANG")
    assert re.match(r"link broken: hung: main thread stalled in forward of iteration 6 for [\d.]+s \(blocked", why)


def test_a_hang_inside_the_gradient_all_reduce_names_the_culprit(tmp_path, corpus, reference):
    """Rank 3 hangs right after it issued its first data-parallel gradient all-reduce: its peers finish
    that one and wait in the next collective it never issues. Only rank 3 is replaced."""
    why = _hang(tmp_path, corpus, reference, 3, "3:6:in-reduce:HANG")
    assert "main thread stalled in backward of iteration 6" in why, why
