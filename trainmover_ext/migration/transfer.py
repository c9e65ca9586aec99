"""Stream one rank's training state to another over a temporary 2-rank link.

Contract:
- Both ends call :func:`open_transfer_link` with the same ``name`` (the source
  as side 0, the target as side 1); the link is a standalone gloo pair group on
  the job's store, used once and dropped.
- :func:`send_state` sends a small metadata blob (iteration, consumed samples,
  scheduler, fp16's loss scaler, RNG states, the structure of the optimizer state) and then every
  tensor of the model, optimizer state and fp32 master copies, in one
  deterministic order. Tensors are sent from where they live, without a copy,
  so the source needs no extra memory (the design's staging through the idle
  gradient buffer is only needed for non-contiguous tensors, and megatron's
  parameters, optimizer state and master copies are all contiguous; a
  non-contiguous one would be sent through a temporary contiguous copy).
- :func:`recv_state` allocates nothing it does not keep: tensors land in the
  target's own parameters and in the optimizer state it must hold anyway.
- The metadata also carries the source's last iteration record (last pipeline
  stage only); a target that is the logging rank writes it to the metrics file
  when the file lacks it (its predecessor died between the step and the write).
- No code from a peer runs here: the metadata is a versioned record of
  tensors and plain values (numbers, strings, lists, dicts) read with
  ``torch.load(weights_only=True)``, never pickle; it lists the shape and dtype
  of every tensor that follows, and the target checks them against its own
  model and optimizer before it receives any: a mismatch (another model shape,
  another optimizer, another precision) is a :class:`MigrationAborted` naming
  what differs, and nothing of the target is touched.
- Every call has a deadline (the link's timeout); a failure raises
  :class:`MigrationAborted`.
"""

from __future__ import annotations

import datetime
import io
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch.distributed import ProcessGroupGloo
from torch.distributed.distributed_c10d import PrefixStore, Store, Work

from trainmover_ext.errors import MigrationAborted
from trainmover_ext.runtime import faults
from trainmover_training import rank_state

if TYPE_CHECKING:
    from trainmover_training.training import Session


class Waitable(Protocol):
    """A posted receive: ``wait()`` blocks until its tensor has landed."""

    def wait(self) -> object: ...


_S = TypeVar("_S")
"""What a channel's ``send`` returns and its ``wait_sends`` takes."""


class Channel(Protocol[_S]):
    """What :func:`send_state` and :func:`recv_state` need of a channel: :class:`PairChannel`,
    :class:`GroupChannel` or the planned hand-over's ``HandoverChannel``."""

    def send(self, tensor: torch.Tensor, tag: int) -> _S: ...

    def recv(self, tensor: torch.Tensor, tag: int) -> Waitable: ...

    def wait_sends(self, works: list[_S]) -> None: ...


