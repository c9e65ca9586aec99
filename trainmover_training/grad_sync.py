"""What megatron's DDP keeps of an iteration's gradient synchronisation, made safe to abandon.

Why: TrainMover abandons an iteration (or an evaluation) mid-schedule when a peer fails, and runs it
again after the recovery. Megatron's DDP keeps three things of the abandoned run that would corrupt
the re-run or a later iteration:

- the handle of an asynchronous reduction issued in the backward pass (``--overlap-grad-reduce``), on
  a communicator the recovery abandons: the re-run would find it "still outstanding";
- the per-parameter counts of gradients ready in the last micro-batch: a partial backward's counts
  would start the reduction before every gradient is there;
- the ``no_sync`` context the schedule entered by hand (``__enter__``) and leaves only before the last
  micro-batch's backward. It is a generator whose ``finally`` marks every bucket group's last
  micro-batch. Abandoned, it runs when the garbage collector frees the schedule's frames, which sit in
  reference cycles with the failure's traceback: at any later moment, possibly inside a later
  iteration's earlier micro-batches, where it makes the backward hooks start the data-parallel
  reduction of a bucket before its gradients are all accumulated (seen: the gradients of the ranks of
  one data-parallel group off by a micro-batch's part, two iterations after a recovery, in one run
  out of ten).

Contract
- :func:`wire_no_sync` gives the schedules (``config.no_sync_func``) each model chunk's ``no_sync``
  through a :class:`NoSyncContexts`, which remembers (weakly) every context entered and not yet left.
- :func:`forget_pending_grad_sync` runs after an abandoned iteration, before the recovery: it drops
  the reduction handles and counts and leaves every remembered ``no_sync`` context now (its
  ``finally`` runs here, once; a context the collector frees later does nothing). The gradient
  buffers are zeroed when the re-run starts.
"""

from __future__ import annotations

import weakref
from typing import Any

NO_SYNC_ATTR = "trainmover_no_sync"
"""The model chunk's attribute holding its :class:`NoSyncContexts` (set by :func:`wire_no_sync`)."""


class NoSyncContexts:
    """A model chunk's ``DDP.no_sync`` as ``config.no_sync_func``: each call returns a context manager
    that enters the chunk's own and is remembered, weakly, until it is left (module docstring).

    Weakly: a schedule that ends normally may leave its context entered too (megatron's forward-only
    pipeline schedule never leaves it); freed with the schedule's frame, it runs megatron's ``finally``
    then, as it would without this wrapper, and is forgotten."""

    def __init__(self, chunk: Any) -> None:
        self.chunk = chunk
        self.entered: weakref.WeakSet[_NoSync] = weakref.WeakSet()
        """Contexts entered, not yet left and still referenced (an abandoned schedule's)."""

    def __call__(self) -> _NoSync:
        return _NoSync(self)

    def leave_abandoned(self) -> int:
        """Leave every context still entered (an abandoned schedule's); returns how many."""
        abandoned = list(self.entered)
        for context in abandoned:
            context.__exit__(None, None, None)
        return len(abandoned)


class _NoSync:
    """One ``with no_sync():`` of a schedule (entered and left by hand or by ``with``)."""

    def __init__(self, owner: NoSyncContexts) -> None:
        self._owner = owner
        self._inner: Any = None

    def __enter__(self) -> _NoSync:
        self._inner = self._owner.chunk.no_sync()
        self._inner.__enter__()
        self._owner.entered.add(self)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        inner, self._inner = self._inner, None
        if inner is None:  # left already (by leave_abandoned)
            return False
        self._owner.entered.discard(self)
        return bool(inner.__exit__(*exc_info))


def wire_no_sync(config: Any, model: list[Any]) -> None:
    """Set ``config.no_sync_func``: one :class:`NoSyncContexts` per model chunk (a list for several
    chunks, as megatron's interleaved schedule takes), each also kept on its chunk."""
    contexts = [NoSyncContexts(chunk) for chunk in model]
    for chunk, chunk_contexts in zip(model, contexts, strict=True):
        setattr(chunk, NO_SYNC_ATTR, chunk_contexts)
    config.no_sync_func = contexts if len(contexts) > 1 else contexts[0]


def forget_pending_grad_sync(model: list[Any]) -> int:
    """After an abandoned iteration or evaluation: drop the reduction handles and ready counts of every
    bucket group and leave every ``no_sync`` context the schedule left entered (module docstring);
    returns how many contexts were left."""
    left = 0
    for chunk in model:
        contexts = getattr(chunk, NO_SYNC_ATTR, None)
        if contexts is not None:
            left += contexts.leave_abandoned()
        for group in [*getattr(chunk, "bucket_groups", []), *getattr(chunk, "expert_parallel_bucket_groups", [])]:
            group.grad_reduce_handle = None
            group.per_param_grad_ready_counts = {}
    return left
