"""The distributed optimizer's host-memory mirror: each rank's optimizer shard kept by a peer.

Why: with ``--use-distributed-optimizer`` each data-parallel rank alone holds its shard of the fp32
main parameters and the Adam moments, so a lost rank's shard existed nowhere else and every rank
rolled back to the checkpoint. Here every rank (the *ward*) copies its shard after each step into the
host memory of a data-parallel peer (its *holder*), on another node where the layout has one
(:func:`holder_offset`); a replacement takes the shard from there, with no rollback and no extra
accelerator memory.

Contract
- :meth:`Mirror.exchange` runs on the training thread after every completed step, on every rank of
  the data-parallel group at once: each rank stages its shard (:func:`rank_state.shard_tensors`) in
  the older of its own two host-memory copies (on an accelerator, the device-to-host copy) beside the
  boundary's plain values (:func:`rank_state.scalars`, the optimizer's settings), sends the shard to
  its holder as one buffer, and receives its ward's into the older of two generations. The plain
  values do not travel: a holder is a data-parallel peer of its ward's shard, whose counters,
  scheduler, loss scaler and random state are its own; it serves its own with the ward's shard. A generation
  counts (*committed*) only once all its bytes landed; its CRC-32 is taken then and checked again
  before it is served, so host memory that changed since is refused. A failure cuts the exchange
  like any collective (:class:`CommLinkError`): the generation being received stays uncommitted.
- The exchange overlaps the next iteration: it posts its sends and receives and returns; the bytes
  cross while the next forward and backward run, and :meth:`Mirror.settle` waits for them (and
  commits the ward's copy) at the start of the next exchange, so only a copy not done by then holds
  the training thread. On an accelerator the device-to-host copy itself runs on a side stream and its
  send is posted once it is done (:mod:`~trainmover_ext.migration.mirror_copy`): the training thread
  does not wait for the copy, and the next step waits on the device only if the copy still reads the
  shard. The first exchange of each membership epoch waits at once instead: it carries
  the layouts, which both ends need before a copy can be laid out. A recovery's :meth:`Mirror.report`,
  a planned move's switch and the end of training settle the exchange in flight first (a report
  offers the copy only if it completed; an exchange cut by the failure leaves it uncommitted).
- Holder and ward each keep two generations (the step just completed and the one before), so a
  recovery can resume one step back when a ward's newest copy never landed: the stayers go back to
  their own copies or their holders'. A rank whose step ran in an iteration that then failed (the
  parameter all-gather) goes back to its own. :meth:`Mirror.report` says what it holds, for the
  controller (:func:`~trainmover_ext.control.convergence.plan_mirror_convergence` decides).
- :meth:`Mirror.serve` sends a committed generation to the ward's rank (a joiner, or the ward rolling
  back); :meth:`Mirror.restore` receives it into this rank's own shard and boundary values. The model
  parameters then follow from the main parameters (:func:`rank_state.rebuild_params`, every rank).
- Bad copies: :meth:`Mirror.report` checks every committed generation's CRC before it offers it, so
  the controller plans from another copy (one step back) or the checkpoint, once per epoch, and never
  from a corrupt one. A generation of another rank or iteration, or whose manifest is not the
  target's, is refused at the copy with :class:`MirrorRefused` (a :class:`MigrationAborted`: the
  node then falls back to stop-restart).
- Host memory: four shards per rank (its ward's twice, its own twice); no accelerator memory.
"""

from __future__ import annotations

import logging
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainmover_ext.errors import MigrationAborted
from trainmover_ext.migration import transfer
from trainmover_ext.migration.mirror_copy import ShardCopier
from trainmover_ext.runtime import faults
from trainmover_training import rank_state

if TYPE_CHECKING:
    from trainmover_ext.migration.transfer import Channel
    from trainmover_training.initialize import ParallelLayout
    from trainmover_training.training import Session

logger = logging.getLogger(__name__)

TAG = 1 << 20
"""First tag of the exchange (the size, the record, then the shard as one buffer); the state transfer's
tags are below it."""
ALIGN = 64
"""Byte alignment of each tensor inside a generation's buffer."""