class _PairGroup(Protocol):
    """The calls :class:`PairChannel` makes on its ``ProcessGroupGloo`` (c10d binds them; torch's stub omits them)."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work: ...


class PairChannel:
    """The transfer over a 2-rank gloo group of its own (:func:`open_transfer_link`): source side 0."""

    def __init__(self, pg: _PairGroup) -> None:
        self.pg = pg

    def send(self, tensor: torch.Tensor, tag: int) -> Work:
        return self.pg.send([tensor], 1, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> Work:
        return self.pg.recv([tensor], 0, tag)

    def wait_sends(self, works: list[Work]) -> None:
        for work in works:
            work.wait()


class GroupChannel:
    """The transfer over the communicator of the smallest group that holds both ends.

    After a failure that is their data-parallel group (the source is a replica of the target's rank),
    whose communicator ``recover``/``join`` has just rebuilt with the joiner in it, so the transfer sets
    nothing up; otherwise the two ranks' pair communicator, built on first use. Every message goes on
    one tag per tensor; sends and receives on a tag match in posting order."""

    def __init__(self, peer: int) -> None:
        import nccl_delta
        from nccl_delta.native_ops import NativeOps

        world = nccl_delta.current_world()
        pairs = {id(pair.group) for pair in world.pairs.values()}
        shared = [g for g in world.native_groups() if peer in g.members and id(g) not in pairs]
        self.peer = peer
        if shared:
            group = min(shared, key=lambda g: (g.size, g.name))
            ops = NativeOps(group)
            index = group.members.index(peer)
            self._send: Callable[[torch.Tensor, int], Work] = lambda t, tag: ops.send([t], index, tag)
            self._recv: Callable[[torch.Tensor, int], Work] = lambda t, tag: ops.recv([t], index, tag)
        else:
            pair = world.pair(peer)
            self._send = lambda t, tag: pair.send([t], tag)
            self._recv = lambda t, tag: pair.recv([t], tag)

    def send(self, tensor: torch.Tensor, tag: int) -> Work:
        return self._send(tensor, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> Work:
        return self._recv(tensor, tag)

    def wait_sends(self, works: list[Work]) -> None:
        for work in works:
            work.wait()


def open_transfer_link(store: Store, name: str, side: int, timeout_s: float, host: str | None = None) -> PairChannel:
    """A channel over a 2-rank gloo group named ``name`` on ``store``; side 0 sends, side 1 receives."""
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # c10d binds _Options; torch's stub omits it
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    host = host or os.environ.get("NCCL_DELTA_LINK_HOST") or "127.0.0.1"
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    opts._threads = 1
    try:
        # c10d binds send/recv on ProcessGroupGloo; torch's stub omits them, hence the ignore
        pg: _PairGroup = ProcessGroupGloo(
            PrefixStore(f"transfer/{name}/", store),
            side,
            2,  # type: ignore[assignment]
            opts,
        )
        return PairChannel(pg)
    except RuntimeError as exc:
        raise MigrationAborted(f"state-transfer link {name!r} could not be built: {exc}") from exc


def _tensor_list(session: Session) -> list[torch.Tensor]:
    """Every tensor of the training state, in an order both ends derive identically."""
    return rank_state.model_tensors(session) + rank_state.optimizer_tensors(session)


META_FORMAT = "trainmover.state_meta"
META_VERSION = 1
MAX_META_BYTES = 64 << 20
"""A metadata record larger than this is refused before anything is allocated for it."""


def encode_meta(obj: dict[str, Any]) -> bytes:
    """A metadata record (plain values and tensors) as bytes: ``torch.save``, read back weights-only."""
    buf = io.BytesIO()
    torch.save({"format": META_FORMAT, "version": META_VERSION, **obj}, buf)
    return buf.getvalue()


def check_meta_size(n: int) -> None:
    """Refuse an announced record size before anything is allocated for it."""
    if not 0 < n <= MAX_META_BYTES:
        raise MigrationAborted(
            f"the state source announced {n} bytes of metadata (at most {MAX_META_BYTES}); refusing it"
        )


def decode_meta(data: bytes) -> dict[str, Any]:
    """Read :func:`encode_meta`'s bytes; a record that is not one (or would run code) is a MigrationAborted."""
    try:
        # weights_only: tensors, numbers, strings and containers only; anything else is refused unrun.
        meta = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable record is refused the same way
        raise MigrationAborted(f"the state source's metadata is not a TrainMover state record: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise MigrationAborted("the state source's metadata is not a TrainMover state record")
    if meta.get("version") != META_VERSION:
        raise MigrationAborted(
            f"the state source speaks state-record version {meta.get('version')}, this process "
            f"{META_VERSION}: run the same TrainMover version on every process"
        )
    return meta


def send_record(channel: Channel[Any], obj: dict[str, Any]) -> None:
    _send_raw(channel, encode_meta(obj))


def recv_record(channel: Channel[Any]) -> dict[str, Any]:
    """The peer's metadata record; a record that is not one (or would run code) is a MigrationAborted."""
    size = torch.zeros(1, dtype=torch.int64)
    channel.recv(size, 0).wait()
    n = int(size.item())
    check_meta_size(n)
    buf = torch.empty(n, dtype=torch.uint8)
    channel.recv(buf, 1).wait()
    return decode_meta(buf.numpy().tobytes())


def manifest(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """``[shape, dtype]`` of every tensor, in transfer order."""
    return [[list(t.shape), str(t.dtype)] for t in tensors]


def check_manifest(theirs: list[list[Any]], ours: list[list[Any]], rank: int) -> None:
    """Raise :class:`MigrationAborted` naming what differs between the source's tensors and the target's."""
    if len(theirs) != len(ours):
        raise MigrationAborted(
            f"rank {rank}: the state source sends {len(theirs)} tensors, this process holds "
            f"{len(ours)} (a different model or optimizer); nothing was received"
        )
    diffs = [
        f"tensor {i}: {a[0]} {a[1]} sent, {b[0]} {b[1]} here"
        for i, (a, b) in enumerate(zip(theirs, ours, strict=False))
        if list(a) != list(b)
    ]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise MigrationAborted(
            f"rank {rank}: the state source's tensors differ from this process's: "
            f"{'; '.join(diffs[:3])}{more}; nothing was received"
        )


def _send_raw(channel: Channel[_S], data: bytes) -> None:
    channel.wait_sends(
        [
            channel.send(torch.tensor([len(data)], dtype=torch.int64), 0),
            channel.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), 1),
        ]
    )


def send_state(
    channel: Channel[_S],
    session: Session,
    after_meta: Callable[[], object] | None = None,
    forge: Callable[[dict[str, Any]], dict[str, Any] | bytes] | None = None,
) -> int:
    """Source side (``channel``: :class:`PairChannel` or :class:`GroupChannel`); returns the bytes sent.

    Every tensor's send is posted before any is waited for: one round of waits, not one per tensor.
    ``after_meta`` (fault drills) is called once the metadata is sent; ``forge`` (a drill of
    :mod:`trainmover_ext.runtime.faults`) turns the true record into a crafted one (raw bytes: sent
    as they are)."""
    meta = {
        **rank_state.scalars(session),
        "source_rank": session.layout.rank,
        "optimizer_layout": rank_state.optimizer_layout(session),
        "param_groups": rank_state.param_group_settings(session),
    }
    tensors = _tensor_list(session)
    meta["manifest"] = manifest(tensors)
    record = forge({"format": META_FORMAT, "version": META_VERSION, **meta}) if forge is not None else meta
    if isinstance(record, bytes):
        _send_raw(channel, record)
    else:
        send_record(channel, record)
    if after_meta is not None:
        after_meta()
    hoard = faults.extra_state_copy(tensors)  # a drill of the memory check; None otherwise
    works: list[_S]
    sent, works = 0, []
    for i, t in enumerate(tensors):
        data = t.detach().contiguous()  # a no-op (same storage) for every tensor megatron keeps
        works.append(channel.send(data, 100 + i))
        sent += data.numel() * data.element_size()
    channel.wait_sends(works)
    del hoard
    return sent


def check_optimizer_layout(theirs: list[Any], session: Session) -> None:
    """The source's optimizer state must fit this process's parameters before it is materialised."""
    ours = rank_state.parameter_counts(session)
    if [len(a) for a in theirs] != ours:
        raise MigrationAborted(
            f"rank {session.layout.rank}: the state source's optimizer holds "
            f"{[len(a) for a in theirs]} parameters per optimizer, this process "
            f"{ours}; nothing was received"
        )


def recv_state(channel: Channel[Any], session: Session) -> int:
    """Target side: overwrite model, optimizer, scheduler, RNG and counters; returns bytes received."""
    meta = recv_record(channel)
    check_optimizer_layout(meta["optimizer_layout"], session)
    # Materialise the optimizer state with the source's structure so that the
    # tensor order below matches; values are overwritten by the receives.
    rank_state.materialize_optimizer_state(session, meta["optimizer_layout"], meta["param_groups"])
    tensors = _tensor_list(session)
    check_manifest(meta["manifest"], manifest(tensors), session.layout.rank)
    received, posted = 0, []
    for i, t in enumerate(tensors):
        buf = t.detach() if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        posted.append((t, buf, channel.recv(buf, 100 + i)))
        received += buf.numel() * buf.element_size()
    for t, buf, work in posted:
        work.wait()
        if buf.data_ptr() != t.detach().data_ptr():
            t.detach().copy_(buf)
    rank_state.restore_scalars(session, meta, meta["source_rank"])
    return received
