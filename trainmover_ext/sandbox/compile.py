"""``--tm-compile``: ``torch.compile`` of each model chunk, with collectives kept out of the graphs.

Who calls it: ``trainmover_training.model.get_model`` on every rank (job ranks,
standbys in their sandbox, promoted standbys) when ``--tm-compile`` is given.

Why collectives stay eager: by default dynamo rewrites ``torch.distributed``
calls it traces (``all_reduce`` ...) into functional collectives that the C++
dispatcher sends straight to the backend. Such calls bypass the process
group's Python methods, so the sandbox recorder would miss them (a replay of
that recording then fails with a ``ReplayMismatch``), and megatron's
``all_reduce(MAX)`` in the vocab-parallel cross entropy has no functional
backward. Without the rewrite dynamo would trace *into* the collective and
into Python process groups (nccl_delta's, the replay group), which it cannot
do. So :func:`keep_collectives_eager`, once per process, empties dynamo's
rewrite table and tells dynamo to skip the code of every ``torch.distributed``
collective, and every frame it calls, for good (a code object's execution
strategy: it survives anyone swapping ``torch.distributed.all_reduce`` for a
while, as a joiner's quiet build does). Each collective is then a graph break
and runs eagerly through the group object, exactly as in an uncompiled model.
Compiled regions are the compute between collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_EAGER = False

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
"""``torch.distributed`` functions that stay out of compiled graphs under ``--tm-compile`` (megatron calls
point-to-point ops only from the schedules, outside the model)."""


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
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    from torch.distributed import distributed_c10d

    skip_all = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and every frame below it
    for name in COLLECTIVES:
        fn = getattr(distributed_c10d, name, None)
        while fn is not None:  # the c10d logging decorators, then the function itself
            code = getattr(fn, "__code__", None)
            if code is not None:
                set_code_exec_strategy(code, skip_all)
            fn = getattr(fn, "__wrapped__", None)
    _EAGER = True


def compile_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """Compile ``chunk`` in place (``nn.Module.compile``): DDP's hooks and cached references keep it."""
    keep_collectives_eager()
    # Ranks and standbys are forked from a warm parent: inductor's pool of compile workers,
    # inherited or started after the fork, can deadlock there. Compile in the rank's own process.
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    chunk.compile()
    return chunk


def chunk_preparer(args) -> Callable[[torch.nn.Module], object] | None:
    """What ``build_session`` runs on each model chunk for these flags: :func:`compile_chunk` under
    ``--tm-compile``, else nothing."""
    return compile_chunk if getattr(args, "tm_compile", None) else None
