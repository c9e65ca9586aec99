"""The c10d ops of a :class:`~nccl_delta.native_group.NativeGroup`, each one call of its native backend.

Contract
- :class:`NativeOps` has a method for every op c10d calls on a Python process group, with c10d's
  arguments; :class:`~nccl_delta.backend.DeltaProcessGroup` hands each call of a native group to it.
- Every op is exactly one call of the group's backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
  and returns that call's work, asynchronous. The one exception: a coalesced reduce-scatter or
  all-gather that gloo lacks is issued as one call per tensor (megatron's buckets pass one).
- A group of one member needs no communicator: its ops are local copies, complete on return.
- Group ranks in c10d's arguments (``dstRank``, ``rootRank``) are the backend's ranks as they are;
  the ledger records point-to-point peers as logical ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
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
)

from .native_group import NativeGroup, WorkList


class DoneWork(dist.Work):
    """Work of an op that already finished inline."""

    def __init__(self, result: list[torch.Tensor] | None = None):
        super().__init__()
        self._result = result or []

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        return None


def as_list(tensors: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    if out.data_ptr() != inp.data_ptr():
        out.view(-1).copy_(inp.reshape(-1))


class NativeOps:
    """c10d's op surface over one native group (see the module docstring)."""

    def __init__(self, group: NativeGroup):
        self.group = group
        self.single = group.size == 1
        self._run = group.run  # bound once: every op goes through it

    # --- collectives -------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: AllreduceOptions | None) -> dist.Work:
        ts = as_list(tensors)
        if self.single:
            return DoneWork(ts)
        opts = opts or AllreduceOptions()
        return self._run("allreduce", ts[0].device, lambda pg: pg.allreduce(ts, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None) -> dist.Work:
        if self.single:
            return DoneWork(list(tensors))
        opts = opts or AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", tensors[0].device, lambda pg: pg.allreduce_coalesced(tensors, opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        if self.single:
            for outs, inp in zip(outputs, inputs, strict=False):
                _copy(outs[0], inp)
            return DoneWork([t for outs in outputs for t in outs])
        opts = opts or AllgatherOptions()
        return self._run("allgather", inputs[0].device, lambda pg: pg.allgather(outputs, inputs, opts))

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        if self.single:
            return self.allgather(outputs, inputs, opts)
        opts = opts or AllgatherOptions()
        return self._run(
            "allgather_coalesced", inputs[0].device, lambda pg: pg.allgather_coalesced(outputs, inputs, opts)
        )

    def allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist.Work:
        if self.single:
            _copy(output, inp)
            return DoneWork([output])
        opts = opts or AllgatherOptions()
        return self._run("all_gather_into_tensor", output.device, lambda pg: pg._allgather_base(output, inp, opts))

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._coalesced(
            "allgather_into_tensor_coalesced",
            "all_gather_into_tensor_coalesced",
            outputs,
            inputs,
            opts or AllgatherOptions(),
            self.allgather_base,
        )

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        if self.single:
            for out, ins in zip(outputs, inputs, strict=False):
                _copy(out, ins[0])
            return DoneWork(list(outputs))
        opts = opts or ReduceScatterOptions()
        return self._run("reduce_scatter", outputs[0].device, lambda pg: pg.reduce_scatter(outputs, inputs, opts))

    def reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist.Work:
        if self.single:
            _copy(output, inp)
            return DoneWork([output])
        opts = opts or ReduceScatterOptions()
        return self._run("reduce_scatter_tensor", output.device, lambda pg: pg._reduce_scatter_base(output, inp, opts))

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._coalesced(
            "reduce_scatter_tensor_coalesced",
            "reduce_scatter_tensor_coalesced",
            outputs,
            inputs,
            opts or ReduceScatterOptions(),
            self.reduce_scatter_base,
        )

    def _coalesced(
        self,
        method: str,
        op: str,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any,
        one: Callable[[torch.Tensor, torch.Tensor, Any], dist.Work],
    ) -> dist.Work:
        """A coalesced tensor op: one backend call where the backend has ``method`` (NCCL), else one
        call per tensor (gloo); one tensor is the plain op."""
        if len(outputs) == 1:
            return one(outputs[0], inputs[0], opts)
        if self.single:
            return self._local_each(outputs, inputs)
        comm = self.group.comms.get(outputs[0].device.type)
        if comm is not None and hasattr(comm.backend, method):
            return self._run(op, outputs[0].device, lambda pg: getattr(pg, method)(outputs, inputs, opts))
        works = [one(out, inp, opts) for out, inp in zip(outputs, inputs, strict=True)]
        return WorkList(works, list(outputs))

    def _local_each(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            _copy(out, inp)
        return DoneWork(list(outputs))

    def broadcast(self, tensors: Any, opts: BroadcastOptions | None) -> dist.Work:
        ts = as_list(tensors)
        if self.single:
            return DoneWork(ts)
        opts = opts or BroadcastOptions()
        return self._run("broadcast", ts[0].device, lambda pg: pg.broadcast(ts, opts))

    def reduce(self, tensors: Any, opts: ReduceOptions | None) -> dist.Work:
        ts = as_list(tensors)
        if self.single:
            return DoneWork(ts)
        opts = opts or ReduceOptions()
        return self._run("reduce", ts[0].device, lambda pg: pg.reduce(ts, opts))

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions | None
    ) -> dist.Work:
        if self.single:
            for outs, inp in zip(outputs, inputs, strict=False):
                _copy(outs[0], inp)
            return DoneWork()
        opts = opts or GatherOptions()
        return self._run("gather", inputs[0].device, lambda pg: pg.gather(outputs, inputs, opts))

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions | None
    ) -> dist.Work:
        if self.single:
            for out, ins in zip(outputs, inputs, strict=False):
                _copy(out, ins[0])
            return DoneWork(list(outputs))
        opts = opts or ScatterOptions()
        return self._run("scatter", outputs[0].device, lambda pg: pg.scatter(outputs, inputs, opts))

    def alltoall_base(
        self, output: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any
    ) -> dist.Work:
        if self.single:
            _copy(output, inp)
            return DoneWork([output])
        opts = opts or AllToAllOptions()
        return self._run(
            "all_to_all_single", output.device, lambda pg: pg.alltoall_base(output, inp, out_splits, in_splits, opts)
        )

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        if self.single:
            return self._local_each(outputs, inputs)
        opts = opts or AllToAllOptions()
        return self._run("all_to_all", outputs[0].device, lambda pg: pg.alltoall(outputs, inputs, opts))

    def barrier(self, opts: BarrierOptions | None) -> dist.Work:
        if self.single:
            return DoneWork()
        opts = opts or BarrierOptions()
        device = torch.device(self.group.world.device_type)
        return self._run("barrier", device, lambda pg: pg.barrier(opts))

    # --- point to point ----------------------------------------------------------------
    def send(self, tensors: Any, dst: int, tag: int) -> dist.Work:
        ts = as_list(tensors)
        peer = self.group.members[dst]
        return self._run(f"send(to rank {peer})", ts[0].device, lambda pg: pg.send(ts, dst, tag), send_to=peer)

    def recv(self, tensors: Any, src: int, tag: int) -> dist.Work:
        ts = as_list(tensors)
        peer = self.group.members[src]
        return self._run(f"recv(from rank {peer})", ts[0].device, lambda pg: pg.recv(ts, src, tag), recv_from=peer)

    def recv_anysource(self, tensors: Any, tag: int) -> dist.Work:
        ts = as_list(tensors)
        return self._run("recv(any source)", ts[0].device, lambda pg: pg.recv_anysource(ts, tag), any_source=True)
