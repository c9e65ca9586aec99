"""Context parallelism (``--context-parallel-size``): megatron-core's context-parallel attention is
TransformerEngine's, so it runs only on GPUs. On CPU the flag is refused by name with the reason; the
grid and replica rules are unit-tested in tests/control/test_convergence.py. The GPU cases run in
``scripts/gpu_check_multi.sh``: CP2 trains the losses of one rank, and a failure under CP2 x DP2 is
recovered bit-identically."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_recovered, losses_by_iteration, run_job, tiny_args, tm_args, trajectory
from trainmover_ext.config import add_trainmover_args
from trainmover_training.arguments import parse_args
from trainmover_training.errors import ConfigError


def _te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_te(), reason="checks the refusal where TransformerEngine with CUDA is absent")
def test_context_parallelism_without_transformer_engine_is_refused_by_name():
    with pytest.raises(ConfigError, match="--context-parallel-size 2 needs TransformerEngine's attention"):
        parse_args(add_trainmover_args, argv=tiny_args(None, extra=["--context-parallel-size", "2"]), world_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size must be >= 1"):
        parse_args(add_trainmover_args, argv=tiny_args(None, extra=["--context-parallel-size", "0"]), world_size=2)
    # the companion: CP 1 (Megatron-LM's default, spelled out) is accepted
    args = parse_args(add_trainmover_args, argv=tiny_args(None, extra=["--context-parallel-size", "1"]), world_size=2)
    assert args.data_parallel_size == 2


def _cp_args(corpus, *, cp: int, extra: list[str] | None = None) -> list[str]:
    # fp32 and no dropout: the comparison across layouts is of the same arithmetic
    return tiny_args(corpus, tp=1, pp=1, dropout=0, extra=["--context-parallel-size", str(cp), *(extra or [])])


@pytest.mark.gpu
@pytest.mark.skipif(not _te() or torch.cuda.device_count() < 2, reason="needs TransformerEngine and 2 CUDA devices")
def test_context_parallel_training_matches_one_rank(tmp_path, corpus):
    """CP2 on 2 GPUs splits each sequence into four chunks (two per rank, balanced for the causal mask)
    and trains the losses of one rank within 1e-3."""
    one = losses_by_iteration(run_job(tmp_path, 1, _cp_args(corpus, cp=1), name="cp1").metrics_path)
    two = run_job(tmp_path, 2, _cp_args(corpus, cp=2), name="cp2")
    assert "x CP2 |" in two.stdout(), two.stdout()[-2000:]
    got = losses_by_iteration(two.metrics_path)
    assert sorted(got) == sorted(one) == list(range(1, 11))
    assert all(abs(got[it] - one[it]) <= 1e-3 * abs(one[it]) for it in one), (got, one)


@pytest.mark.gpu
@pytest.mark.skipif(not _te() or torch.cuda.device_count() < 4, reason="needs TransformerEngine and 4 CUDA devices")
def test_a_failure_under_context_parallelism_is_bit_identical(tmp_path, corpus):
    """CP2 x DP2 in bf16 with dropout 0.1 under --trainmover: rank 3 (CP rank 1 of replica 1) is killed in
    the backward pass; its state comes from a rank of its dp-cp group, and the run is bit-identical."""
    cp = ["--context-parallel-size", "2", "--bf16"]
    ref = trajectory(run_job(tmp_path, 4, tm_args(corpus, tp=1, pp=1, extra=cp), name="cp_clean").metrics_path)
    job = run_job(
        tmp_path, 4, tm_args(corpus, tp=1, pp=1, extra=[*cp, "--tm-inject-fault", "3:6:backward"]), name="cp_fault"
    )
    assert_recovered(job, ref, victim=3)
