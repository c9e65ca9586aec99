"""nccl_delta: a delta-updatable communicator behind every torch.distributed / megatron group.

A group is a ring of point-to-point links between logical ranks (gloo pair
groups on CPU, NCCL pair communicators on GPU, chosen automatically). Replacing
the process behind logical rank r re-points only the links that touch r, in
two phases, with no global barrier and no global rebuild.

Who owns what
    :class:`DeltaWorld` (``nccl_delta.current_world()``) is the one object per
    process that owns every group (``world.groups``: name -> :class:`DeltaGroup`)
    and every link. torch/megatron hold :class:`DeltaProcessGroup` handles that
    point at those groups; the handles stay valid across swaps.

Register and init a world (every process of the job)::

    import torch.distributed as dist
    import nccl_delta
    nccl_delta.register(nccl_delta.DeltaConfig(link_host="127.0.0.1"))   # idempotent
    dist.init_process_group(backend="nccl_delta", store=store, rank=r, world_size=n)
    # any torch.distributed.Store works (TCPStore, trainmover_ext's etcd store, ...)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    # every megatron group (and WORLD, used by PP=2 p2p) is now on nccl_delta

Planned replacement of logical rank ``r`` at membership epoch ``e``

* joiner process (new)::

      nccl_delta.register(config)
      nccl_delta.expect_join(e)        # before init_process_group: build no links yet
      dist.init_process_group(backend="nccl_delta", store=store, rank=r, world_size=n)
      parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
      nccl_delta.current_world().join(e)   # blocks until its links are up

  It needs: the job's store, its logical rank r, the world size, the epoch e,
  and to create the same groups in the same order as the job (that is how its
  group memberships and group names match the stayers').

* every stayer::

      world = nccl_delta.current_world()
      world.prepare(r, e, joiner="member-id")   # phase 1, returns at once, builds in background
      ...training continues on the old links...
      report = world.switch(e)                  # phase 2, at an iteration boundary
      # report.links_touched, report.switch_s

* the leaver stops and exits.

Unexpected failure (a :class:`~nccl_delta.errors.CommLinkError`, or a lease expiry)

* every live process: ``world.abandon(e, reason, dead={r})`` (any thread; every op in
  flight raises :class:`~nccl_delta.errors.CommAbandoned` at once; idle links are
  only quiesced);
* stayers: ``world.recover(e, replaced={r})``; joiner: ``expect_join(e)``,
  init as above, then ``world.join(e)``. Idle links whose ledgers match at both
  ends are kept; every other ring link is rebuilt in generation e.

Errors (:mod:`nccl_delta.errors`): link failures raise ``CommLinkError`` naming the
peer rank, the group and the op (within ~0.2 s of a peer SIGKILL); deadlines
raise ``CommTimeout``; a failed swap raises ``SwapAborted`` and keeps the
old links.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use, so that ``nccl_delta.errors`` (which the runtime's error tree
# re-exports) loads without torch.
_EXPORTS = {
    "BACKEND_NAME": ".backend",
    "DeltaProcessGroup": ".backend",
    "expect_join": ".backend",
    "register": ".backend",
    "DeltaConfig": ".config",
    "PreparedSwap": ".delta",
    "SwitchReport": ".delta",
    "DeltaGroup": ".group",
    "DeltaWorld": ".world",
    "current_world": ".world",
}

if TYPE_CHECKING:
    from .backend import BACKEND_NAME, DeltaProcessGroup, expect_join, register
    from .config import DeltaConfig
    from .delta import PreparedSwap, SwitchReport
    from .group import DeltaGroup
    from .world import DeltaWorld, current_world


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nccl_delta' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BACKEND_NAME",
    "DeltaConfig",
    "DeltaGroup",
    "DeltaProcessGroup",
    "DeltaWorld",
    "PreparedSwap",
    "SwitchReport",
    "current_world",
    "expect_join",
    "register",
]
