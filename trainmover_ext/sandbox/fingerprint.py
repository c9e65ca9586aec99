"""The recordings' config fingerprint: what a standby must share with the job to replay it.

The recorder stores :func:`job_fingerprint` in every recording's index; a
standby computes its own and :func:`check_compatible` refuses a difference
with :class:`ConfigMismatch` naming every differing field. It is the job's
model fingerprint (:mod:`trainmover_ext.control.fingerprint`: model shape,
precision, parallel layout, optimizer, batch, seed, megatron-core), which
every standby has already matched before it gets here, plus what else changes
the call sequence or the numerics of a shadow iteration: the layer
implementation, the number of micro-batches, overlapped gradient reduction,
``--tm-compile`` and the torch version.
"""

from __future__ import annotations

from typing import Any

import torch

from trainmover_ext.control.fingerprint import FINGERPRINT_FIELDS as MODEL_FIELDS
from trainmover_ext.control.fingerprint import describe_diff, fingerprint_diff, model_fingerprint
from trainmover_ext.errors import ConfigMismatch

REPLAY_FIELDS: tuple[str, ...] = (
    "transformer_impl",
    "num_microbatches",
    "overlap_grad_reduce",
    # compiled code changes the numerics (fused kernels), and it is part of what a standby must warm
    "tm_compile",
)
FINGERPRINT_FIELDS: tuple[str, ...] = MODEL_FIELDS + REPLAY_FIELDS

__all__ = ["FINGERPRINT_FIELDS", "check_compatible", "fingerprint_diff", "job_fingerprint"]


def job_fingerprint(args: Any) -> dict:
    """JSON-able fingerprint of ``args`` (a parsed, validated ``pretrain_gpt.py`` namespace)."""
    fp = model_fingerprint(args)
    fp.update({name: getattr(args, name, None) for name in REPLAY_FIELDS})
    fp["tm_compile"] = bool(fp["tm_compile"])  # the flag's default is None
    fp["torch_version"] = torch.__version__
    return fp


def check_compatible(job: dict, mine: dict, *, role: str) -> None:
    """Raise :class:`ConfigMismatch` naming each field where the standby differs from the job."""
    diff = fingerprint_diff(job, mine)
    if diff:
        raise ConfigMismatch(
            f"standby refused for role {role!r}: its config differs from the job's recording ({describe_diff(diff)}). "
            "Start the standby with the job's exact model and parallel flags and the same megatron-core/torch."
        )
