"""The ``nccl_delta`` torch.distributed backend: a Python ProcessGroup over delta groups.

Contract
- :func:`register` (idempotent) registers the backend with
  ``Backend.register_backend(..., extended_api=True)`` for CPU, and CUDA when
  available. After it, ``init_process_group(backend="nccl_delta", store=...)``
  makes WORLD ours, and every group megatron creates inherits it
  (``parallel_state.create_group`` passes ``backend=None``).
- Collectives run inline on the calling thread and return completed work;
  ``async_op=True`` therefore gives correct results without overlap.
  ``send``/``recv`` return pending work, because ``batch_isend_irecv`` on a
  ProcessGroup subclass issues separate isend/irecv and must not block.
- Group ranks in torch's options are translated to logical ranks through the
  group's member list, which never changes: a swap only changes which process
  a link reaches, so every cached group handle keeps working.
- Errors surface as :class:`CommLinkError` (naming peer, group and op) from the
  call for collectives, and from ``wait()`` for send/recv.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, cast

import torch
import torch.distributed as dist
from torch.futures import Future

from . import waiter
from . import world as world_mod
from .config import DeltaConfig
from .group import DeltaGroup

if TYPE_CHECKING:
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        BarrierOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
        _DistributedBackendOptions,
    )
    from torch.distributed.distributed_c10d import GroupName

    from .links import LinkWork

logger = logging.getLogger(__name__)

BACKEND_NAME = "nccl_delta"

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


class DoneWork(dist.Work):
    """Work of an op that already finished inline."""

    def __init__(self, result: list[torch.Tensor] | None = None):
        super().__init__()
        self._result = result or []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> Future[list[torch.Tensor]]:
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        return None


class LinkP2PWork(dist.Work):
    """Pending send or receive; ``wait`` raises :class:`CommLinkError` if the link fails."""

    def __init__(self, link_work: LinkWork, tensor: torch.Tensor):
        super().__init__()
        self._work = link_work
        self._tensor = tensor

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._work.wait()
        return True

    def is_completed(self) -> bool:
        return self._work.done

    def is_success(self) -> bool:
        return self._work.done

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return [self._tensor]

    def get_future(self) -> Future[list[torch.Tensor]]:
        self.wait()
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result([self._tensor])
        return fut

    def synchronize(self) -> None:
        return None


class DeltaProcessGroup(NamedGroup, dist.ProcessGroup):
    """What torch and megatron hold as a group handle; all work is done by its :class:`DeltaGroup`."""

    def __init__(self, group: DeltaGroup):
        super().__init__(group.index, group.size)  # type: ignore[call-arg]  # stub lacks the (rank, size) binding
        self.delta = group
        self._group_name = group.name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"DeltaProcessGroup({self.delta!r})"

    # --- collectives ---------------------------------------------------------------
    # The ignore[override]s: torch's stub gives these methods the C++ ProcessGroup's convenience overloads too
    # (a tensor, an op, a timeout); c10d calls a Python backend with (tensors, opts) only.
    def allreduce(self, tensors: _Tensors, opts: AllreduceOptions | None = None) -> DoneWork:  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in _as_list(tensors):
            self.delta.allreduce(t, op)
        return DoneWork(_as_list(tensors))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> DoneWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # One ring pass per dtype over a packed buffer: fewer hops than one ring per tensor.
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for group in by_dtype.values():
            if len(group) == 1:
                self.delta.allreduce(group[0], op)
                continue
            packed = torch.cat([t.reshape(-1) for t in group])
            self.delta.allreduce(packed, op)
            offset = 0
            for t in group:
                t.copy_(packed[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return DoneWork(list(tensors))

    def allgather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> DoneWork:
        for outs, inp in zip(output_lists, input_tensors, strict=False):
            flat = torch.empty(inp.numel() * self.delta.size, dtype=inp.dtype, device=inp.device)
            self.delta.allgather_into(flat, inp.contiguous())
            for k, out in enumerate(outs):
                out.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view_as(out))
        return DoneWork([t for outs in output_lists for t in outs])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> DoneWork:
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> DoneWork:
        self.delta.allgather_into(output, input.contiguous())
        return DoneWork([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> DoneWork:
        for out, inp in zip(outputs, inputs, strict=False):
            self.delta.allgather_into(out, inp.contiguous())
        return DoneWork(list(outputs))

    # c10d calls these aliases positionally; only their parameter names differ from the stub's.
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> DoneWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self.delta.reduce_scatter(output, input, op)
        return DoneWork([output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # names differ, as above

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None
    ) -> DoneWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, inp in zip(outputs, inputs, strict=False):
            self.delta.reduce_scatter(out, inp, op)
        return DoneWork(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # names, as above

    def reduce_scatter(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> DoneWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, inputs in zip(outputs, input_lists, strict=False):
            packed = torch.cat([t.reshape(-1) for t in inputs])
            self.delta.reduce_scatter(out, packed, op)
        return DoneWork(list(outputs))

    def broadcast(self, tensors: _Tensors, opts: BroadcastOptions | None = None) -> DoneWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        for t in _as_list(tensors):
            self.delta.broadcast(t, root)
        return DoneWork(_as_list(tensors))

    def reduce(self, tensors: _Tensors, opts: ReduceOptions | None = None) -> DoneWork:  # type: ignore[override]
        # Rarely used (megatron never calls it): an all-reduce gives the root the right value.
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in _as_list(tensors):
            self.delta.allreduce(t, op)
        return DoneWork(_as_list(tensors))

    def gather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions | None = None,
    ) -> DoneWork:
        root = opts.rootRank if opts is not None else 0
        for inp in input_tensors:
            flat = torch.empty(inp.numel() * self.delta.size, dtype=inp.dtype, device=inp.device)
            self.delta.allgather_into(flat, inp.contiguous())
            if self.delta.index == root:
                for k, out in enumerate(output_lists[0]):
                    out.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view_as(out))
        return DoneWork()

    def barrier(self, opts: BarrierOptions | None = None) -> DoneWork:  # type: ignore[override]
        self.delta.barrier()
        return DoneWork()

    # --- point to point ----------------------------------------------------------------
    def send(self, tensors: _Tensors, dstRank: int, tag: int = 0) -> LinkP2PWork:
        t = _as_list(tensors)[0]
        return LinkP2PWork(self.delta.isend(t, dstRank, tag), t)

    def recv(self, tensors: _Tensors, srcRank: int, tag: int = 0) -> LinkP2PWork:
        t = _as_list(tensors)[0]
        return LinkP2PWork(self.delta.irecv(t, srcRank, tag), t)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> NoReturn:
        raise NotImplementedError("nccl_delta has no receive-from-any-source: name the source rank")

    def alltoall(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("nccl_delta does not implement alltoall (megatron's dense training never calls it)")

    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> DoneWork:
        """The root's k-th input lands in member k's output: a broadcast of the root's packed inputs, each
        member keeping its slice (rare and small: torch.distributed.checkpoint's planning, scatter_object_list)."""
        root = opts.rootRank if opts is not None else 0
        for n, out in enumerate(output_tensors):
            flat = torch.empty(out.numel() * self.delta.size, dtype=out.dtype, device=out.device)
            if self.delta.index == root:
                flat.copy_(torch.cat([t.reshape(-1) for t in input_lists[n]]))
            self.delta.broadcast(flat, root)
            k = self.delta.index
            out.copy_(flat[k * out.numel() : (k + 1) * out.numel()].view_as(out))
        return DoneWork(list(output_tensors))

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


def _as_list(tensors: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


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
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)


def expect_join(epoch: int) -> None:
    """Mark this process as a joiner for ``epoch``: the world it creates next builds no links until
    ``current_world().join(epoch)``."""
    global _join_epoch
    _join_epoch = epoch
