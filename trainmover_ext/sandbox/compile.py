"""``--tm-compile``: ``torch.compile`` of each model chunk, with collectives kept out of the graphs.

Who calls it: ``megatron.training.model.get_model`` on every rank (job ranks,
standbys in their sandbox, promoted standbys) when ``--tm-compile`` is given.

Why collectives stay eager: by default dynamo rewrites ``torch.distributed``
calls it traces (``all_reduce`` ...) into functional collectives that the C++
dispatcher sends straight to the backend. Such calls bypass the process
group's Python methods, so the sandbox recorder would miss them (a replay of
that recording then fails with a ``ReplayMismatch``), and megatron's
``all_reduce(MAX)`` in the vocab-parallel cross entropy has no functional
backward. :func:`keep_collectives_eager` empties dynamo's rewrite table once
per process: dynamo then breaks the graph at each collective, which runs
eagerly through the group object like in an uncompiled model. Compiled
regions are the compute between collectives.
"""

from __future__ import annotations

import torch

_EAGER = False


def keep_collectives_eager() -> None:
    """Stop dynamo from rewriting ``torch.distributed`` collectives into graph ops (idempotent)."""
    global _EAGER
    if _EAGER:
        return
    from torch.distributed import _functional_collectives as functional

    # A private table of torch 2.x; if it moves, compile still works, only recording of compiled
    # collectives would miss calls, which the replay then reports as a ReplayMismatch.
    remaps = getattr(functional, "traceable_collective_remaps", None)
    if isinstance(remaps, dict):
        remaps.clear()
    _EAGER = True


def compile_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """Compile ``chunk`` in place (``nn.Module.compile``): DDP's hooks and cached references keep it."""
    keep_collectives_eager()
    chunk.compile()
    return chunk
