"""Ring algorithms over a group's links: all-reduce, all-gather, reduce-scatter, broadcast.

Contract
- Called inline on the caller's thread by :class:`nccl_delta.group.DeltaGroup`
  on every member of the group, with the same shapes and dtypes.
- Tensors are contiguous 1-D views; the caller flattens and copies back.
- Member ``i`` sends to ``i+1`` and receives from ``i-1`` (mod n) only, so a
  group needs two links per member and a swap touches two links per group.
- Results are deterministic and identical on every member: the summation
  order depends only on group ranks and the chunk layout, never on which
  process serves a rank. Chunk ``c`` is reduced along the ring starting at
  member ``c+1`` and ends owned by member ``c``.
- Chunks are sent in segments (``segment_bytes``, and at least two per chunk
  above ``2 * MIN_SPLIT_BYTES``); receives are posted before the data arrives,
  so the reduction of one segment overlaps the transfer of the next. The
  all-reduce's reduce-scatter receives into ``RECV_DEPTH`` scratch segments
  per thread and device, kept between ops (16 MiB at the defaults): no
  allocation, and so no page faults, per op.
- On a link error the op severs both of its ring links before raising, so the
  neighbours fail within milliseconds instead of waiting for a timeout.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.distributed as dist

from nccl_delta.errors import CommAbandoned, CommLinkError

from .links import Link, LinkWork, wait_sends

RECV_DEPTH = 4
"""Reduce-scatter receives in flight per op (scratch slots of one segment each): 2, 4 and 8 measured
alike at 64 MB on 4 ranks."""
MIN_SPLIT_BYTES = 256 << 10
"""A chunk of at least twice this is sent in two segments or more (like gloo's ring), so that the
reduction of one overlaps the transfer of the next even when the chunk is below ``segment_bytes``."""
_local = threading.local()

ReduceOpLike: TypeAlias = "dist.ReduceOp | dist.ReduceOp.RedOpType"
"""A reduction as torch hands it over: ``ReduceOp.SUM`` etc., or an options object's ``ReduceOp`` wrapping one."""


def _scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    """This thread's receive scratch on ``device``, at least ``nbytes`` (kept and reused; grows, never shrinks)."""
    cache: dict[torch.device, torch.Tensor] = _local.__dict__.setdefault("scratch", {})
    buf = cache.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = cache[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]


def reducer(op: ReduceOpLike) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """In-place ``acc = acc (op) other`` for a torch ReduceOp (AVG reduces as SUM; the caller divides)."""
    if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
        return lambda acc, other: acc.add_(other)
    if op == dist.ReduceOp.MAX:
        return lambda acc, other: torch.maximum(acc, other, out=acc)
    if op == dist.ReduceOp.MIN:
        return lambda acc, other: torch.minimum(acc, other, out=acc)
    if op == dist.ReduceOp.PRODUCT:
        return lambda acc, other: acc.mul_(other)
    if op == dist.ReduceOp.BAND:
        return lambda acc, other: acc.bitwise_and_(other)
    if op == dist.ReduceOp.BOR:
        return lambda acc, other: acc.bitwise_or_(other)
    if op == dist.ReduceOp.BXOR:
        return lambda acc, other: acc.bitwise_xor_(other)
    raise NotImplementedError(f"nccl_delta does not support reduce op {op}")


def op_name(op: ReduceOpLike) -> str:
    """``SUM`` for ``ReduceOp.SUM`` or a ``ReduceOp`` wrapping it (torch's repr is an address)."""
    return getattr(getattr(op, "op", op), "name", str(op))


def finish_avg(tensor: torch.Tensor, n: int) -> None:
    """Turn a SUM into an AVG the way NCCL does (truncating for integers)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``n`` contiguous chunks, the first ``numel % n`` one larger."""
    base, rem = divmod(numel, n)
    bounds, start = [], 0
    for c in range(n):
        end = start + base + (1 if c < rem else 0)
        bounds.append((start, end))
        start = end
    return bounds


class Ring:
    """The ring of one op: member ``index`` of ``size``, with links to its neighbours."""

    def __init__(self, *, index: int, size: int, prev: Link, next: Link, segment_bytes: int, op: str, tag: int):
        self.i = index
        self.n = size
        self.prev = prev
        self.next = next
        self.segment_bytes = segment_bytes
        self.op = op
        self.tag = tag
        """The group's collective tag: sends and receives on one tag match in posting order, which is
        program order on both ends."""
        self._sends: list[LinkWork] = []

    # --- plumbing -------------------------------------------------------
    def _max_segment(self, esize: int) -> int:
        """Elements in the largest segment :meth:`_segments` makes."""
        return max(1, self.segment_bytes // esize)

    def _segments(self, start: int, end: int, esize: int) -> list[tuple[int, int]]:
        step = self._max_segment(esize)
        if (end - start) * esize >= 2 * MIN_SPLIT_BYTES:  # at least two segments, so a chunk pipelines
            step = min(step, -(-(end - start) // 2))
        return [(s, min(s + step, end)) for s in range(start, end, step)] or []

    def _send(self, view: torch.Tensor) -> None:
        self._sends.append(self.next.isend(view, self.tag, self.op))

    def _recv(self, view: torch.Tensor) -> LinkWork:
        return self.prev.irecv(view, self.tag, self.op)

    def _drain_sends(self) -> None:
        sends, self._sends = self._sends, []
        wait_sends(sends)  # all on the link to the next member: one wait

    def run(self, body: Callable[[], None]) -> None:
        """Run ``body``; on a link error sever both ring links (so neighbours fail fast) and re-raise.

        The error names every ring link whose peer closed the connection, checked before our own
        sever: a killed rank's predecessor often sees the error first on its *other* link, as the
        cascade of severs comes round the ring faster than its own send to the dead rank fails.
        """
        links = [link for link in (self.prev, self.next) if link is not None]
        try:
            body()
            self._drain_sends()
        except CommAbandoned:
            self._sever(links)  # a quiet (idle) link stays quiet: recover() may keep it
            raise
        except CommLinkError as exc:
            down = sorted(
                {link.peer for link in links if link.probe_then_sever(f"{self.op} failed on a neighbouring link")}
            )
            if down:
                raise type(exc)(f"{exc} Ring peers whose connection closed: ranks {down}.", peers=tuple(down)) from exc
            raise
        except BaseException:
            self._sever(links)
            raise

    def _sever(self, links: list[Link]) -> None:
        for link in links:
            link.sever(f"{self.op} failed on a neighbouring link", abandoned=False)

    # --- algorithms -----------------------------------------------------
    def allgather_chunks(self, flat: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        """Every member's chunk ``bounds[i]`` (already in place) ends up in every member's ``flat``."""
        n, i, esize = self.n, self.i, flat.element_size()
        steps = []
        for s in range(n - 1):
            c = (i - s - 1) % n
            segs = self._segments(*bounds[c], esize)
            steps.append([(seg, self._recv(flat[seg[0] : seg[1]])) for seg in segs])
        for a, b in self._segments(*bounds[i], esize):
            self._send(flat[a:b])
        for s, recvs in enumerate(steps):
            for (a, b), work in recvs:
                work.wait()
                if s + 1 < n - 1:
                    self._send(flat[a:b])

    def reduce_scatter_inplace(self, flat: torch.Tensor, bounds: list[tuple[int, int]], op: ReduceOpLike) -> None:
        """After this, chunk ``bounds[i]`` of ``flat`` holds the reduction of every member's chunk ``i``.

        Segments arrive in a fixed order (step by step, each chunk's segments in turn) into a ring of
        ``RECV_DEPTH`` scratch slots of one segment each, reused from op to op: at most that many
        receives are posted at once, and a slot is posted again as soon as its segment is reduced.
        A fresh chunk-sized buffer per op costs its page faults on every call (8% at 64 MB, 4 ranks).
        """
        n, i, esize = self.n, self.i, flat.element_size()
        combine = reducer(op)
        units = [(s, a, b) for s in range(n - 1) for a, b in self._segments(*bounds[(i - s - 2) % n], esize)]
        seg = self._max_segment(esize)
        depth = min(RECV_DEPTH, len(units))
        slots = _scratch(depth * seg * esize, flat.device).view(flat.dtype)
        pending: deque[tuple[int, int, int, torch.Tensor, LinkWork]] = deque()

        def post(k: int) -> None:
            s, a, b = units[k]
            buf = slots[(k % depth) * seg : (k % depth) * seg + (b - a)]
            pending.append((s, a, b, buf, self._recv(buf)))

        for k in range(depth):  # receives first: the neighbour's data can land while we send
            post(k)
        for a, b in self._segments(*bounds[(i - 1) % n], esize):
            self._send(flat[a:b])
        done = 0
        while pending:
            s, a, b, buf, work = pending.popleft()
            work.wait()
            combine(flat[a:b], buf)
            if s + 1 < n - 1:
                self._send(flat[a:b])
            if done + depth < len(units):
                post(done + depth)  # into the slot just reduced
            done += 1

    def allreduce(self, flat: torch.Tensor, op: ReduceOpLike) -> None:
        bounds = chunk_bounds(flat.numel(), self.n)

        def body() -> None:
            self.reduce_scatter_inplace(flat, bounds, op)
            # The reduce-scatter sends read chunks the all-gather overwrites: let them finish first.
            self._drain_sends()
            self.allgather_chunks(flat, bounds)

        self.run(body)
        if op == dist.ReduceOp.AVG:
            finish_avg(flat, self.n)

    def allreduce_small(self, flat: torch.Tensor, op: ReduceOpLike) -> None:
        """Gather every member's tensor, then reduce locally in member order (n-1 hops, deterministic)."""
        numel = flat.numel()
        gathered = torch.empty(self.n * numel, dtype=flat.dtype, device=flat.device)
        gathered[self.i * numel : (self.i + 1) * numel].copy_(flat)
        bounds = [(k * numel, (k + 1) * numel) for k in range(self.n)]
        self.run(lambda: self.allgather_chunks(gathered, bounds))
        combine = reducer(op)
        acc = gathered[0:numel].clone()
        for k in range(1, self.n):
            combine(acc, gathered[k * numel : (k + 1) * numel])
        if op == dist.ReduceOp.AVG:
            finish_avg(acc, self.n)
        flat.copy_(acc)

    def allgather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        k = inp.numel()
        bounds = [(c * k, (c + 1) * k) for c in range(self.n)]
        out[self.i * k : (self.i + 1) * k].copy_(inp)
        self.run(lambda: self.allgather_chunks(out, bounds))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpLike) -> None:
        """``out`` = reduction over members of their ``inp`` chunk ``i``; ``inp`` is not modified."""
        n, i, k, esize = self.n, self.i, out.numel(), out.element_size()
        combine = reducer(op)

        def body() -> None:
            dests = [torch.empty(k, dtype=out.dtype, device=out.device) for _ in range(n - 2)] + [out]
            steps = []
            for s in range(n - 1):
                c = (i - s - 2) % n
                steps.append((c, [((a, b), self._recv(dests[s][a:b])) for a, b in self._segments(0, k, esize)]))
            for a, b in self._segments(0, k, esize):
                c = (i - 1) % n
                self._send(inp[c * k + a : c * k + b])
            for s, (c, recvs) in enumerate(steps):
                for (a, b), work in recvs:
                    work.wait()
                    combine(dests[s][a:b], inp[c * k + a : c * k + b])
                    if s + 1 < n - 1:
                        self._send(dests[s][a:b])

        self.run(body)
        if op == dist.ReduceOp.AVG:
            finish_avg(out, n)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Pipelined chain from member ``root`` along the ring."""
        n, esize = self.n, flat.element_size()
        rel = (self.i - root) % n

        def body() -> None:
            segs = self._segments(0, flat.numel(), esize)
            if rel == 0:
                for a, b in segs:
                    self._send(flat[a:b])
                return
            recvs = [((a, b), self._recv(flat[a:b])) for a, b in segs]
            for (a, b), work in recvs:
                work.wait()
                if rel < n - 1:
                    self._send(flat[a:b])

        self.run(body)
