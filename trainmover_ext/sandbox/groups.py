"""Naming process groups by their role in megatron's grid (tp, pp, dp, mp, embd, world ...).

Recordings carry, per call, the group *kind* and the group's global ranks, so
a replay can check that each call arrives on the same kind of group as when
it was recorded. The kinds come from megatron-core's ``parallel_state``
getters; a group megatron does not name is ``world`` (the default group) or
``other``. The same group object can serve several kinds (with PP=1 the model
parallel group has the TP ranks but is a distinct object); the first name in
:data:`KIND_GETTERS` order wins, on the recording and the replaying side alike.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# (kind, getter name, kwargs): checked in this order.
KIND_GETTERS: tuple[tuple[str, str, dict], ...] = (
    ("tp", "get_tensor_model_parallel_group", {}),
    ("pp", "get_pipeline_model_parallel_group", {}),
    ("dp", "get_data_parallel_group", {"with_context_parallel": False}),
    ("dp_cp", "get_data_parallel_group", {"with_context_parallel": True}),
    ("cp", "get_context_parallel_group", {}),
    ("mp", "get_model_parallel_group", {}),
    ("embd", "get_embedding_group", {}),
    ("pos_embd", "get_position_embedding_group", {}),
    ("tp_dp", "get_tensor_and_data_parallel_group", {}),
    ("tp_dp_cp", "get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("tp_cp", "get_tensor_and_context_parallel_group", {}),
)


def megatron_group_kinds() -> dict[int, str]:
    """``id(group) -> kind`` for every group megatron's parallel state holds (empty if not initialised)."""
    from megatron.core import parallel_state as mpu

    kinds: dict[int, str] = {}
    for kind, getter, kwargs in KIND_GETTERS:
        try:
            groups: Any = _call_getter(getattr(mpu, getter), kwargs)
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            continue  # not created in this layout (or not initialised yet)
        for group in groups if isinstance(groups, (list, tuple)) else [groups]:
            if isinstance(group, dist.ProcessGroup):
                kinds.setdefault(id(group), kind)
    if dist.is_initialized():
        kinds.setdefault(id(dist.group.WORLD), "world")
    return kinds


def _call_getter(getter, kwargs: dict):
    # Some getters take ``check_initialized`` (returning None when unset); others assert.
    try:
        return getter(check_initialized=False, **kwargs)
    except TypeError:
        return getter(**kwargs)


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def all_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of (torch's registry)."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in c10d._world.pg_map if isinstance(pg, dist.ProcessGroup)]
