"""The NVIDIA resiliency-ext in-process restart baseline resumes a tiny job after a SIGKILL.

Runs ``benchmarks/nvrx_inprocess.py`` on 4 ranks (PP2 x DP2) plus nvrx's spares:
rank 1 is SIGKILLed after iteration 5, nvrx restarts the training function in the
surviving processes, a spare takes rank 1, and training resumes from the
checkpoint of iteration 3 to the end with the fault-free run's losses.
Needs ``pip install -r requirements-bench.txt``; skipped otherwise.

The gloo abort the baseline composes into nvrx's abort (shutting the rank's gloo
connections down) is tested on its own with two gloo processes; it needs no nvrx.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import nvrx_inprocess  # benchmarks/ is on the test path (pytest.ini)
import pytest

from harness.jobs import REPO_ROOT, model_args
from trainmover_ext.netutil import free_port

REASON = nvrx_inprocess.unavailable_reason()
ITERS = 10


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(REASON is not None, reason=f"nvrx baseline not runnable: {REASON}")
def test_nvrx_inprocess_restart_resumes_tiny_job(corpus, tmp_path):
    job = model_args(layers=2, hidden=64, heads=4, seq=64, mbs=1, gbs=8, iters=ITERS, lr=1e-3) + [
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--data-path",
        corpus + "_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]
    result = nvrx_inprocess.measure(
        corpus, victim=1, at_iteration=5, save_interval=3, job_args=job, ranks=4, workdir=str(tmp_path)
    )
    assert result["restarts"] >= 1, result
    assert result["spare_took_rank"] is not None, result  # a spare filled a lost rank
    assert result["resumed_iteration"] == 3, result
    assert result["final_iteration"] == ITERS, result
    assert result["bit_identical"], result
    assert result["nvrx_inprocess_s"] > 0, result


_BENCHMARKS_ON_PATH = dict(os.environ, PYTHONPATH=os.path.join(REPO_ROOT, "benchmarks"))
"""The children below import benchmarks/nvrx_gloo_fixes.py."""

# Rank 0 waits in an all-reduce that rank 1 never joins; a thread shuts rank 0's gloo connections
# down (keeping the store's) and the all-reduce must raise, while the store keeps working.
BLOCKED_RANK = textwrap.dedent("""
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from nvrx_gloo_fixes import shutdown_tcp_connections
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        store.wait(["done"])
        store.set("bye", "1")  # rank 0 hosts the store: it leaves after this
        os._exit(0)
    shutter = threading.Timer(1.0, lambda: print("shut", shutdown_tcp_connections({port}), flush=True))
    shutter.start()
    start = time.time()
    try:
        dist.all_reduce(torch.ones(4))
        print("not aborted")
    except RuntimeError as exc:
        print(f"aborted after {time.time() - start:.1f} s: {exc}", flush=True)
    shutter.join(timeout=30)  # the abort can return before the timer prints what it shut
    store.set("done", "1")
    store.wait(["bye"])
    os._exit(0)
""")


@pytest.mark.timeout(120)
def test_socket_abort_fails_a_blocked_gloo_collective():
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BLOCKED_RANK, str(rank), str(port)],
            env=_BENCHMARKS_ON_PATH,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], out
    assert "aborted after" in out[0] and "Connection closed" in out[0], out[0]
    shut = int(out[0].split("shut ")[1].split()[0])
    assert shut >= 1, out[0]  # the gloo pair; the store's connection was kept (it set "done")


# Two nvrx iterations on one rank, each torn down the way an asynchronous RankShouldRestart can cut
# destroy_process_group short (default group and tables dropped; names registered, counter stale).
CUT_SHORT_TEARDOWN = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from nvrx_gloo_fixes import finish_torch_teardown
    store = dist.HashStore()
    for iteration in range(2):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"it{iteration}", store), rank=0, world_size=1)
        dist.all_reduce(torch.ones(1), group=dist.new_group([0]))
        c10d._update_default_pg(None)
        c10d._world.pg_map.clear()
        c10d._world.pg_names.clear()
        print("stale", finish_torch_teardown(), flush=True)
    print("restarted twice")
""")


@pytest.mark.timeout(120)
def test_finish_torch_teardown_lets_a_cut_short_teardown_restart():
    out = subprocess.run(
        [sys.executable, "-c", CUT_SHORT_TEARDOWN],
        env=_BENCHMARKS_ON_PATH,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Two groups were named from the counter (WORLD and the new group); the second init reuses "0".
    assert out.stdout.split("\n")[:3] == ["stale 2", "stale 2", "restarted twice"], out.stdout
