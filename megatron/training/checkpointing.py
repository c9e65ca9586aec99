"""Per-rank checkpoints that resume bit-exactly.

Layout::

    SAVE/latest_checkpointed_iteration.txt      # written last, atomically
    SAVE/iter_0000005/rank_TT_PPP_DDD.pt        # one file per rank

Each file holds the model chunks, the inner optimizer state (the shard for the
distributed optimizer), fp32 master copies when training in bf16/fp16, the LR
scheduler, every RNG state (python, numpy, torch CPU/CUDA, megatron's tracker)
fp16's loss scaler and the consumed-samples counter. A checkpoint becomes visible only when every
rank has written its file (barrier, then the ``latest`` pointer), so a kill
during saving leaves the previous checkpoint as the latest.

megatron-core's ``dist_checkpointing`` is not used: on CPU its torch_dist
strategy needs gloo process groups that we turn off to keep every group on one
communicator, and per-rank files are what exact resume of one layout needs.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron.training.errors import CheckpointError

FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"


def _rank_file(root: str, iteration: int, layout) -> str:
    return os.path.join(
        root, f"iter_{iteration:07d}", f"rank_{layout.tp_rank:02d}_{layout.pp_rank:03d}_{layout.dp_rank:03d}.pt"
    )


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


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _master_groups(opt) -> list | None:
    for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
        groups = getattr(opt, attr, None)
        if groups:
            return groups
    return None


def grad_scaler_states(optimizer) -> list[dict | None]:
    """fp16's loss scaler per optimizer (scale, growth and hysteresis trackers) as plain numbers;
    ``None`` where an optimizer has no scaler (fp32, bf16)."""
    states = []
    for opt in _optimizers(optimizer):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None:
            states.append(None)
            continue
        state = dict(scaler.state_dict()) if hasattr(scaler, "_growth_tracker") else {}
        state["scale"] = float(scaler.scale.item())
        states.append(state)
    return states


def load_grad_scaler_states(optimizer, states: list | None) -> None:
    """Apply :func:`grad_scaler_states`; a missing entry leaves the scaler as it is."""
    for opt, state in zip(_optimizers(optimizer), states or [], strict=False):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None or state is None:
            continue
        scale = torch.tensor([state["scale"]], dtype=torch.float, device=scaler.scale.device)
        if hasattr(scaler, "_growth_tracker"):  # dynamic: scale and both trackers
            scaler.load_state_dict(dict(state, scale=scale))
        else:
            scaler._scale = scale


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


def _layout(args) -> dict:
    """What a checkpoint must match to be loaded: the parallel layout and the model's shape."""
    return {
        "tp": args.tensor_model_parallel_size,
        "pp": args.pipeline_model_parallel_size,
        "dp": args.data_parallel_size,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "distributed_optimizer": args.use_distributed_optimizer,
    }


def training_state(model, optimizer, scheduler, iteration: int, consumed_samples: int, args, with_optim=True) -> dict:
    """Everything a rank needs to continue exactly from ``iteration``."""
    state = {
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "layout": _layout(args),
        "model": [chunk.state_dict() for chunk in model],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
    }
    if with_optim:
        state["optimizer"] = [opt.optimizer.state_dict() for opt in _optimizers(optimizer)]
        state["grad_scaler"] = grad_scaler_states(optimizer)
        state["master"] = [
            [[p.detach().clone() for p in g] for g in (_master_groups(opt) or [])] for opt in _optimizers(optimizer)
        ]
    return state


def load_scheduler_state(scheduler, state: dict) -> None:
    """Set ``scheduler`` to ``state``, whatever it held before.

    megatron-core's ``OptimizerParamScheduler.load_state_dict`` *adds* the saved
    step count to the current one (``step(increment=num_steps)``): right for a
    fresh scheduler, wrong for a live one rolled back during a recovery.
    """
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def load_training_state(
    state: dict, model, optimizer, scheduler, args, load_optim=True, load_rng=True
) -> tuple[int, int]:
    """Apply a :func:`training_state` dict; returns ``(iteration, consumed_samples)``."""
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format version {state.get('version')} is not {FORMAT_VERSION}")
    expected = _layout(args)
    diff = {k: (state["layout"].get(k), v) for k, v in expected.items() if state["layout"].get(k) != v}
    if diff:
        raise CheckpointError(
            "checkpoint layout differs from this job: "
            + ", ".join(f"{k} saved={a} now={b}" for k, (a, b) in diff.items())
            + ". Resume with the same flags, or start a new --save directory."
        )
    for chunk, sd in zip(model, state["model"], strict=False):
        chunk.load_state_dict(sd, strict=True)
    if load_optim and "optimizer" in state:
        for opt, opt_sd, master in zip(_optimizers(optimizer), state["optimizer"], state["master"], strict=False):
            opt.optimizer.load_state_dict(opt_sd)
            for group, saved in zip(_master_groups(opt) or [], master, strict=False):
                for p, s in zip(group, saved, strict=False):
                    p.data.copy_(s)
        load_grad_scaler_states(optimizer, state.get("grad_scaler"))
    if scheduler is not None and state.get("scheduler") is not None:
        load_scheduler_state(scheduler, state["scheduler"])
    if load_rng:
        set_rng_state(state["rng"])
    return state["iteration"], state["consumed_train_samples"]


def save_checkpoint(
    root: str,
    iteration: int,
    model,
    optimizer,
    scheduler,
    consumed_samples: int,
    args,
    layout,
    after_write: Sequence[Callable[[], None]] = (),
) -> str:
    """Write this rank's file, call ``after_write``, then (rank 0, after a barrier) the ``latest`` pointer.

    A rank lost before the pointer is written leaves the previous checkpoint as the latest; the
    other ranks' barrier then fails, which the caller may recover from and save again."""
    path = _rank_file(root, iteration, layout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = training_state(model, optimizer, scheduler, iteration, consumed_samples, args, not args.no_save_optim)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    for hook in after_write:
        hook()
    torch.distributed.barrier()
    if layout.rank == 0:
        tmp = os.path.join(root, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, LATEST))
    torch.distributed.barrier()
    return path


def load_checkpoint(root: str, model, optimizer, scheduler, args, layout) -> tuple[int, int]:
    """Load the latest checkpoint under ``root``; ``(0, 0)`` when there is none."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {root} has no {LATEST}; drop --exit-on-missing-checkpoint to start fresh")
        return 0, 0
    path = _rank_file(root, iteration, layout)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint file {path} is missing: the checkpoint of iteration {iteration} is incomplete"
        )
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings, containers); anything that
        # would run code when unpickled is refused.
        state = torch.load(path, map_location=layout.device, weights_only=True)
    except Exception as exc:  # torch raises many kinds for a truncated or unsafe file
        raise CheckpointError(
            f"cannot read checkpoint {path}: {str(exc).splitlines()[0][:300]} (a checkpoint "
            "holds tensors and plain values only; one that needs code to load is refused)"
        ) from exc
    return load_training_state(state, model, optimizer, scheduler, args, not args.no_load_optim, not args.no_load_rng)