class MirrorRefused(MigrationAborted):
    """A mirror generation cannot be used (missing, stale, another layout, or a failed checksum)."""


def holder_offset(dp: int, stride: int, ranks_per_node: int) -> int:
    """How many data-parallel positions ahead a rank's holder is: the nearest peer on another node, or
    the next peer when every peer shares the node (a one-node job). ``stride``: how far apart in rank
    numbers two data-parallel neighbours are (:func:`dp_stride`)."""
    step = -(-ranks_per_node // stride)  # data-parallel positions per node
    return step if 0 < step < dp else 1


def dp_stride(layout: ParallelLayout) -> int:
    """Rank distance of data-parallel neighbours: TP x CP (megatron's tp-cp-dp-pp order) or TP x CP x PP
    (``--use-tp-pp-dp-mapping``)."""
    return layout.tp_size * getattr(layout, "cp_size", 1) * (layout.pp_size if layout.pp_before_dp else 1)


def holder_and_ward(layout: ParallelLayout, ranks_per_node: int) -> tuple[int, int]:
    """(the rank holding this rank's shard, the rank whose shard this rank holds); needs dp > 1."""
    stride = dp_stride(layout)
    d = holder_offset(layout.dp_size, stride, ranks_per_node)
    base = layout.rank - layout.dp_rank * stride  # the data-parallel position 0 of this shard
    return base + (layout.dp_rank + d) % layout.dp_size * stride, base + (layout.dp_rank - d) % layout.dp_size * stride


def ward_of(layout: ParallelLayout, holder: int) -> int:
    """The rank whose shard this rank holds, given the rank that holds this rank's (the same offset back)."""
    stride = dp_stride(layout)
    d = (holder - layout.rank) // stride % layout.dp_size
    base = layout.rank - layout.dp_rank * stride
    return base + (layout.dp_rank - d) % layout.dp_size * stride


@dataclass
class Generation:
    """One copy of the ward's state at the boundary ``iteration``."""

    iteration: int = -1
    record: dict[str, Any] = field(default_factory=dict)
    """The ward's boundary values, layout, settings and manifest."""
    buffer: torch.Tensor | None = None
    """Host memory of every tensor (uint8, each tensor aligned to :data:`ALIGN`)."""
    views: list[torch.Tensor] = field(default_factory=list)
    checksum: int | None = None
    """CRC-32 of ``buffer`` when committed; None while uncommitted."""

    @property
    def committed(self) -> bool:
        return self.checksum is not None

    def shape_for(self, manifest: list[list[Any]]) -> None:
        """Lay the buffer out for ``manifest`` (reallocated only when the size changes; page-locked
        where an accelerator copies into it)."""
        offsets, total = [], 0
        dtypes = [getattr(torch, str(dtype).replace("torch.", "")) for _, dtype in manifest]
        for (shape, _), dtype in zip(manifest, dtypes, strict=True):
            offsets.append(total)
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            total += -(-n // ALIGN) * ALIGN
        if self.buffer is None or self.buffer.numel() != total:
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.views = [
            self.buffer[o : o + int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()]
            .view(dt)
            .view(shape)
            for o, (shape, _), dt in zip(offsets, manifest, dtypes, strict=True)
        ]

    def crc(self) -> int:
        assert self.buffer is not None
        return zlib.crc32(self.buffer.numpy().data)


@dataclass
class InFlight:
    """One exchange posted and not yet settled: this rank's copy on its way to its holder, the ward's
    copy on its way into ``gen`` (whose ``iteration`` is the one due)."""

    gen: Generation
    header: torch.Tensor
    """Where the ward's header lands: (its iteration, the size of a layout record: 0 here)."""
    receives: list[Any]
    sends: list[Any]
    posting: Future[Any]
    """The send of this rank's copy, posted once the copy is done (:meth:`ShardCopier.then`)."""


def _slot(generations: list[Generation], iteration: int) -> Generation:
    """The generation to overwrite with ``iteration``: one already at it (a re-run), else the older."""
    for gen in generations:
        if gen.iteration == iteration:
            return gen
    return min(generations, key=lambda g: (g.committed, g.iteration))


class Mirror:
    """This rank's two sides of the mirror: ward of ``holder``, holder of ``ward`` (module docstring)."""

    def __init__(self, session: Session, holder: int, ward: int) -> None:
        self.session, self.holder, self.ward = session, holder, ward
        self.generations = [Generation(), Generation()]
        """The ward's two newest copies."""
        self.owns = [Generation(), Generation()]
        """This rank's own two last staged copies (``checksum`` 0 once staged; no CRC is taken of them): a
        rank whose holder died before its newest copy landed, or whose step ran in an iteration that then
        failed, goes back to one of them."""
        self._copies = 0
        """Copies exchanged; the second has allocated every buffer, and is when the sizes are said."""
        self._layout: dict[str, Any] | None = None
        """This rank's optimizer layout and shard manifest (computed once)."""
        self._layout_epoch: int | None = None
        """The membership epoch in which this rank last sent its holder its layout (a new epoch may have
        a new holder process: a failure's or a planned move's joiner)."""
        self._ward_layout: dict[str, Any] | None = None
        self._in_flight: InFlight | None = None
        """The exchange posted after the last step, until :meth:`settle`."""
        self.stepped_at: int | None = None
        """The iteration whose optimizer step ran on this rank's shard (set when the inner step ends)."""
        self.copier = ShardCopier()
        """The device-to-host copies and the posting of their sends."""
        for opt in rank_state.optimizers(session):
            opt.optimizer.register_step_post_hook(self._stepped)
            opt.optimizer.register_step_pre_hook(self.copier.before_step)

    def _stepped(self, *_: Any) -> None:
        self.stepped_at = self.session.args.iteration + 1

    # --- the ward's side and the holder's, every step ---------------------------------
    def shard_iteration(self) -> int:
        """The boundary this rank's own shard is at: one past ``args.iteration`` when the step of the
        iteration in progress ran on it and the iteration then failed (the parameter all-gather)."""
        done = int(self.session.args.iteration)
        return done + 1 if self.stepped_at == done + 1 else done

    def _stage(self) -> Generation:
        """Copy this rank's shard into the older of its own host-memory copies, with the boundary's plain
        values as they are (no encoding): what it sends, and what it may go back to."""
        session = self.session
        tensors = [t.detach() for t in rank_state.shard_tensors(session)]
        if self._layout is None:  # the optimizer's layout and the manifest never change in a run
            self._layout = {
                "optimizer_layout": rank_state.optimizer_layout(session),
                "manifest": transfer.manifest(tensors),
            }
        record = {
            "kind": "mirror",
            "ward": session.layout.rank,
            **rank_state.scalars(session),
            "param_groups": rank_state.param_group_settings(session),
            **self._layout,
        }
        own = _slot(self.owns, record["iteration"])
        own.checksum, own.iteration = None, -1
        own.shape_for(self._layout["manifest"])
        self.copier.copy(own.views, tensors)  # on an accelerator still under way: read it after settle()
        own.iteration, own.record, own.checksum = record["iteration"], record, 0
        return own

    def exchange(self) -> None:
        """Send this rank's shard to its holder and take its ward's (see the module docstring).

        Per step one header (the iteration, and the length of a layout record that follows only when
        the holder may lack it: the first copy, and the first of each membership epoch) and the shard as one
        buffer. The boundary's plain values do not travel: a ward's equal its holder's, a data-parallel
        peer of the same shard (:meth:`serve`). Every rank of the data-parallel group decides alike
        whether this exchange waits (the first of an epoch: every rank entered the epoch at the same
        boundary) or overlaps the next iteration."""
        import nccl_delta

        self.settle()
        own = self._stage()
        epoch = nccl_delta.current_world().epoch
        if self._layout_epoch == epoch and self._ward_layout is not None:
            self._post(own)
        else:
            self._exchange_with_layouts(own, epoch)

    def _post(self, own: Generation) -> None:
        """Post this step's exchange and return (:meth:`settle` completes it); no layout travels."""
        from trainmover_ext.migration.transfer import GroupChannel

        assert own.buffer is not None and self._ward_layout is not None
        out, inc = GroupChannel(self.holder), GroupChannel(self.ward)
        sends = [out.send(torch.tensor([own.iteration, 0], dtype=torch.int64), TAG)]
        faults.mirror_point(rank=self.session.layout.rank, iteration=own.iteration)
        buffer = own.buffer
        posting = self.copier.then(lambda: out.send(buffer, TAG + 2))
        # The ward is a data-parallel peer: its step just completed the same iteration as ours.
        gen = self._slot_for(own.iteration)
        gen.checksum, gen.iteration = None, own.iteration
        gen.record = {"kind": "mirror", "ward": self.ward, "iteration": own.iteration, **self._ward_layout}
        gen.shape_for(self._ward_layout["manifest"])
        assert gen.buffer is not None
        header = torch.zeros(2, dtype=torch.int64)
        receives = [inc.recv(header, TAG), inc.recv(gen.buffer, TAG + 2)]
        self._in_flight = InFlight(gen, header, receives, sends, posting)

    def settle(self) -> None:
        """Wait for the exchange in flight, if any, and commit the ward's copy it brought. Raises what its
        ops raise (a cut exchange: the copy stays uncommitted), or :class:`MirrorRefused` for a header
        that is not the copy expected."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        sends = [*flight.sends, self.copier.result(flight.posting)]
        for work in flight.receives:
            work.wait()
        iteration, size = (int(v) for v in flight.header.tolist())
        if iteration != flight.gen.iteration or size:
            raise MirrorRefused(
                f"rank {self.session.layout.rank}: rank {self.ward} sent its copy of iteration {iteration} "
                f"(a layout of {size} bytes with it) where iteration {flight.gen.iteration} was due with none"
            )
        for work in sends:
            work.wait()
        flight.gen.checksum = flight.gen.crc()
        self._landed()

    def _landed(self) -> None:
        self._copies += 1
        if self._copies == 2:
            own = max(self.owns, key=lambda g: g.iteration)
            print(
                f"[trainmover] rank {self.session.layout.rank}: optimizer-shard mirror holds {self.host_bytes()} "
                f"bytes of host memory (rank {self.ward}'s shard twice, and its own twice); sends "
                f"{own.buffer.numel() if own.buffer is not None else 0} bytes to rank {self.holder} per step"
                + (", copied from the device on a side stream" if self.copier.on_device else "")
                + (", posted from a helper thread" if self.copier.posts_from_helper else ""),
                flush=True,
            )

    def _exchange_with_layouts(self, own: Generation, epoch: int) -> None:
        """The exchange that waits: headers first, then the layout records where they travel, then the
        shards (the first exchange of a membership epoch)."""
        from trainmover_ext.migration.transfer import GroupChannel

        layout = (
            b"" if self._layout_epoch == epoch else transfer.encode_meta({"kind": "mirror", **(self._layout or {})})
        )
        out, inc = GroupChannel(self.holder), GroupChannel(self.ward)
        sends = [out.send(torch.tensor([own.iteration, len(layout)], dtype=torch.int64), TAG)]
        if layout:
            sends.append(out.send(torch.frombuffer(bytearray(layout), dtype=torch.uint8), TAG + 1))
        faults.mirror_point(rank=self.session.layout.rank, iteration=own.iteration)
        assert own.buffer is not None
        self.copier.wait()
        sends.append(out.send(own.buffer, TAG + 2))  # both ends lay a manifest out alike: one message
        header = torch.zeros(2, dtype=torch.int64)
        inc.recv(header, TAG).wait()
        iteration, size = (int(v) for v in header.tolist())
        if size:
            transfer.check_meta_size(size)
            blob = torch.empty(size, dtype=torch.uint8)
            inc.recv(blob, TAG + 1).wait()
            theirs = transfer.decode_meta(blob.numpy().tobytes())
            if theirs.get("kind") != "mirror" or "manifest" not in theirs:
                raise MirrorRefused(f"rank {self.session.layout.rank}: rank {self.ward} sent no mirror layout")
            self._ward_layout = {k: theirs[k] for k in ("optimizer_layout", "manifest")}
        if self._ward_layout is None:
            raise MirrorRefused(f"rank {self.session.layout.rank}: rank {self.ward}'s copy came without its layout")
        gen = self._slot_for(iteration)
        gen.checksum, gen.iteration = None, iteration
        gen.record = {"kind": "mirror", "ward": self.ward, "iteration": iteration, **self._ward_layout}
        gen.shape_for(self._ward_layout["manifest"])
        assert gen.buffer is not None
        inc.recv(gen.buffer, TAG + 2).wait()
        out.wait_sends(sends)
        self._layout_epoch = epoch
        gen.checksum = gen.crc()
        self._landed()

    def host_bytes(self) -> int:
        """Host memory the mirror holds on this rank: the ward's two generations and its own two."""
        return sum(g.buffer.numel() for g in [*self.generations, *self.owns] if g.buffer is not None)

    def _slot_for(self, iteration: int) -> Generation:
        return _slot(self.generations, iteration)

    # --- recovery ------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What the controller reads of this rank: its shard's boundary, its own staged copies, and the ward's
        copies that are committed and still pass their checksum (one that fails is dropped here, so the
        controller never plans a copy from it: the job then resumes from another copy or the checkpoint).
        The exchange in flight is settled first: a copy it did not complete is not offered."""
        try:
            self.copier.wait()  # a copy cut before its send was posted still reads the shard
            self.settle()
        except Exception as exc:  # noqa: BLE001 - cut by the failure, or refused: the copy stays uncommitted
            print(
                f"[trainmover] rank {self.session.layout.rank}: the mirror exchange in flight did not complete "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); its copy is not offered",
                flush=True,
            )
        held = []
        for gen in self.generations:
            if gen.committed:
                try:
                    held.append(self.committed(gen.iteration).iteration)
                except MirrorRefused as exc:
                    print(f"[trainmover] {exc}", flush=True)
        staged = sorted(g.iteration for g in self.owns if g.committed)
        return {
            "shard": self.shard_iteration(),
            "staged": staged,
            "mirror": {"ward": self.ward, "iterations": sorted(held)},
        }

    def committed(self, iteration: int) -> Generation:
        """The ward's committed generation of ``iteration``, its checksum verified."""
        for gen in self.generations:
            if gen.committed and gen.iteration == iteration:
                if gen.crc() != gen.checksum:
                    gen.checksum = None
                    raise MirrorRefused(
                        f"rank {self.session.layout.rank}: the mirror of rank {self.ward}'s shard at iteration "
                        f"{iteration} fails its checksum (host memory changed since it landed); not served"
                    )
                return gen
        held = sorted(g.iteration for g in self.generations if g.committed)
        raise MirrorRefused(
            f"rank {self.session.layout.rank} holds no committed mirror of rank {self.ward} at iteration "
            f"{iteration} (it holds {held or 'none'})"
        )

    def forget_after(self, iteration: int) -> None:
        """Drop generations newer than the boundary the job resumed at (they will be sent again)."""
        for gen in [*self.generations, *self.owns]:
            if gen.iteration > iteration:
                gen.checksum, gen.iteration = None, -1
        self.stepped_at = None
        flight, self._in_flight = self._in_flight, None  # settled by the report, or cut with its group
        if flight is not None:
            flight.posting.cancel()  # a send not yet posted never is (the new epoch's groups are up)
        self._layout_epoch = None  # the holder may be a joiner

    def serve(self, channel: Channel[Any], iteration: int) -> int:
        """Send the ward's generation of ``iteration`` (the receiver is the ward's rank); returns bytes sent.
        A generation that cannot be served is announced as refused, so the receiver does not wait."""
        try:
            gen = self.committed(iteration)
        except MirrorRefused as exc:
            transfer.send_record(channel, {"kind": "mirror", "refused": str(exc)})
            raise
        try:
            boundary = self._boundary(iteration)
        except MirrorRefused as exc:
            transfer.send_record(channel, {"kind": "mirror", "refused": str(exc)})
            raise
        transfer.send_record(channel, {**boundary, **gen.record, "source_rank": self.session.layout.rank})
        assert gen.buffer is not None
        channel.wait_sends([channel.send(gen.buffer, 100)])
        return gen.buffer.numel()

    def _boundary(self, iteration: int) -> dict[str, Any]:
        """This rank's plain values of boundary ``iteration`` (its ward's are the same: a data-parallel
        peer of one shard has the same counters, scheduler, loss scaler and random state): from its own
        staged copy of it, or from the session when it is at that boundary."""
        keys = ("iteration", "consumed_train_samples", "scheduler", "grad_scaler", "rng", "last_record", "param_groups")
        for own in self.owns:
            if own.committed and own.iteration == iteration:
                return {k: own.record[k] for k in keys}
        if self.session.args.iteration == iteration:
            now = {**rank_state.scalars(self.session), "param_groups": rank_state.param_group_settings(self.session)}
            return {k: now[k] for k in keys}
        raise MirrorRefused(
            f"rank {self.session.layout.rank} cannot serve rank {self.ward}'s shard of iteration {iteration}: it "
            f"holds the boundary values of iterations {sorted(g.iteration for g in self.owns if g.committed)} and "
            f"is at {self.session.args.iteration}"
        )

    def restore(self, channel: Channel[Any], iteration: int) -> int:
        """Receive this rank's shard and boundary values of ``iteration`` from its holder (:meth:`serve`)."""
        rank = self.session.layout.rank
        meta = transfer.recv_record(channel)
        if meta.get("kind") != "mirror" or "refused" in meta:
            raise MirrorRefused(f"rank {rank}: its holder sent no mirror: {meta.get('refused', 'not a mirror record')}")
        ours = self._prepare(meta, iteration)
        # Into one of this rank's own staged copies, which it keeps: it then holds the state restored.
        own = _slot(self.owns, iteration)
        own.checksum, own.iteration = None, -1
        own.shape_for(meta["manifest"])
        assert own.buffer is not None
        channel.recv(own.buffer, 100).wait()
        for t, view in zip(ours, own.views, strict=True):
            t.copy_(view)
        own.iteration, own.record, own.checksum = iteration, {k: v for k, v in meta.items() if k != "source_rank"}, 0
        rank_state.restore_scalars(self.session, meta, meta["source_rank"])
        return own.buffer.numel()

    def restore_own(self, iteration: int) -> int:
        """Go back to this rank's own staged copy of ``iteration`` (its step of the next iteration ran and
        that iteration failed, or its holder died before its newest copy landed)."""
        held = [g for g in self.owns if g.committed and g.iteration == iteration]
        if not held:
            raise MirrorRefused(
                f"rank {self.session.layout.rank}: its own staged copies are of iterations "
                f"{sorted(g.iteration for g in self.owns if g.committed)}, not {iteration}"
            )
        own = held[0]
        ours = self._prepare(own.record, iteration)
        for t, view in zip(ours, own.views, strict=True):
            t.copy_(view)
        rank_state.restore_scalars(self.session, own.record, self.session.layout.rank)
        return sum(t.numel() * t.element_size() for t in ours)

    def _prepare(self, meta: dict[str, Any], iteration: int) -> list[torch.Tensor]:
        """Check a generation's record against this rank, give the optimizer its layout and settings,
        and return the shard tensors to copy into."""
        session, rank = self.session, self.session.layout.rank
        self.copier.wait()  # no copy of the shard is still reading it
        if meta.get("ward") != rank or meta.get("iteration") != iteration:
            raise MirrorRefused(
                f"rank {rank}: the mirror offered is of rank {meta.get('ward')} at iteration "
                f"{meta.get('iteration')}, not of rank {rank} at {iteration}; nothing was received"
            )
        transfer.check_optimizer_layout(meta["optimizer_layout"], session)
        rank_state.materialize_optimizer_state(session, meta["optimizer_layout"], meta["param_groups"])
        ours = [t.detach() for t in rank_state.shard_tensors(session)]
        transfer.check_manifest(meta["manifest"], transfer.manifest(ours), rank)
        return ours
