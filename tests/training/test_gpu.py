"""GPU path: NCCL backend, CUDA device, TE spec (run by scripts/gpu_check.sh on a GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import losses_by_iteration, run_job, tiny_args

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trains_on_cuda_with_nccl(tmp_path):
    job = run_job(tmp_path, 1, tiny_args(None, iters=6, extra=["--bf16"]), name="gpu")
    assert "backend nccl" in job.stdout()
    losses = losses_by_iteration(job.metrics_path)
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backend_and_spec_selection_on_gpu():
    from trainmover_training.initialize import select_backend

    assert select_backend("auto") == "nccl"
