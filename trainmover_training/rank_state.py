"""One definition of a rank's exact training state, read and restored by the runtime's state moves.

Why: a replacement (a state transfer from a replica or a leaver) and the distributed optimizer's
host-memory mirror (:mod:`trainmover_ext.migration.mirror`) both copy a rank's state and restore it
elsewhere. Both go through this module, which the training layer owns: which tensors make up the
state and in what order, the optimizer's layout, and the plain values (counters, scheduler, loss
scaler, random state, the last iteration's record).

Contract
- :func:`model_tensors`, :func:`optimizer_tensors` and :func:`shard_tensors` list tensors in an
  order both ends derive identically from the same model and optimizer; they are the live tensors
  (a copy into them restores the state), never copies.
- :func:`shard_tensors` is what only this rank holds under the distributed optimizer: the Adam
  moments and step, the fp32 main parameters of its shard (the ``float16`` ones' fp32 copies and
  the fp32 parameters' shards). The model's parameters follow from them (:func:`rebuild_params`).
- :func:`scalars` is the state of the iteration boundary at ``args.iteration`` as plain values,
  :func:`restore_scalars` applies it (a record of another rank of the same shard, or this rank's
  own older boundary).
- :func:`materialize_optimizer_state` gives a fresh optimizer (a standby's) the state entries a
  layout names, so that :func:`optimizer_tensors` lines up before a copy into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainmover_training.checkpointing import (
    _master_groups,
    _optimizers,
    grad_scaler_states,
    load_grad_scaler_states,
    load_scheduler_state,
    set_rng_state,
)

if TYPE_CHECKING:
    from trainmover_training.training import Session

__all__ = [
    "materialize_optimizer_state",
    "model_tensors",
    "optimizer_layout",
    "optimizer_tensors",
    "optimizers",
    "param_group_settings",
    "rebuild_params",
    "restore_scalars",
    "scalars",
    "shard_tensors",
]


def optimizers(session: Session) -> list[Any]:
    """The megatron optimizers of the session (a ChainedOptimizer's parts, or the one)."""
    return _optimizers(session.optimizer)


def model_tensors(session: Session) -> list[torch.Tensor]:
    """Every tensor of the model chunks' state dicts (parameters and buffers), in order."""
    out: list[torch.Tensor] = []
    for chunk in session.model:
        out += [t for t in chunk.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    return out


def _state_tensors(opt: Any) -> list[torch.Tensor]:
    state = opt.optimizer.state
    out: list[torch.Tensor] = []
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            for key in sorted(state.get(p, {})):
                if isinstance(state[p][key], torch.Tensor):
                    out.append(state[p][key])
    return out


def optimizer_tensors(session: Session) -> list[torch.Tensor]:
    """Per optimizer: its state tensors (per parameter, keys sorted), then its fp32 master copies."""
    out: list[torch.Tensor] = []
    for opt in _optimizers(session.optimizer):
        out += _state_tensors(opt)
        for group in _master_groups(opt) or []:
            out += list(group)
    return out


def shard_tensors(session: Session) -> list[torch.Tensor]:
    """What only this rank holds under the distributed optimizer (see the module docstring)."""
    out: list[torch.Tensor] = []
    for opt in _optimizers(session.optimizer):
        out += _state_tensors(opt)
        for attr in ("shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(opt, attr, None) or []:
                out += list(group)
    return out


def optimizer_layout(session: Session) -> list[list[dict[str, tuple[Any, ...]]]]:
    """Per optimizer, per parameter: the sorted state keys with shape and dtype (non-tensors by value)."""
    layout = []
    for opt in _optimizers(session.optimizer):
        state = opt.optimizer.state
        per_param = []
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                entry: dict[str, tuple[Any, ...]] = {}
                for key in sorted(state.get(p, {})):
                    v = state[p][key]
                    entry[key] = (
                        ("tensor", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("value", v)
                    )
                per_param.append(entry)
        layout.append(per_param)
    return layout


def param_group_settings(session: Session) -> list[list[dict[str, Any]]]:
    """Per optimizer, per parameter group: its settings (learning rate, weight decay, betas, ...)."""
    return [
        [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        for opt in _optimizers(session.optimizer)
    ]


def parameter_counts(session: Session) -> list[int]:
    """How many parameters each optimizer steps (a layout from elsewhere must match them)."""
    return [sum(len(g["params"]) for g in opt.optimizer.param_groups) for opt in _optimizers(session.optimizer)]


def materialize_optimizer_state(session: Session, layout: list, settings: list) -> None:
    """Create the state entries ``layout`` names (values follow by copy) and apply ``settings``."""
    for opt, per_param, groups in zip(_optimizers(session.optimizer), layout, settings, strict=False):
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        for p, entry in zip(params, per_param, strict=False):
            st = opt.optimizer.state.setdefault(p, {})
            for key, spec in entry.items():
                if spec[0] == "tensor":
                    dtype = getattr(torch, spec[2].replace("torch.", ""))
                    st[key] = torch.zeros(spec[1], dtype=dtype, device=p.device if spec[1] else "cpu")
                else:
                    st[key] = spec[1]
        for group, saved in zip(opt.optimizer.param_groups, groups, strict=False):
            group.update(saved)


def scalars(session: Session) -> dict[str, Any]:
    """The plain values of the boundary at ``args.iteration`` (see the module docstring)."""
    args = session.args
    return {
        "iteration": args.iteration,
        "consumed_train_samples": args.consumed_train_samples,
        "scheduler": session.scheduler.state_dict(),
        "grad_scaler": grad_scaler_states(session.optimizer),
        "rng": session.resume_rng(),  # the resumed iteration's start, not an advanced state
        "last_record": session.last_record,
    }


def restore_scalars(session: Session, values: dict[str, Any], source_rank: int) -> None:
    """Apply :func:`scalars` of a boundary (from ``source_rank``); the logging rank restores the
    boundary's iteration record if its file lacks it."""
    load_scheduler_state(session.scheduler, values["scheduler"])
    load_grad_scaler_states(session.optimizer, values["grad_scaler"])
    set_rng_state(values["rng"])
    session.args.iteration = values["iteration"]
    session.args.consumed_train_samples = values["consumed_train_samples"]
    record = values["last_record"]
    session.last_record = record if record and record["iteration"] == values["iteration"] else None
    session.metrics.restore(session.last_record, source_rank)


def rebuild_params(session: Session) -> None:
    """Distributed optimizer: recompute the model's parameters from every rank's main-parameter shard
    (megatron's own cast into the parameter buffer, then its all-gather over the data-parallel group).
    A collective: every rank of the data-parallel group calls it together."""
    for opt in _optimizers(session.optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in session.model:
        chunk.start_param_sync(force_sync=True)
