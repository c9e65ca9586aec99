"""The ``nccl_delta`` torch.distributed backend: a Python ProcessGroup over delta groups.

Contract
- :func:`register` (idempotent) registers the backend with
  ``Backend.register_backend(..., extended_api=True)`` for CPU, and CUDA when
  available. After it, ``init_process_group(backend="nccl_delta", store=...)``
  makes WORLD ours, and every group megatron creates inherits it
  (``parallel_state.create_group`` passes ``backend=None``).
- Every group but WORLD is a :class:`~nccl_delta.native_group.NativeGroup`: each op is one call of
  its native communicator (gloo on CPU, NCCL on GPU) and returns that call's work, asynchronous, so
  megatron's overlap of the gradient reduction and the parameter gather works as on plain torch.
- WORLD is a ring over links (:mod:`nccl_delta.group`): its collectives run inline and return
  completed work (start-up object exchanges and checkpoint barriers only); its point-to-point ops
  (megatron's second direction of a 2-stage pipeline) go to the pair communicator of the two ranks.
  A replacement therefore never rebuilds a communicator of the whole job.
- Group ranks in torch's options are the group's own; the member list (logical ranks) never
  changes: a swap only changes which process serves a rank, so every cached handle keeps working.
- Errors surface as :class:`CommLinkError` (naming the group, the op and a suspected peer where
  known) from the call or from the work's ``wait()``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch
import torch.distributed as dist

from . import waiter
from . import world as world_mod
from .config import DeltaConfig
from .group import DeltaGroup
from .native_group import NativeGroup
from .native_ops import DoneWork, NativeOps, as_list

if TYPE_CHECKING:
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
        _DistributedBackendOptions,
    )
    from torch.distributed.distributed_c10d import GroupName

logger = logging.getLogger(__name__)

BACKEND_NAME = "nccl_delta"

NCCL_ENV = {
    # An aborted or failed NCCL op cleans its communicator up and raises, instead of tearing the
    # process down: abandon() aborts the groups of a failed rank on every live member.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # torch's heartbeat monitor kills a process whose watchdog waits on a communicator; hangs are
    # found by TrainMover's agents and leases instead (docs/nccl_delta.md).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""Set by :func:`register` on a machine with CUDA, unless already set."""

_Tensors: TypeAlias = "torch.Tensor | list[torch.Tensor]"
"""One tensor or a list of them (torch passes a list; :func:`_as_list` takes either)."""

_config: DeltaConfig | None = None
_join_epoch: int | None = None


class NamedGroup:
    """Mixin for a Python process group: the group-name calls functional collectives need.
    The class sets ``self._group_name`` in its constructor."""

    _group_name: str

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    @property
    def group_name(self) -> GroupName:
        # GroupName is a NewType of str (torch's base property is typed with it); not imported at run time,
        # as older torch versions lack it.
        return cast("GroupName", self._group_name)

    def _get_backend(self, device: torch.device) -> Any:
        # A Python group is its own backend. torch >= 2.14's batch_isend_irecv asks every ProcessGroup
        # subclass for its backend's supports_coalescing (2.13 asked only torch's own class), and the C++
        # lookup raises for a group constructed in Python; without the attribute the separate
        # isend/irecv path is taken, as on torch 2.13.
        return self


