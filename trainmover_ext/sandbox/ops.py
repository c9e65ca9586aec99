"""The ProcessGroup methods the sandbox intercepts, and what each one returns.

One table shared by the recorder (which wraps the job's real groups) and the
replay group (which answers from a recording), so the two can never disagree
on which tensors are an op's result. Method names are the ones torch 2.13's
``distributed_c10d`` calls on a group object; the legacy aliases torch still
binds (``_allgather_base`` ...) map to the same canonical op.

Every op is described by :class:`OpCall`: its canonical name, the tensors it
*returns* (filled by the op: all-reduce buffers, gather outputs, receive
buffers), the tensors it only *reads* (send buffers, gather inputs), the peer
of a point-to-point op, and the reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch method name -> canonical op name.
METHOD_TO_OP: dict[str, str] = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "all_gather_single",
    "_allgather_base": "all_gather_single",
    "all_gather_single_coalesced": "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_single",
    "_reduce_scatter_base": "reduce_scatter_single",
    "reduce_scatter_single_coalesced": "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "alltoall",
    "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
}

NO_RESULT_OPS = frozenset({"send", "barrier"})
"""Ops whose replay is skipped: they produce nothing this rank reads."""

_REDUCE_OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


@dataclass(kw_only=True)
class OpCall:
    """One intercepted call, decoded from the method's positional arguments."""

    op: str
    """Canonical op name (a value of :data:`METHOD_TO_OP`)."""
    results: list[torch.Tensor] = field(default_factory=list)
    """Tensors the op writes and the caller reads afterwards (recorded / replayed)."""
    inputs: list[torch.Tensor] = field(default_factory=list)
    """Tensors the op only reads (their shapes are still checked on replay)."""
    peer: int | None = None
    """Group rank of the other side of a send/recv."""
    reduce_op: str | None = None
    """Reduction name (``SUM``, ``MAX`` ...) for reducing ops."""


def reduce_op_name(opts: Any) -> str | None:
    """Name of the reduction carried by a torch options object, or None."""
    red = getattr(opts, "reduceOp", None)
    if red is None:
        return None
    for name in _REDUCE_OP_NAMES:
        if red == getattr(dist.ReduceOp, name):
            return name
    return str(red)


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _flat(lists: Any) -> list[torch.Tensor]:
    return [t for inner in lists for t in _as_list(inner)]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _decode_inplace(op: str, a: tuple, k: dict) -> OpCall:
    # allreduce / allreduce_coalesced / broadcast / reduce: result written into the argument
    return OpCall(op=op, results=_as_list(_arg(a, k, 0, "tensors")), reduce_op=reduce_op_name(_arg(a, k, 1, "opts")))


def _decode_gather_lists(op: str, a: tuple, k: dict) -> OpCall:
    # allgather / allgather_coalesced / gather: (output_lists, input_tensors, opts)
    return OpCall(
        op=op, results=_flat(_arg(a, k, 0, "output_tensors")), inputs=_as_list(_arg(a, k, 1, "input_tensors"))
    )


def _decode_out_in(op: str, a: tuple, k: dict) -> OpCall:
    # *_single(_coalesced) / alltoall / all_to_all_single: (output(s), input(s), ..., opts)
    opts = a[-1] if a and not isinstance(a[-1], (torch.Tensor, list, tuple)) else k.get("opts")
    return OpCall(
        op=op,
        results=_as_list(_arg(a, k, 0, "output")),
        inputs=_as_list(_arg(a, k, 1, "input")),
        reduce_op=reduce_op_name(opts),
    )


def _decode_reduce_scatter_lists(op: str, a: tuple, k: dict) -> OpCall:
    # reduce_scatter: (outputs, input_lists, opts)
    return OpCall(
        op=op,
        results=_as_list(_arg(a, k, 0, "output_tensors")),
        inputs=_flat(_arg(a, k, 1, "input_tensors")),
        reduce_op=reduce_op_name(_arg(a, k, 2, "opts")),
    )


def _decode_scatter(op: str, a: tuple, k: dict) -> OpCall:
    return OpCall(
        op=op, results=_as_list(_arg(a, k, 0, "output_tensors")), inputs=_flat(_arg(a, k, 1, "input_tensors") or [])
    )


def _decode_send(op: str, a: tuple, k: dict) -> OpCall:
    return OpCall(op=op, inputs=_as_list(_arg(a, k, 0, "tensors")), peer=int(_arg(a, k, 1, "dstRank")))


def _decode_recv(op: str, a: tuple, k: dict) -> OpCall:
    peer = _arg(a, k, 1, "srcRank") if op == "recv" else None
    return OpCall(op=op, results=_as_list(_arg(a, k, 0, "tensors")), peer=None if peer is None else int(peer))


def _decode_barrier(op: str, a: tuple, k: dict) -> OpCall:
    return OpCall(op=op)


_DECODERS: dict[str, Callable[[str, tuple, dict], OpCall]] = {
    "allreduce": _decode_inplace,
    "allreduce_coalesced": _decode_inplace,
    "broadcast": _decode_inplace,
    "reduce": _decode_inplace,
    "allgather": _decode_gather_lists,
    "allgather_coalesced": _decode_gather_lists,
    "gather": _decode_gather_lists,
    "all_gather_single": _decode_out_in,
    "all_gather_single_coalesced": _decode_out_in,
    "reduce_scatter_single": _decode_out_in,
    "reduce_scatter_single_coalesced": _decode_out_in,
    "alltoall": _decode_out_in,
    "all_to_all_single": _decode_out_in,
    "reduce_scatter": _decode_reduce_scatter_lists,
    "scatter": _decode_scatter,
    "send": _decode_send,
    "recv": _decode_recv,
    "recv_anysource": _decode_recv,
    "barrier": _decode_barrier,
}


def decode(method: str, args: tuple, kwargs: dict) -> OpCall:
    """Decode a call of ProcessGroup ``method`` into an :class:`OpCall`."""
    op = METHOD_TO_OP[method]
    return _DECODERS[op](op, args, kwargs)
