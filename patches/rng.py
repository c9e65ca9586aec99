"""Point megatron-core's model-parallel RNG tracker at the CPU generator.

On a CPU build ``torch.cuda.manual_seed`` silently does nothing and
``torch.cuda.get_rng_state`` raises, so the tracker that forks the RNG for
tensor-parallel regions (dropout, init) would either crash or, worse, reuse one
state for every region. This patch makes the tracker's state the CPU default
generator's state, so forked regions are deterministic and checkpointable.
"""

from __future__ import annotations

import logging

import torch

from ._rewrite import rewrite


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``_get_cuda_rng_state``: the default CPU generator's state."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``_set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


class _SameGeneratorWarning(logging.Filter):
    """Drops megatron's "CPU RNG state changed within GPU RNG context": with the tracker on the CPU
    generator, the region's own draws (dropout) change that generator by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def install() -> list[str]:
    """Install the CPU RNG functions into ``megatron.core.tensor_parallel.random``."""
    from megatron.core.tensor_parallel import random as mp_random

    logging.getLogger(mp_random.__name__).addFilter(_SameGeneratorWarning())
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    rewrite(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker.add",
        [
            ("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
            ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)"),
        ],
    )
    return [
        "megatron.core.tensor_parallel.random._get_cuda_rng_state",
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
        "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add",
    ]