class DeltaProcessGroup(NamedGroup, dist.ProcessGroup):
    """What torch and megatron hold as a group handle; all work is done by its :class:`DeltaGroup`."""

    def __init__(self, group: DeltaGroup | NativeGroup):
        super().__init__(group.index, group.size)  # type: ignore[call-arg]  # stub lacks the (rank, size) binding
        self.delta = group
        self.native = NativeOps(group) if isinstance(group, NativeGroup) else None
        """Every group but WORLD: its ops go to the group's native communicator, one call each."""
        self._group_name = group.name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"DeltaProcessGroup({self.delta!r})"

    # --- collectives ---------------------------------------------------------------
    # Every group but WORLD hands each op to its native communicator (``self.native``), one backend call,
    # and returns that call's work: asynchronous. WORLD's collectives (object exchanges at start-up,
    # checkpoint barriers: never on the training hot path) run inline on its ring of links, so that a
    # replacement never rebuilds a communicator of the whole job; its point-to-point ops go to the pair
    # communicator of the two ranks.
    # The ignore[override]s: torch's stub gives these methods the C++ ProcessGroup's convenience overloads too
    # (a tensor, an op, a timeout); c10d calls a Python backend with (tensors, opts) only.
    def allreduce(self, tensors: _Tensors, opts: AllreduceOptions | None = None) -> dist.Work:  # type: ignore[override]
        if self.native is not None:
            return self.native.allreduce(tensors, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in as_list(tensors):
            self._ring.allreduce(t, op)
        return DoneWork(as_list(tensors))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> dist.Work:
        if self.native is not None:
            return self.native.allreduce_coalesced(tensors, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            self._ring.allreduce(t, op)
        return DoneWork(list(tensors))

    def allgather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        if self.native is not None:
            return self.native.allgather(output_lists, input_tensors, opts)
        for outs, inp in zip(output_lists, input_tensors, strict=False):
            flat = torch.empty(inp.numel() * self.delta.size, dtype=inp.dtype, device=inp.device)
            self._ring.allgather_into(flat, inp.contiguous())
            for k, out in enumerate(outs):
                out.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view_as(out))
        return DoneWork([t for outs in output_lists for t in outs])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        if self.native is not None:
            return self.native.allgather_coalesced(output_lists, input_tensors, opts)
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        if self.native is not None:
            return self.native.allgather_base(output, input, opts)
        self._ring.allgather_into(output, input.contiguous())
        return DoneWork([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> dist.Work:
        if self.native is not None:
            return self.native.allgather_into_tensor_coalesced(outputs, inputs, opts)
        for out, inp in zip(outputs, inputs, strict=False):
            self._ring.allgather_into(out, inp.contiguous())
        return DoneWork(list(outputs))

    # c10d calls these aliases positionally; only their parameter names differ from the stub's.
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> dist.Work:
        if self.native is not None:
            return self.native.reduce_scatter_base(output, input, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._ring.reduce_scatter(output, input, op)
        return DoneWork([output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # names differ, as above

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None
    ) -> dist.Work:
        if self.native is not None:
            return self.native.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, inp in zip(outputs, inputs, strict=False):
            self._ring.reduce_scatter(out, inp, op)
        return DoneWork(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # names, as above

    def reduce_scatter(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        if self.native is not None:
            return self.native.reduce_scatter(outputs, input_lists, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, inputs in zip(outputs, input_lists, strict=False):
            packed = torch.cat([t.reshape(-1) for t in inputs])
            self._ring.reduce_scatter(out, packed, op)
        return DoneWork(list(outputs))

    def broadcast(self, tensors: _Tensors, opts: BroadcastOptions | None = None) -> dist.Work:  # type: ignore[override]
        if self.native is not None:
            return self.native.broadcast(tensors, opts)
        root = opts.rootRank if opts is not None else 0
        for t in as_list(tensors):
            self._ring.broadcast(t, root)
        return DoneWork(as_list(tensors))

    def reduce(self, tensors: _Tensors, opts: ReduceOptions | None = None) -> dist.Work:  # type: ignore[override]
        if self.native is not None:
            return self.native.reduce(tensors, opts)
        # WORLD: an all-reduce gives the root the right value.
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in as_list(tensors):
            self._ring.allreduce(t, op)
        return DoneWork(as_list(tensors))

    def gather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions | None = None,
    ) -> dist.Work:
        if self.native is not None:
            return self.native.gather(output_lists, input_tensors, opts)
        root = opts.rootRank if opts is not None else 0
        for inp in input_tensors:
            flat = torch.empty(inp.numel() * self.delta.size, dtype=inp.dtype, device=inp.device)
            self._ring.allgather_into(flat, inp.contiguous())
            if self.delta.index == root:
                for k, out in enumerate(output_lists[0]):
                    out.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view_as(out))
        return DoneWork()

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:  # type: ignore[override]
        if self.native is not None:
            return self.native.barrier(opts)
        self._ring.barrier()
        return DoneWork()

    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> dist.Work:
        """WORLD: the root's k-th input lands in member k's output: a broadcast of the root's packed inputs,
        each member keeping its slice (rare and small: torch.distributed.checkpoint's planning,
        scatter_object_list)."""
        if self.native is not None:
            return self.native.scatter(output_tensors, input_lists, opts)
        root = opts.rootRank if opts is not None else 0
        for n, out in enumerate(output_tensors):
            flat = torch.empty(out.numel() * self.delta.size, dtype=out.dtype, device=out.device)
            if self.delta.index == root:
                flat.copy_(torch.cat([t.reshape(-1) for t in input_lists[n]]))
            self._ring.broadcast(flat, root)
            k = self.delta.index
            out.copy_(flat[k * out.numel() : (k + 1) * out.numel()].view_as(out))
        return DoneWork(list(output_tensors))

    def alltoall_base(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist.Work:
        if self.native is None:
            raise NotImplementedError("all-to-all over WORLD is not supported by nccl_delta: use a group")
        return self.native.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: AllToAllOptions | None = None
    ) -> dist.Work:
        if self.native is None:
            raise NotImplementedError("all-to-all over WORLD is not supported by nccl_delta: use a group")
        return self.native.alltoall(output_tensors, input_tensors, opts)

    # --- point to point ----------------------------------------------------------------
    def send(self, tensors: _Tensors, dstRank: int, tag: int = 0) -> dist.Work:
        if self.native is not None:
            return self.native.send(tensors, dstRank, tag)
        return self.delta.world.pair(self.delta.members[dstRank]).send(tensors, tag)

    def recv(self, tensors: _Tensors, srcRank: int, tag: int = 0) -> dist.Work:
        if self.native is not None:
            return self.native.recv(tensors, srcRank, tag)
        return self.delta.world.pair(self.delta.members[srcRank]).recv(tensors, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        if self.native is not None:
            return self.native.recv_anysource(tensors, tag)
        raise NotImplementedError("nccl_delta has no receive-from-any-source over WORLD: name the source rank")

    @property
    def _ring(self) -> DeltaGroup:
        return cast(DeltaGroup, self.delta)

    # --- lifecycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        world = self.delta.world
        if self.delta.name in world.groups:
            world.remove_group(self.delta.name)
        if self.delta.name == _world_group_name(world):
            world.close()
            world_mod._install_world(None)

    def abort(self) -> None:
        self.shutdown()


def _world_group_name(world: world_mod.DeltaWorld) -> str | None:
    return world.world_group_name


def _create(dist_opts: _DistributedBackendOptions, backend_opts: object = None) -> DeltaProcessGroup:
    """torch calls this for every group on the nccl_delta backend, on members only."""
    members = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    name = str(dist_opts.group_id)
    world = world_mod._WORLD
    if world is None:
        # The first group is WORLD (init_process_group); it defines this process's logical rank.
        if len(members) != dist_opts.group_size:
            raise RuntimeError("nccl_delta: the first group created must be the default group")
        # Deadlines come from DeltaConfig, not torch's group timeout (30 min by default):
        # a dead link must surface in seconds.
        config = _config or DeltaConfig.from_env()
        world = world_mod.DeltaWorld(
            rank=dist_opts.group_rank,
            world_size=dist_opts.group_size,
            store=dist_opts.store,
            config=config,
            join_epoch=_join_epoch,
        )
        world.world_group_name = name
        world_mod._install_world(world)
        # The thread that creates WORLD is the one that trains: start its send waiter now, not inside
        # the first iteration (a thread start is milliseconds on loaded cores; a joiner's first
        # iteration after a promotion is on the critical path).
        waiter.prestart()
    rank = world.rank
    if members[dist_opts.group_rank] != rank:
        raise RuntimeError(
            f"nccl_delta: group {name!r} puts group rank {dist_opts.group_rank} at logical rank "
            f"{members[dist_opts.group_rank]}, but this process serves rank {rank}"
        )
    return DeltaProcessGroup(world.add_group(name=name, members=members, store=dist_opts.store))


def register(config: DeltaConfig | None = None) -> None:
    """Register the backend (idempotent); ``config`` applies to the next world created in this process."""
    global _config
    if config is not None:
        _config = config
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    if torch.cuda.is_available():
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)


def expect_join(epoch: int) -> None:
    """Mark this process as a joiner for ``epoch``: the world it creates next builds no links until
    ``current_world().join(epoch)``."""
    global _join_epoch
    _join_epoch = epoch
