"""DeltaGroup: one process group over logical ranks, whose ops run on its members' links.

Contract
- Created by :class:`nccl_delta.world.DeltaWorld` on every member, in the same
  order on every member (torch's ``new_group`` already requires this).
- Ops run inline on the calling thread, one op at a time per group; megatron
  issues every collective of a group from its main thread.
- Links belong to the world, one per peer process (and transport), and serve
  every group containing both ends. A group's messages carry tags of its own
  (:func:`tag_base` of its name): p2p tags ``base + t`` for ``t`` below
  :data:`P2P_TAG_LIMIT`, collectives ``base + P2P_TAG_LIMIT``. Sends and
  receives on one tag match in posting order, which is program order on both
  ends, so even two groups whose tags collide would still match correctly.
- The world's link table may be changed by the two-phase swap between ops;
  the group object itself (and so every handle megatron cached) stays the same
  across swaps.
- Links to ring neighbours are built when the group is created (unless they
  exist already); a link to a non-neighbour (point-to-point over a big group,
  e.g. megatron's PP=2 path over WORLD) is built on first use; both ends reach
  it because p2p calls come in matched pairs.
- Any error raises :class:`CommLinkError` naming the peer, the group and the op.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from nccl_delta.errors import CommAbandoned, CommLinkError

from .links import Link, LinkWork
from .native_group import waiting_in
from .ring import Ring, finish_avg, op_name

if TYPE_CHECKING:
    from .ring import ReduceOpLike
    from .world import DeltaWorld

# A group's point-to-point tags; its collective tag is the one right above them.
P2P_TAG_LIMIT = 1 << 10
# Tag bases: 2**19 spaces of 2**11 tags, all below 2**30 (gloo takes a signed 32-bit tag; the
# transport's own probe tag lies above them).
_TAG_SPACES = 1 << 19


def _observed(method: Callable[..., None]) -> Callable[..., None]:
    """A blocking collective of the ring: its wait is announced like a native work's (``observe_waits``)."""

    @functools.wraps(method)
    def run(self: DeltaGroup, *args: Any, **kwargs: Any) -> None:
        with waiting_in(self.name):
            method(self, *args, **kwargs)

    return run


def tag_base(name: str) -> int:
    """First tag of group ``name``'s space; the same on every process (it depends on the name only)."""
    return (zlib.crc32(name.encode()) % _TAG_SPACES) << 11


