"""The state an iteration starts from, kept so that an abandoned iteration re-runs exactly.

Contract (every rank, main thread):
- :func:`capture` is called by ``train_step`` before it consumes anything: it
  records the completed-iteration counter, the consumed-samples counter (the
  data position: the data iterators are rebuilt from it) and every random
  state an iteration draws from (Python, numpy, torch CPU and CUDA, and each
  named state of megatron-core's model-parallel RNG tracker).
- An iteration abandoned part-way (a peer failed) has advanced those
  generators by an unknown amount: dropout masks drawn before the failure.
  :func:`rewind` puts them back, so the re-run draws the same masks as a run
  without the failure.
- A state transfer and a checkpoint carry :func:`resume_rng`: the random state
  at the start of the iteration the target resumes with, never the sender's
  advanced one.

Capture costs a few tens of microseconds (the generators' states are small
tensors and tuples); nothing here allocates per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmover_training.checkpointing import rng_state, set_rng_state


@dataclass(frozen=True, kw_only=True)
class IterationStart:
    """What iteration ``iteration + 1`` starts from."""

    iteration: int
    """Completed optimizer steps when the iteration began."""
    consumed_train_samples: int
    """The data position when the iteration began."""
    rng: dict
    """:func:`checkpointing.rng_state` at that moment."""


def capture(args) -> IterationStart:
    """Snapshot the start of the iteration that follows ``args.iteration`` completed steps."""
    return IterationStart(iteration=args.iteration, consumed_train_samples=args.consumed_train_samples, rng=rng_state())


def applies(start: IterationStart | None, args) -> bool:
    """True when ``start`` describes the iteration this rank would run next (same counters)."""
    return (
        start is not None
        and start.iteration == args.iteration
        and start.consumed_train_samples == args.consumed_train_samples
    )


def rewind(start: IterationStart | None, args) -> bool:
    """Restore the random state of an abandoned iteration's start; returns whether it did.

    A rank whose counters moved past ``start`` (it completed the iteration) has nothing to
    rewind: its generators are at the start of its next iteration already."""
    if not applies(start, args):
        return False
    set_rng_state(start.rng)
    return True


def resume_rng(start: IterationStart | None, args) -> dict:
    """The random state a rank resuming at ``args.iteration`` must start from."""
    return start.rng if applies(start, args) else rng_state()
