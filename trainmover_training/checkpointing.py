"""Checkpoints: the per-rank format (``--ckpt-format torch``, the default), which resumes
bit-exactly in the same layout, and the entry points for both formats.

:func:`save_checkpoint` writes the format ``--ckpt-format`` names; :func:`load_checkpoint` reads
whichever format the latest checkpoint under ``--load`` is in (an iteration directory with
megatron-core's ``metadata.json`` is ``torch_dist``, see :mod:`trainmover_training.dist_checkpoint`).
Every rank calls both.

Per-rank layout::

    SAVE/latest_checkpointed_iteration.txt      # written last, atomically
    SAVE/iter_0000005/rank_TT_PPP_DDD.pt        # one file per rank

Each file holds the model chunks, the inner optimizer state (the shard for the
distributed optimizer), fp32 master copies when training in bf16/fp16, the LR
scheduler, every RNG state (python, numpy, torch CPU/CUDA, megatron's tracker)
fp16's loss scaler and the consumed-samples counter. A checkpoint becomes visible only when every
rank has written its file (barrier, then the ``latest`` pointer), so a kill
during saving leaves the previous checkpoint as the latest.

Per-rank files load only into the layout that wrote them; ``torch_dist`` changes layout on resume.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from trainmover_training import dist_checkpoint
from trainmover_training.checkpoint_state import (
    LATEST,
    iteration_dir,
    load_scheduler_state,
    publish,
    read_latest_iteration,
    rng_state,
    set_rng_state,
)
from trainmover_training.errors import CheckpointError

__all__ = [
    "LATEST",
    "FORMAT_VERSION",
    "check_save_format",
    "checkpoint_format",
    "load_checkpoint",
    "load_scheduler_state",
    "read_latest_iteration",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

FORMAT_VERSION = 1
RANK_FILE_PREFIX = "rank_"


def _rank_file(root: str, iteration: int, layout) -> str:
    return os.path.join(
        iteration_dir(root, iteration),
        f"{RANK_FILE_PREFIX}{layout.tp_rank:02d}_{layout.pp_rank:03d}_{layout.dp_rank:03d}.pt",
    )


def check_save_format(args) -> None:
    """Raise CheckpointError if this job cannot write ``--ckpt-format`` (every rank, once the process
    group exists)."""
    if args.save and getattr(args, "ckpt_format", "torch") == dist_checkpoint.FORMAT:
        dist_checkpoint.require_planning_backend()


def checkpoint_format(path: str) -> str | None:
    """The format of the iteration directory ``path``: ``torch_dist`` (megatron-core's
    ``metadata.json``), ``torch`` (per-rank files), or None when it holds neither."""
    if os.path.isfile(os.path.join(path, dist_checkpoint.METADATA_FILE)):
        return dist_checkpoint.FORMAT
    if os.path.isdir(path) and any(name.startswith(RANK_FILE_PREFIX) for name in os.listdir(path)):
        return "torch"
    return None


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
    """Write this rank's part in the format ``--ckpt-format`` names, call ``after_write``, then
    (rank 0, after a barrier) the ``latest`` pointer; returns this rank's file (``torch``) or the
    iteration directory (``torch_dist``).

    A rank lost before the pointer is written leaves the previous checkpoint as the latest; the
    other ranks' barrier then fails, which the caller may recover from and save again."""
    if getattr(args, "ckpt_format", "torch") == dist_checkpoint.FORMAT:
        return dist_checkpoint.save(
            root, iteration, model, optimizer, scheduler, consumed_samples, args, layout, after_write
        )
    path = _rank_file(root, iteration, layout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = training_state(model, optimizer, scheduler, iteration, consumed_samples, args, not args.no_save_optim)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    publish(root, iteration, layout.rank, after_write)
    return path


def load_checkpoint(root: str, model, optimizer, scheduler, args, layout) -> tuple[int, int]:
    """Load the latest checkpoint under ``root``, in whichever format it is; ``(0, 0)`` when there
    is none."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {root} has no {LATEST}; drop --exit-on-missing-checkpoint to start fresh")
        return 0, 0
    found = checkpoint_format(iteration_dir(root, iteration))
    if found == dist_checkpoint.FORMAT:
        return dist_checkpoint.load(root, iteration, model, optimizer, scheduler, args, layout)
    if found is None and os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(
            f"{iteration_dir(root, iteration)} holds neither per-rank files ({RANK_FILE_PREFIX}*.pt, "
            f"--ckpt-format torch) nor megatron-core's {dist_checkpoint.METADATA_FILE} (--ckpt-format "
            f"torch_dist): the checkpoint of iteration {iteration} is incomplete or not a checkpoint; point "
            f"{LATEST} at a complete one or load another directory"
        )
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