class DeltaGroup:
    """Members are logical (global) ranks in group-rank order; ``me`` is this process's logical rank."""

    def __init__(self, *, world: DeltaWorld, name: str, members: list[int], store: Store):
        if world.rank not in members:
            raise ValueError(f"rank {world.rank} is not a member of group {name!r} {members}")
        self.world = world
        self.name = name
        self.members = list(members)
        self.store = store
        self.index = self.members.index(world.rank)
        self.size = len(self.members)
        self.tag = tag_base(name)
        self.coll_tag = self.tag + P2P_TAG_LIMIT

    def __repr__(self) -> str:
        return f"DeltaGroup({self.name!r}, members={self.members}, me={self.world.rank})"

    # --- links -------------------------------------------------------------
    def ring_peers(self, rank: int | None = None) -> list[int]:
        """The ring neighbours (logical ranks) of ``rank`` (default: this process) in this group."""
        rank = self.world.rank if rank is None else rank
        if self.size == 1 or rank not in self.members:
            return []
        i = self.members.index(rank)
        peers = {self.members[(i + 1) % self.size], self.members[(i - 1) % self.size]}
        return sorted(peers)

    def connect_ring(self, transport: str) -> None:
        """Build the missing links to this process's ring neighbours (called on every member at once)."""
        self.world.connect_links(dict.fromkeys(self.ring_peers(), self.name), transport)

    def link_to(self, peer: int, transport: str, op: str) -> Link:
        """The link to ``peer``; a missing one is built now (both ends are in a matched p2p call)."""
        self._check_live(op)
        link = self.world.links.get((transport, peer))
        if link is None:
            if self.world.joining:
                raise CommLinkError(f"{op} needs a link to rank {peer} before this joiner called join(epoch)")
            link = self.world.connect_links({peer: self.name}, transport)[peer]
        return link

    def _check_live(self, op: str) -> None:
        if self.world.abandoned is not None:
            raise CommAbandoned(f"{op}: {self.world.abandoned}; call recover(epoch) first")

    # --- ops -----------------------------------------------------------------
    @staticmethod
    def transport_for(tensor: torch.Tensor) -> str:
        return "nccl" if tensor.is_cuda else "gloo"

    def _ring(self, transport: str, op: str) -> Ring:
        op = f"{op} in group {self.name!r}"
        self._check_live(op)
        if any((transport, p) not in self.world.links for p in self.ring_peers()):
            # First op on this transport (e.g. CPU metadata on a GPU world): every member is in
            # the same collective, so build both ring links at once; one by one could deadlock.
            if self.world.joining:
                raise CommLinkError(f"{op} before this joiner called join(epoch)")
            self.connect_ring(transport)
        prev = self.link_to(self.members[(self.index - 1) % self.size], transport, op)
        nxt = self.link_to(self.members[(self.index + 1) % self.size], transport, op)
        return Ring(
            index=self.index,
            size=self.size,
            prev=prev,
            next=nxt,
            segment_bytes=self.world.config.segment_bytes,
            op=op,
            tag=self.coll_tag,
        )

    @_observed
    def allreduce(self, tensor: torch.Tensor, op: ReduceOpLike) -> None:
        if self.size == 1:
            self._check_live("allreduce")
            return
        with _flat(tensor) as flat:
            ring = self._ring(self.transport_for(tensor), f"allreduce({op_name(op)})")
            if self.size == 2 and hasattr(ring.next.handle, "allreduce") and _PAIR_OPS.get(op_name(op)):
                # Two members: the pair's native all-reduce is the whole collective, and it is
                # bit-identical to the ring's (two operands: a+b == b+a; AVG divides after the SUM).
                ring.next.allreduce_pair(flat, _PAIR_OPS[op_name(op)], ring.op)
                if op_name(op) == "AVG":
                    finish_avg(flat, 2)
                return
            if flat.numel() < self.size or flat.numel() * flat.element_size() <= self.world.config.small_bytes:
                ring.allreduce_small(flat, op)
            else:
                ring.allreduce(flat, op)

    @_observed
    def allgather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``size * inp.numel()`` elements) receives every member's ``inp`` in group-rank order."""
        if out.numel() != inp.numel() * self.size:
            raise ValueError(f"all_gather output has {out.numel()} elements, expected {inp.numel()} x {self.size}")
        with _flat(out) as flat_out:
            if self.size == 1:
                flat_out.copy_(inp.reshape(-1))
                return
            flat_in = inp.reshape(-1)
            own = flat_out[self.index * flat_in.numel() : (self.index + 1) * flat_in.numel()]
            if _overlaps(flat_out, flat_in) and flat_in.data_ptr() != own.data_ptr():
                flat_in = flat_in.clone()  # in place is fine only at this rank's own slot (megatron's form)
            self._ring(self.transport_for(out), "allgather").allgather(flat_out, flat_in)

    @_observed
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpLike) -> None:
        if inp.numel() != out.numel() * self.size:
            raise ValueError(f"reduce_scatter input has {inp.numel()} elements, expected {out.numel()} x {self.size}")
        with _flat(out) as flat_out:
            flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().reshape(-1)
            if self.size == 1:
                flat_out.copy_(flat_in)
                return
            ring = self._ring(self.transport_for(out), f"reduce_scatter({op_name(op)})")
            if _overlaps(flat_out, flat_in):
                # megatron's distributed optimizer reduce-scatters in place (the output is this
                # rank's chunk of the input): the ring receives into the output before it adds
                # its own chunk, so it must not alias the input.
                result = torch.empty_like(flat_out)
                ring.reduce_scatter(result, flat_in, op)
                flat_out.copy_(result)
            else:
                ring.reduce_scatter(flat_out, flat_in, op)

    @_observed
    def broadcast(self, tensor: torch.Tensor, root_index: int) -> None:
        if self.size == 1:
            return
        with _flat(tensor) as flat:
            self._ring(self.transport_for(tensor), f"broadcast(root={root_index})").broadcast(flat, root_index)

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1), dist.ReduceOp.SUM)

    def isend(self, tensor: torch.Tensor, dst_index: int, tag: int) -> LinkWork:
        return self._p2p(tensor, dst_index, tag, send=True)

    def irecv(self, tensor: torch.Tensor, src_index: int, tag: int) -> LinkWork:
        return self._p2p(tensor, src_index, tag, send=False)

    def _p2p(self, tensor: torch.Tensor, peer_index: int, tag: int, *, send: bool) -> LinkWork:
        if not 0 <= tag < P2P_TAG_LIMIT:
            raise ValueError(f"p2p tag {tag} must be in [0, {P2P_TAG_LIMIT})")
        if not tensor.is_contiguous():
            raise ValueError("nccl_delta send/recv needs a contiguous tensor")
        peer = self.members[peer_index]
        op = f"{'send' if send else 'recv'}(tag={tag}) in group {self.name!r}"
        link = self.link_to(peer, self.transport_for(tensor), op)
        return link.isend(tensor, self.tag + tag, op) if send else link.irecv(tensor, self.tag + tag, op)


# Reductions a 2-member group hands to its pair's native all-reduce: order-independent for two
# operands, so the result is bit-identical to the ring's. AVG runs as SUM, then divides.
_PAIR_OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous 1-D tensors share any memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class _flat:
    """Context: a contiguous 1-D view of a tensor, copied back on exit when a copy was needed."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.copy = not tensor.is_contiguous()

    def __enter__(self) -> torch.Tensor:
        self.flat = (self.tensor.contiguous() if self.copy else self.tensor).view(-1)
        return self.flat

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.copy and exc_type is None:
            self.tensor.copy_(self.flat.view_as(self.tensor))
