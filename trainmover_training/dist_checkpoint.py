"""megatron-core ``dist_checkpointing`` checkpoints (``--ckpt-format torch_dist``), laid out as
Megatron-LM lays them out, so that either can resume the other's and a job can change its TP/PP
layout on resume.

Layout::

    SAVE/latest_checkpointed_iteration.txt      # written last, atomically (rank 0)
    SAVE/iter_0000005/                          # one dist checkpoint: metadata.json, common.pt, *.distcp

The state dict is Megatron-LM's: ``model`` (``model0``, ``model1``... with virtual pipeline
stages) is each chunk's ``sharded_state_dict()``, ``optimizer`` the optimizer's sharded state
(parameter space, so it reshards across TP and PP; the distributed optimizer's in Megatron-LM's
default bucket space, :data:`DISTOPT_SHARDING`, which reshards across DP only), ``opt_param_scheduler``, ``iteration``,
``checkpoint_version``, ``args`` (its plain values, with ``consumed_train_samples``) and
``rng_state``, one object per (PP, TP, DP) rank. RNG states load only into the layout that saved
them; another layout keeps its own (dropout then differs from an uninterrupted run, as in
Megatron-LM).

Every rank calls :func:`save` and :func:`load`. megatron-core plans on the default process group
(gathers, scatters, barriers) and takes no other group, so the default group must be gloo, nccl or
TrainMover's ``nccl_delta`` (``--trainmover``: its collectives, scatter among them, carry the
planning); on another backend both raise :class:`CheckpointError` before any collective, naming
``--ckpt-format torch``, and a job with ``--save`` checks this at start
(``checkpointing.check_save_format``). Nothing here keeps a process group or any other state
between calls, so a migration leaves nothing stale.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence

import torch

from trainmover_training.checkpoint_state import (
    iteration_dir,
    load_scheduler_state,
    publish,
    rng_state,
    set_rng_state,
)
from trainmover_training.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "torch_dist"
METADATA_FILE = "metadata.json"
"""megatron-core's marker of a complete dist checkpoint (written last, by rank 0)."""
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's ``checkpoint_version`` of the checkpoints it writes."""
DISTOPT_SHARDING = "dp_reshardable"
"""How the distributed optimizer's state is laid out in a checkpoint, as Megatron-LM writes it by
default: each rank writes its own shard of each gradient bucket (no gather), and the checkpoint loads at
another data-parallel size, not at another TP or PP layout. A checkpoint is read in the layout it names."""
SHARDING_KEY = "param_state_sharding_type"
"""Where megatron-core records that layout in the optimizer's common state."""
PLANNING_BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl", "nccl_delta")
_PLAIN = (str, int, float, bool, type(None))


def model_keys(num_chunks: int) -> list[str]:
    """Megatron-LM's state-dict keys of the model chunks: ``model``, or ``model0``... with virtual
    pipeline stages."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def core_module(chunk):
    """The megatron-core model inside DDP and Float16Module (whose sharded keys have no prefix)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def plain_args(args, consumed_samples: int) -> argparse.Namespace:
    """The flags' plain values (what a checkpoint keeps of ``args``), with the consumed samples;
    objects a runtime hung on ``args`` are left out so the checkpoint loads without code."""
    kept = {
        k: v
        for k, v in vars(args).items()
        if isinstance(v, _PLAIN) or (isinstance(v, (list, tuple)) and all(isinstance(x, _PLAIN) for x in v))
    }
    kept["consumed_train_samples"] = consumed_samples
    return argparse.Namespace(**kept)


def rng_sharding(layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global_shape, offset)`` of this rank's RNG object: one object per (PP, TP, DP) rank."""
    return (layout.pp_size, layout.tp_size, layout.dp_size), (layout.pp_rank, layout.tp_rank, layout.dp_rank)


