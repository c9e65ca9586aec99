"""DeltaWorld: the one object per process that owns every delta group and every link.

Contract
- Exactly one per process. It is created when torch creates the default
  group on the ``nccl_delta`` backend (``init_process_group``) and dropped
  when that group is destroyed. :func:`current_world` returns it.
- Groups are added by the backend creator in torch's creation order. That
  order must be the same on every process serving a rank, including a joiner,
  because a group's name (and so its rendezvous prefix) comes from it.
- The membership API (prepare / switch / abandon / recover / join) is the only
  thing that changes links after creation; see :mod:`nccl_delta.delta` for the
  protocol. Call it at an iteration boundary from the training thread, except
  ``abandon``, which may come from any thread (e.g. an etcd watch).
- Link generations: the link between logical ranks a and b is built in
  generation ``max(base, incarnation[a], incarnation[b])``, where
  ``incarnation[r]`` is the epoch at which r's current process joined and
  ``base`` is the epoch of the last ``recover``. Both ends compute the same
  number without talking, and a rebuilt link never reuses an old prefix.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from torch.distributed import Store

from .config import DeltaConfig
from .group import DeltaGroup

if TYPE_CHECKING:
    from .delta import PreparedSwap, SwitchReport

logger = logging.getLogger(__name__)

_WORLD: "DeltaWorld | None" = None
_WORLD_LOCK = threading.Lock()


class DeltaWorld:
    """All delta groups of this process, its logical rank and the membership epoch it has seen."""

    def __init__(self, *, rank: int, world_size: int, store: Store, config: DeltaConfig, join_epoch: int | None = None):
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.config = config
        self.transport = config.resolved_transport()
        self.groups: dict[str, DeltaGroup] = {}
        self.incarnation: dict[int, int] = {}
        self.base_generation = 0
        self.epoch = 0
        self.abandoned: str | None = None
        self.joining = join_epoch is not None
        if join_epoch is not None:
            self.epoch = join_epoch
            self.incarnation[rank] = join_epoch
        self.prepared: dict[int, "PreparedSwap"] = {}
        self.world_group_name: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaWorld(rank={self.rank}/{self.world_size}, epoch={self.epoch}, groups={len(self.groups)})"

    # --- groups ----------------------------------------------------------------
    def add_group(self, *, name: str, members: list[int], store: Store) -> DeltaGroup:
        """Register a group this process belongs to; builds its ring links unless this is a joiner."""
        if name in self.groups:
            raise ValueError(f"group {name!r} exists already: groups must have unique names")
        group = DeltaGroup(world=self, name=name, members=members, store=store)
        self.groups[name] = group
        if not self.joining and self.abandoned is None:
            group.connect_ring(self.transport)
        return group

    def remove_group(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            for transport_peer in list(group.links):
                old = group.install(*transport_peer, None)
                if old is not None:
                    old.close()

    def generation(self, peer: int) -> int:
        return max(self.base_generation, self.incarnation.get(self.rank, 0), self.incarnation.get(peer, 0))

    def groups_with(self, rank: int) -> list[DeltaGroup]:
        """This process's groups that also contain ``rank``, in creation order."""
        return [g for g in self.groups.values() if rank in g.members]

    def links_to(self, rank: int) -> list[tuple[DeltaGroup, str, object]]:
        """Every (group, transport, link) of this process whose peer is ``rank``."""
        out = []
        for group in self.groups.values():
            for (transport, peer), link in list(group.links.items()):
                if peer == rank:
                    out.append((group, transport, link))
        return out

    # --- membership API (see nccl_delta.delta for the protocol) ----------------
    def prepare(self, rank: int, epoch: int, *, joiner: str | None = None) -> "PreparedSwap":
        from .delta import prepare

        return prepare(self, rank, epoch, joiner=joiner)

    def switch(self, epoch: int, *, timeout_s: float | None = None) -> "SwitchReport":
        from .delta import switch

        return switch(self, epoch, timeout_s=timeout_s)

    def abandon(self, epoch: int, reason: str = "abandoned by the control plane") -> int:
        from .delta import abandon

        return abandon(self, epoch, reason)

    def recover(self, epoch: int, *, replaced_rank: int | None = None) -> None:
        from .delta import recover

        recover(self, epoch, replaced_rank=replaced_rank)

    def join(self, epoch: int) -> None:
        from .delta import join

        join(self, epoch)

    def close(self) -> None:
        """Close every link of every group (idempotent)."""
        for name in list(self.groups):
            self.remove_group(name)


def current_world() -> DeltaWorld:
    """The process's DeltaWorld; raises if ``init_process_group(backend="nccl_delta")`` has not run."""
    if _WORLD is None:
        raise RuntimeError("no nccl_delta world: call nccl_delta.register() and "
                           "torch.distributed.init_process_group(backend='nccl_delta', ...) first")
    return _WORLD


def _install_world(world: DeltaWorld | None) -> None:
    global _WORLD
    with _WORLD_LOCK:
        if _WORLD is not None and world is not None:
            raise RuntimeError("an nccl_delta world exists already in this process; destroy the default group first")
        _WORLD = world
