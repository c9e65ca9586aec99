"""GPU path: NCCL backend, CUDA device, TE spec (run by scripts/gpu_check.sh on a GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import losses_by_iteration, run_job, tiny_args

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trains_on_cuda_with_nccl(tmp_path):
    job = run_job(tmp_path, 1, tiny_args(None, iters=6, extra=["--bf16"]), name="gpu")
    assert "| comm nccl |" in job.stdout(), job.stdout()[-2000:]
    losses = losses_by_iteration(job.metrics_path)
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backend_and_spec_selection_on_gpu():
    from trainmover_training.initialize import select_backend

    assert select_backend("auto") == "nccl"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_snapshot_and_rewind():
    """An abandoned iteration's dropout masks are drawn again identically on CUDA: the snapshot covers
    torch's CUDA generator and megatron's tracker (whose states are CUDA generator states on a GPU)."""
    import inspect
    from types import SimpleNamespace

    from megatron.core import tensor_parallel

    from trainmover_training import iteration_start

    # No parallel state here: megatron-core 0.19 reads the ranks from it unless they are given.
    given = inspect.signature(tensor_parallel.model_parallel_cuda_manual_seed).parameters
    ranks = {name: 0 for name in ("tp_rank", "ep_rank", "etp_rank") if name in given}
    tensor_parallel.model_parallel_cuda_manual_seed(1234, **ranks)
    args = SimpleNamespace(iteration=5, consumed_train_samples=80)
    start = iteration_start.capture(args)
    dev = torch.device("cuda", torch.cuda.current_device())

    def draw() -> list[torch.Tensor]:
        plain = torch.rand(64, device=dev)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.nn.functional.dropout(torch.ones(64, device=dev), p=0.5)
        return [plain.cpu(), tracked.cpu()]

    first = draw()
    moved = draw()
    assert not torch.equal(first[0], moved[0]), "the CUDA generator did not move: the check cannot fail"
    assert iteration_start.rewind(start, args)
    again = draw()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