def require_planning_backend() -> None:
    """Raise unless megatron-core can plan a dist checkpoint on the default process group."""
    backend = str(torch.distributed.get_backend())
    if backend not in PLANNING_BACKENDS:
        raise CheckpointError(
            f"--ckpt-format torch_dist needs the default process group on gloo or nccl, and this job's is "
            f"{backend!r}: megatron-core plans a dist checkpoint with a scatter on the default group, which "
            f"{backend!r} does not implement. Use --ckpt-format torch (per-rank files); --tm-comm native would "
            "run torch_dist, but without the nccl_delta communicator that live recovery relies on"
        )


def sharded_training_state(
    model, optimizer, *, with_optim: bool, rng: bool, layout, is_loading: bool, sharding: str | None = None
) -> dict:
    """The sharded part of the state dict: model chunks, optionally the optimizer (the distributed
    optimizer's in the layout ``sharding``) and this rank's RNG object (its ``data`` is the current state;
    on load, a placeholder that the load replaces)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict = {
        key: core_module(chunk).sharded_state_dict() for key, chunk in zip(model_keys(len(model)), model, strict=True)
    }
    if with_optim:
        # The optimizer's sharded tensors are matched to the model's by parameter identity: it takes
        # the whole dict (every chunk), as in Megatron-LM.
        metadata = {"distrib_optim_sharding_type": sharding} if sharding else None
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
    if rng:
        shape, offset = rng_sharding(layout)
        state["rng_state"] = ShardedObject("rng_state", rng_state(), shape, offset, replica_id=0)
    return state


def synchronous_save_strategy():
    """megatron-core's ``torch_dist`` save strategy, writing in the calling process.

    Its own strategy is asynchronous even when called synchronously: it stages tensors with
    ``torch.cuda.synchronize()`` (which fails on a CPU-only build), gathers results through a
    ``spawn`` multiprocessing manager and forks one writer process per thread, from a rank that
    holds live gloo connections. This one translates the state dict and plans exactly as megatron-core
    does (same keys, same planner, so the same files and metadata) and lets torch's DCP write
    synchronously."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SynchronousTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(
                mcore_to_pyt_state_dict(by_key, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, sync_files=True),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                ),
            )

    return SynchronousTorchDistSave(FORMAT, 1)


def fill_initial_adam_state(optimizer) -> None:
    """Give each parameter Adam has not stepped yet the state Adam's first step would create (step
    0, zero moments), so that the checkpoint holds every optimizer tensor the loading side asks for.

    fp16 skips the steps whose gradients overflow, so a checkpoint can come before the first real
    step; without this its optimizer state would lack the keys a loading optimizer requests. The
    values equal Adam's lazy initialisation, so the run continues bit-identically."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param.data),
                        "exp_avg_sq": torch.zeros_like(param.data),
                    }


def restore_zero_step(state) -> None:
    """Put back the Adam step 0 that megatron-core leaves out of a saved optimizer state.

    megatron-core saves the step all parameters share only when it is non-zero (``if step:``), so a
    checkpoint written before Adam's first real step (fp16 skips the steps whose gradients overflow)
    has none, and torch's ``Adam.load_state_dict`` then fails on the missing ``step``. Walks the loaded
    optimizer state and adds ``common_step`` 0 to each torch optimizer state that lacks its steps."""
    if isinstance(state, dict):
        entries = state.get("state") if "param_groups" in state else None
        if isinstance(entries, dict) and "common_step" not in entries:
            if any(isinstance(entry, dict) and "step" not in entry for entry in entries.values()):
                entries["common_step"] = torch.tensor(0.0)
        children = list(state.values())
    elif isinstance(state, (list, tuple)):
        children = list(state)
    else:
        return
    for child in children:
        restore_zero_step(child)


def restore_distopt_steps(optimizer) -> None:
    """Give each parameter of a distributed optimizer just loaded its own Adam step, the saved one.

    Without Apex or TransformerEngine, megatron-core keeps the step in the param groups and, on load,
    hands one step tensor to every parameter's state; torch's Adam then increments that one tensor once
    per parameter per step. Its bucket-space state also copies the loading process's own step (taken
    before the load) over it. Each parameter gets a tensor of its own holding its group's saved step."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def save(
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
    """Write the checkpoint of ``iteration`` with megatron-core, call ``after_write``, then (rank 0,
    after a barrier) the ``latest`` pointer. Returns the iteration directory.

    megatron-core writes ``metadata.json`` last; the pointer follows it, so a kill while saving
    leaves the previous checkpoint as the latest (a re-save overwrites the partial directory)."""
    from megatron.core import dist_checkpointing

    require_planning_backend()
    if not args.no_save_optim:
        fill_initial_adam_state(optimizer)
    path = iteration_dir(root, iteration)
    os.makedirs(path, exist_ok=True)
    state = sharded_training_state(
        model,
        optimizer,
        with_optim=not args.no_save_optim,
        rng=True,
        layout=layout,
        is_loading=False,
        sharding=DISTOPT_SHARDING if args.use_distributed_optimizer else None,
    )
    state.update(
        iteration=iteration,
        checkpoint_version=CHECKPOINT_VERSION,
        args=plain_args(args, consumed_samples),
        opt_param_scheduler=scheduler.state_dict() if scheduler is not None else None,
        rng_sharding=list(rng_sharding(layout)[0]),
    )
    dist_checkpointing.save(state, path, sharded_strategy=synchronous_save_strategy())
    publish(root, iteration, layout.rank, after_write)
    return path


