"""What every checkpoint format holds besides the model and optimizer tensors.

Shared by the per-rank format (:mod:`trainmover_training.checkpointing`) and the megatron-core
``torch_dist`` format (:mod:`trainmover_training.dist_checkpoint`): the ``latest`` pointer, which
makes a checkpoint visible only once every rank wrote its part, every RNG state of a process, and
setting the LR scheduler. Every rank calls these; the pointer is written by global rank 0 only.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trainmover_training.errors import CheckpointError

LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    """``ROOT/iter_0000005``: where the checkpoint of ``iteration`` lives, in either format."""
    return os.path.join(root, f"iter_{iteration:07d}")


def write_latest_iteration(root: str, iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration``, atomically (rank 0 only, once
    every rank has written its part)."""
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def publish(root: str, iteration: int, rank: int, after_write: Sequence[Callable[[], None]] = ()) -> None:
    """After this rank wrote its part of the checkpoint of ``iteration``: call ``after_write``, then,
    once every rank has written (a barrier), rank 0 writes the ``latest`` pointer, and every rank waits
    for it (a second barrier). A rank lost before the pointer leaves the previous checkpoint as the
    latest; the others' barrier then fails, which the caller may recover from and save again."""
    for hook in after_write:
        hook()
    torch.distributed.barrier()
    if rank == 0:
        write_latest_iteration(root, iteration)
    torch.distributed.barrier()


def read_latest_iteration(root: str | None) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None."""
    if not root:
        return None
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError as exc:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; delete it or fix it") from exc


def _numpy_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor, so that a checkpoint holds only
    tensors and plain values and loads with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _numpy_state_from(state) -> tuple:
    name, keys, pos, has_gauss, cached = state
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    return (name, keys.astype(np.uint32), pos, has_gauss, cached)


def rng_state() -> dict:
    """Every RNG state of this process."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    # A copy: the tracker keeps the dict it is given and rebinds its entries as regions fork,
    # which would otherwise change ``state`` (an iteration's start, re-applied after a second abandon).
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def load_scheduler_state(scheduler, state: dict) -> None:
    """Set ``scheduler`` to ``state``, whatever it held before.

    megatron-core's ``OptimizerParamScheduler.load_state_dict`` *adds* the saved
    step count to the current one (``step(increment=num_steps)``): right for a
    fresh scheduler, wrong for a live one rolled back during a recovery.
    """
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)
