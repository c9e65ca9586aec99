"""The NVIDIA resiliency-ext in-process restart baseline resumes a tiny job after a SIGKILL.

Runs ``benchmarks/nvrx_inprocess.py`` on 4 ranks (PP2 x DP2) plus nvrx's spares:
rank 1 is SIGKILLed after iteration 5, nvrx restarts the training function in the
surviving processes, a spare takes rank 1, and training resumes from the
checkpoint of iteration 3 to the end with the fault-free run's losses.
Needs ``pip install -r requirements-bench.txt``; skipped otherwise.
"""

from __future__ import annotations

import os
import sys

import pytest

from trainmover_ext.jobs import REPO_ROOT, model_args

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import nvrx_inprocess  # noqa: E402

REASON = nvrx_inprocess.unavailable_reason()
ITERS = 10


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(REASON is not None, reason=f"nvrx baseline not runnable: {REASON}")
def test_nvrx_inprocess_restart_resumes_tiny_job(corpus, tmp_path):
    job = model_args(layers=2, hidden=64, heads=4, seq=64, mbs=1, gbs=8, iters=ITERS, lr=1e-3) + [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--data-path", corpus + "_text_document", "--tokenizer-type", "ByteLevelTokenizer",
    ]
    result = nvrx_inprocess.measure(corpus, victim=1, at_iteration=5, save_interval=3, job_args=job, ranks=4,
                                    workdir=str(tmp_path))
    assert result["restarts"] >= 1, result
    assert result["spare_took_rank"] is not None, result  # a spare filled a lost rank
    assert result["resumed_iteration"] == 3, result
    assert result["final_iteration"] == ITERS, result
    assert result["bit_identical"], result
    assert result["nvrx_inprocess_s"] > 0, result