def _read_common(path: str) -> dict:
    """The checkpoint's non-sharded part (``common.pt``), or CheckpointError saying what is wrong."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # megatron-core raises its own, json's, torch's and OS errors here
        raise CheckpointError(
            f"cannot read the torch_dist checkpoint {path}: {_first_line(exc)}. Its metadata.json or "
            "common.pt is missing or corrupt: point latest_checkpointed_iteration.txt at a complete "
            "checkpoint, or load another directory"
        ) from exc
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}/common.pt holds a {type(common).__name__}, not a state dict")
    return common


def _first_line(exc: BaseException) -> str:
    """``exc``'s message on one line, cut at 300 characters; for DCP's per-rank error, the first
    rank's failure."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, its stack summary)
        exc = first[0] if isinstance(first, tuple) else first
    text = " ".join(str(exc).split())
    return (text or type(exc).__name__)[:300]


def _check_model_shape(saved_args, args, path: str) -> None:
    """Compare the model's shape flags with the saving job's, where the checkpoint says them."""
    names = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size")
    diff = [
        f"{name.replace('_', '-')} saved={getattr(saved_args, name)} now={getattr(args, name)}"
        for name in names
        if getattr(saved_args, name, None) is not None
        and getattr(args, name, None) is not None
        and getattr(saved_args, name) != getattr(args, name)
    ]
    if diff:
        raise CheckpointError(
            f"the torch_dist checkpoint {path} is of another model ({', '.join(diff)}): resume with the "
            "model flags of the job that saved it, or start a new --save directory"
        )


def saved_sharding(state) -> str | None:
    """The distributed optimizer's layout recorded in a checkpoint's optimizer state (the first found:
    a chained optimizer records it once per member, all alike), or None for a plain optimizer's."""
    if isinstance(state, dict):
        if isinstance(state.get(SHARDING_KEY), str):
            return state[SHARDING_KEY]
        children = list(state.values())
    elif isinstance(state, (list, tuple)):
        children = list(state)
    else:
        return None
    for child in children:
        found = saved_sharding(child)
        if found:
            return found
    return None


