"""The job's config fingerprint: what a standby must share with the job to replay it.

The recorder stores :func:`job_fingerprint` in every recording's index; a
standby computes its own and :func:`check_compatible` refuses a difference
with :class:`ConfigMismatch` naming every differing field. The fields are the
ones that change tensor shapes, the call sequence, or the numerics of a
shadow iteration: model shape, parallel layout, batch geometry, precision,
optimizer sharding, seed, and the megatron-core and torch versions.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from trainmover_ext.errors import ConfigMismatch

FINGERPRINT_FIELDS: tuple[str, ...] = (
    # model
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
    "max_position_embeddings", "padded_vocab_size", "untie_embeddings_and_output_weights", "transformer_impl",
    # parallel layout
    "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
    "virtual_pipeline_model_parallel_size", "sequence_parallel",
    # batch geometry and precision
    "micro_batch_size", "global_batch_size", "num_microbatches", "bf16", "fp16",
    # optimizer / DDP structure, and the seed (initial weights and data order)
    "use_distributed_optimizer", "overlap_grad_reduce", "seed",
    # compiled code changes the numerics (fused kernels), and it is part of what a standby must warm
    "tm_compile",
)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def job_fingerprint(args: Any) -> dict:
    """JSON-able fingerprint of ``args`` (a parsed, validated ``pretrain_gpt.py`` namespace)."""
    fp = {name: getattr(args, name, None) for name in FINGERPRINT_FIELDS}
    fp["tm_compile"] = bool(fp["tm_compile"])  # the flag's default is None
    fp["megatron_core_version"] = _version("megatron-core")
    fp["torch_version"] = torch.__version__
    return fp


def fingerprint_diff(job: dict, mine: dict) -> dict[str, tuple]:
    """``field -> (job value, standby value)`` for every field that differs."""
    return {k: (job.get(k), mine.get(k)) for k in sorted(set(job) | set(mine)) if job.get(k) != mine.get(k)}


def check_compatible(job: dict, mine: dict, *, role: str) -> None:
    """Raise :class:`ConfigMismatch` naming each field where the standby differs from the job."""
    diff = fingerprint_diff(job, mine)
    if diff:
        fields = "; ".join(f"{k}: job {a!r}, standby {b!r}" for k, a, b in ((k, *v) for k, v in diff.items()))
        raise ConfigMismatch(
            f"standby refused for role {role!r}: its config differs from the job's recording ({fields}). "
            "Start the standby with the job's exact model and parallel flags and the same megatron-core/torch."
        )