def _check_optimizer_layout(common: dict, saved_args, args, path: str) -> str | None:
    """The layout to read the optimizer state of ``path`` in (None for a plain optimizer), or
    CheckpointError when this job cannot read it: the other kind of optimizer, or a distributed
    optimizer's bucket-space state under another TP or PP layout."""
    sharding = saved_sharding(common.get("optimizer"))
    if bool(sharding) != bool(args.use_distributed_optimizer):
        saved, now = ("the distributed optimizer", "a plain one")
        if not sharding:
            saved, now = "a plain optimizer", "the distributed one"
        raise CheckpointError(
            f"the torch_dist checkpoint {path} holds the state of {saved}, and this job runs {now}: "
            "resume with the optimizer flags of the job that saved it (--use-distributed-optimizer), or "
            "with --no-load-optim to start the optimizer fresh"
        )
    if sharding == DISTOPT_SHARDING and saved_args is not None:
        names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
        diff = [
            f"{name.replace('_', '-')} saved={getattr(saved_args, name, None)} now={getattr(args, name, None)}"
            for name in names
            if getattr(saved_args, name, None) != getattr(args, name, None)
        ]
        if diff:
            raise CheckpointError(
                f"the distributed optimizer's state in {path} is laid out by gradient bucket "
                f"({DISTOPT_SHARDING}, as Megatron-LM writes it), which loads at another data-parallel size "
                f"but not under another model-parallel layout ({', '.join(diff)}): resume at the saving "
                "layout, or with --no-load-optim to start the optimizer fresh"
            )
    return sharding


def load(root: str, iteration: int, model, optimizer, scheduler, args, layout) -> tuple[int, int]:
    """Load the ``torch_dist`` checkpoint of ``iteration`` under ``root`` into this rank's model
    (any TP/PP layout), optimizer, scheduler and RNG; returns ``(iteration, consumed_samples)``.

    A checkpoint without optimizer state (one of weights only) leaves the optimizer fresh; one
    without ``iteration`` starts at iteration 0. Every mismatch of the model with the checkpoint
    (a missing tensor, another shape) raises CheckpointError: nothing trains from scratch silently.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint import CheckpointException

    require_planning_backend()
    path = iteration_dir(root, iteration)
    common = _read_common(path)
    saved_args = common.get("args")
    if saved_args is not None:
        _check_model_shape(saved_args, args, path)
    load_optim = not args.no_load_optim and "optimizer" in common
    if not args.no_load_optim and "optimizer" not in common and layout.rank == 0:
        logger.warning("%s holds no optimizer state: the optimizer starts fresh", path)
    shape, _ = rng_sharding(layout)
    load_rng = not args.no_load_rng and common.get("rng_sharding") == list(shape)
    if not args.no_load_rng and not load_rng and layout.rank == 0:
        logger.warning("%s was saved by another layout (or holds no RNG state): RNG states are not loaded", path)
    sharding = None
    if load_optim:
        sharding = _check_optimizer_layout(common, saved_args, args, path)
        if sharding:
            # megatron-core builds the distributed optimizer's loading dict from its current state, which
            # a fresh optimizer lacks; the values are placeholders the load overwrites.
            fill_initial_adam_state(optimizer)
    state = sharded_training_state(
        model,
        optimizer,
        with_optim=load_optim,
        rng=load_rng,
        layout=layout,
        is_loading=True,
        sharding=sharding,
    )
    try:
        # RAISE_UNEXPECTED: a tensor this model needs and the checkpoint lacks is an error, while
        # what the checkpoint has beyond it (e.g. optimizer state under --no-load-optim) is not.
        loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
        for key, chunk in zip(model_keys(len(model)), model, strict=True):
            core_module(chunk).load_state_dict(loaded[key], strict=True)
        if load_optim:
            restore_zero_step(loaded["optimizer"])
            # In fp32 the distributed optimizer's main parameters are views of the model's leaves: its
            # bucket-space load copies into them in place, which autograd refuses outside no_grad.
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            restore_distopt_steps(optimizer)
    except CheckpointError:
        raise
    # megatron-core's CheckpointingException, torch's shape and key errors, and DCP's
    # CheckpointException (a BaseException) that carries every rank's failure
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"cannot load the torch_dist checkpoint {path} into this model: {_first_line(exc)}. Resume with "
            "the model flags of the job that saved it (or --no-load-optim if only the optimizer differs)"
        ) from exc
    if scheduler is not None and common.get("opt_param_scheduler") is not None:
        load_scheduler_state(scheduler, common["opt_param_scheduler"])
    if load_rng:
        set_rng_state(loaded["rng_state"])
    resumed = int(common.get("iteration", 0))
    consumed = int(getattr(saved_args, "consumed_train_samples", 0) or 0) if "iteration" in common else 0
    return resumed, consumed
