"""Tags over a pair that has none: every message is framed by a header and demultiplexed on arrival.

Why: one link carries every group containing both of its ends, and each group tags its messages
(:mod:`nccl_delta.group`). Gloo matches sends and receives by tag; NCCL matches them in posting
order per direction, with no tag. Two ends that post ops of different groups in different orders
would take each other's messages on NCCL (wrong data, or a size mismatch and a hang).

Design: the tag travels in-band. :class:`FramedPair` wraps a *raw* pair whose sends and receives
match in posting order per direction (NCCL's semantics; the tests emulate them with a gloo pair
driven with a single tag) and posts every raw op with :data:`FRAME_TAG`. A send is a small header
(tag, dtype, element count) followed by the payload. A receiver posts nothing on the wire at
``irecv``: one demultiplexer thread per pair receives headers in arrival order, and puts each
payload into the oldest pending receive of its tag, or *stages* it (a buffer of its own) until a
receive of that tag is posted. So sends and receives of one tag still match in posting order, as
on a tagged pair, and ops of different tags may be posted in any order on the two ends.

The alternative, one communicator per (link, group), was rejected: groups are created after links
and a link is shared by groups that appear later, so the communicators would have to be created
lazily, inside a send or a receive. Each creation blocks until both ends arrive, and two ends that
first use two groups in opposite orders would then deadlock creating them. It would also multiply
NCCL's per-communicator memory and set-up time by the number of groups per link (up to ten).

Contract
- Callers: :class:`nccl_delta.links.Link` (as its transport handle), on any thread.
- ``isend`` posts the header and the payload (none for 0 elements) under a lock, so the frames of
  two threads never interleave. ``irecv`` returns at once. ``wait`` blocks at most its timeout.
- Frames are pulled off the raw pair only while this end has a receive pending, so an idle link
  has no op in flight (NCCL's watchdog would time out a receive left posted on an idle link), and
  a receive posted makes progress without its caller waiting, as on a tagged pair. On CUDA the
  thread reads each header on the host and synchronizes after each payload: one host round trip
  per message, the price of choosing the destination after the header arrives. A payload is
  received after what the caller's stream held when it posted the receive, as when the caller
  posts an NCCL receive itself (see ``_caller_ready``). A frame's deadline counts from when the
  demultiplexer starts waiting for it, which is at most the op timeout earlier than the caller's
  ``wait``.
- A frame that does not fit the receive it is for (element count or dtype) breaks the pair: both
  ends must post the same sizes for one tag, as with any transport.
- :meth:`FramedPair.sever` (any thread) fails every pending op on this end at once and severs
  the raw pair. On gloo that fails the peer's pending ops at once too (its socket is shut down);
  NCCL's abort does not reach the peer, whose pending ops fail at their own deadline. A
  deadline that passes in ``wait``, and any raw error, sever the pair the same way: like a gloo
  pair after an error, a framed pair is never reused.
- The demultiplexer thread exits when the pair is severed, fails or is closed; none is left
  behind. Errors are :class:`FramingError`; the link wraps them in ``CommLinkError`` naming the op.
- The link's ledgers (messages posted and received per tag) stay true: a staged frame is one the
  peer counted as sent and this end has not counted as received, so the ledgers differ and
  ``recover`` rebuilds the link instead of keeping a pair with a message in it.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from typing import Any, Protocol

import torch

FRAME_TAG = 0
"""The one tag every raw op is posted with (NCCL ignores it; a gloo raw pair then has NCCL's FIFO)."""

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
"""Header dtype codes: the index in this tuple (append only: both ends must agree)."""
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_HEADER_LEN = 3  # tag, dtype code, element count


class FramingError(RuntimeError):
    """A framed op failed; the pair is broken (the link names the peer and the op)."""


class RawPair(Protocol):
    """A pair whose sends and receives match in posting order per direction (NCCL channels, or a gloo
    pair used with one tag). Optional: ``peer_closed``, ``wait_sends``, ``severable``."""

    def isend(self, tensor: torch.Tensor, tag: int) -> Any: ...

    def irecv(self, tensor: torch.Tensor, tag: int) -> Any: ...

    def wait(self, work: Any, timeout: datetime.timedelta) -> None: ...

    def sever(self) -> None: ...

    def close(self) -> None: ...


def encode_header(tensor: torch.Tensor, tag: int) -> torch.Tensor:
    """The header that announces ``tensor`` under ``tag``, on the tensor's device."""
    code = _CODES.get(tensor.dtype)
    if code is None:
        raise FramingError(f"dtype {tensor.dtype} cannot be framed: add it to nccl_delta.framing._DTYPES")
    return torch.tensor([tag, code, tensor.numel()], dtype=torch.int64).to(tensor.device)


def decode_header(header: torch.Tensor) -> tuple[int, torch.dtype, int]:
    """(tag, dtype, element count) of a received header; reads it on the host."""
    tag, code, numel = (int(v) for v in header.tolist())
    if not 0 <= code < len(_DTYPES) or numel < 0:
        raise FramingError(f"malformed frame header {[tag, code, numel]}: the stream lost its framing")
    return tag, _DTYPES[code], numel


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)


def _settle(tensor: torch.Tensor) -> None:
    """Make a received tensor complete as seen from the host: another thread reads it next."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


# CUDA ordering. A receive is posted on the demultiplexer thread, not the caller's, so the NCCL
# stream no longer follows the caller's stream by itself (ProcessGroupNCCL orders an op after the
# *posting* thread's current stream). Instead:
# - the demultiplexer runs on a stream of its own, never the default stream: the caller's default
#   stream may be waiting for one of our sends, which waits for the peer's demultiplexer, which
#   may wait for ours; sharing a stream would close that circle;
# - ``irecv`` records an event on the caller's stream, and the payload is received only after it
#   (the ring reuses its scratch segments: a reduction may still be reading the previous data);
# - a staged buffer copied on the caller's stream is recorded on it, for the caching allocator.
def _caller_ready(tensor: torch.Tensor) -> torch.cuda.Event | None:
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stub leaves __init__ untyped
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _after(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Order what this thread does next on ``device`` after ``event`` (recorded by the caller)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def _copy_staged(dst: torch.Tensor, buf: torch.Tensor) -> None:
    dst.view(-1).copy_(buf.view(-1))
    if buf.is_cuda:
        buf.record_stream(torch.cuda.current_stream(buf.device))


class FramedSend:
    """A posted frame: the raw works of its header and payload, and the header kept alive until sent."""

    __slots__ = ("works", "header")

    def __init__(self, works: list[Any], header: torch.Tensor):
        self.works = works
        self.header = header


class FramedRecv:
    """A receive posted on a framed pair; completed by the demultiplexer thread or from staging."""

    __slots__ = ("tensor", "tag", "done", "error", "ready")

    def __init__(self, tensor: torch.Tensor, tag: int):
        self.tensor = tensor
        self.tag = tag
        self.done = threading.Event()
        self.error: str | None = None
        self.ready = _caller_ready(tensor)
        """CUDA: recorded on the caller's stream when the receive was posted (see ``_caller_ready``)."""

    def finish(self, error: str | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


def _misfit(tensor: torch.Tensor, tag: int, dtype: torch.dtype, numel: int) -> str | None:
    if tensor.dtype == dtype and tensor.numel() == numel:
        return None
    return (
        f"a frame of tag {tag} carries {numel} x {dtype} but the receive posted for it holds "
        f"{tensor.numel()} x {tensor.dtype}: both ends must post the same sizes, in the same order, per tag"
    )


class FramedPair:
    """A tagged transport handle over a raw pair without tags (see the module docstring)."""

    def __init__(self, raw: RawPair, *, device: torch.device, timeout: datetime.timedelta):
        self.raw = raw
        self.device = device
        self._timeout = timeout
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pending: dict[int, deque[FramedRecv]] = {}
        self._waiting = 0
        """Receives posted and not yet completed (the demultiplexer runs while this is above 0)."""
        self._staged: dict[int, deque[torch.Tensor]] = {}
        self._receiving: FramedRecv | None = None
        """The receive whose payload the demultiplexer is receiving now (taken off ``_pending``)."""
        self._error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def severable(self) -> bool:
        return bool(getattr(self.raw, "severable", True))

    def staged(self) -> int:
        """Frames received ahead of their receive, waiting to be claimed."""
        with self._cond:
            return sum(len(q) for q in self._staged.values())

    # --- sending ---------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, tag: int) -> FramedSend:
        header = encode_header(tensor, tag)
        with self._send_lock:
            if self._error is not None:
                raise FramingError(self._error)
            try:
                works = [self.raw.isend(header, FRAME_TAG)]
                if tensor.numel():
                    works.append(self.raw.isend(tensor, FRAME_TAG))
            except BaseException as exc:
                self._break(f"posting a frame failed: {_first_line(exc)}")
                raise
        return FramedSend(works, header)

    def wait_sends(self, sends: list[FramedSend], timeout: datetime.timedelta) -> None:
        """Wait for several sends as one (the raw pair's ``wait_sends`` where it has one)."""
        self._check_open()
        works = [w for s in sends for w in s.works]
        batch = getattr(self.raw, "wait_sends", None)
        if batch is None:
            self._wait_raw_works(works, timeout)
            return
        try:
            batch(works, timeout)
        except BaseException as exc:
            self._break(f"sending a frame failed: {_first_line(exc)}")
            raise

    def _wait_raw_works(self, works: list[Any], timeout: datetime.timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            for work in works:
                # Never 0: c10d reads a zero timeout as "no timeout".
                left = max(0.001, deadline - time.monotonic())
                self.raw.wait(work, datetime.timedelta(seconds=left))
        except BaseException as exc:
            # A send that failed may have left part of a frame on the wire: the stream lost its framing.
            self._break(f"sending a frame failed: {_first_line(exc)}")
            raise

    # --- receiving -------------------------------------------------------------
    def irecv(self, tensor: torch.Tensor, tag: int) -> FramedRecv:
        recv = FramedRecv(tensor, tag)
        with self._cond:
            if self._error is not None:
                raise FramingError(self._error)
            staged = self._staged.get(tag)
            if not staged:
                self._pending.setdefault(tag, deque()).append(recv)
                self._waiting += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._demux, name="nccl_delta_demux", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return recv
            buf = staged.popleft()
        misfit = _misfit(tensor, tag, buf.dtype, buf.numel())
        if misfit is not None:
            self._break(misfit)
            raise FramingError(misfit)
        _copy_staged(tensor, buf)
        recv.finish()
        return recv

    def _demux(self) -> None:
        """The demultiplexer thread: frames off the raw pair, in arrival order, while receives are pending."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Never the default stream (see above). torch's stub leaves Stream.__new__ untyped.
            torch.cuda.set_stream(torch.cuda.Stream(self.device))  # type: ignore[no-untyped-call]
        try:
            while True:
                with self._cond:
                    self._receiving = None
                    while self._waiting == 0 and self._error is None:
                        self._cond.wait()
                    if self._error is not None:
                        return
                header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                self.raw.wait(self.raw.irecv(header, FRAME_TAG), self._timeout)
                tag, dtype, numel = decode_header(header)
                with self._cond:
                    if self._error is not None:
                        return
                    queue = self._pending.get(tag)
                    target = self._receiving = queue.popleft() if queue else None
                if target is not None:
                    misfit = _misfit(target.tensor, tag, dtype, numel)
                    if misfit is not None:
                        raise FramingError(misfit)
                    buf = target.tensor
                else:
                    buf = torch.empty(numel, dtype=dtype, device=self.device)
                if numel:
                    _after(target.ready if target is not None else None, self.device)
                    self.raw.wait(self.raw.irecv(buf, FRAME_TAG), self._timeout)
                    _settle(buf)
                with self._cond:
                    if self._error is not None:
                        return
                    late = None
                    if target is None:
                        # A receive of this tag may have been posted while the payload was on its way:
                        # it takes this frame, or it would wait for the next one and the order would slip.
                        queue = self._pending.get(tag)
                        late = self._receiving = queue.popleft() if queue else None
                        if late is None:
                            self._staged.setdefault(tag, deque()).append(buf)
                    if target is not None or late is not None:
                        self._waiting -= 1
                if late is not None:
                    misfit = _misfit(late.tensor, tag, dtype, numel)
                    if misfit is not None:
                        raise FramingError(misfit)
                    _after(late.ready, self.device)
                    _copy_staged(late.tensor, buf)
                    _settle(late.tensor)
                    target = late
                if target is not None:
                    target.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to every pending receive
            self._break(f"receiving a frame failed: {_first_line(exc)}")

    # --- waiting ---------------------------------------------------------------
    def wait(self, work: FramedSend | FramedRecv, timeout: datetime.timedelta) -> None:
        if isinstance(work, FramedSend):
            self._check_open()
            self._wait_raw_works(work.works, timeout)
            return
        if not work.done.wait(timeout.total_seconds()):
            why = f"timed out after {timeout.total_seconds():g}s waiting for a frame of tag {work.tag}"
            self._break(why)
            work.finish(why)
        if work.error is not None:
            raise FramingError(work.error)

    def _check_open(self) -> None:
        with self._cond:
            if self._error is not None:
                raise FramingError(self._error)

    # --- failure and teardown --------------------------------------------------
    def _fail_all(self, reason: str) -> bool:
        """Fail every pending receive and refuse new ops; False if the pair had already failed."""
        with self._cond:
            first = self._error is None
            if first:
                self._error = reason
            for queue in self._pending.values():
                for recv in queue:
                    recv.finish(reason)
            if self._receiving is not None:
                self._receiving.finish(reason)
            self._pending.clear()
            self._staged.clear()
            self._waiting = 0
            self._cond.notify_all()
            return first

    def _break(self, reason: str) -> None:
        """Fail this end now and sever the raw pair, so the peer fails too and our thread is released."""
        self._fail_all(reason)
        self.raw.sever()

    def sever(self) -> None:
        """Fail pending ops on both ends now (any thread); the pair is never used again."""
        self._break("the link was severed")

    def peer_closed(self) -> bool | None:
        """The raw pair's answer (see ``GlooPair.peer_closed``); None where it cannot tell."""
        probe = getattr(self.raw, "peer_closed", None)
        return None if probe is None else bool(probe())

    def close(self) -> None:
        """Retire the pair: the demultiplexer exits (a receive still pending fails) and the raw pair closes."""
        self._fail_all("the link was closed")
        thread = self._thread
        if thread is not None:
            thread.join(0.5)  # an idle demultiplexer wakes up and returns at once
            if thread.is_alive():
                # It is blocked in a raw receive that nothing will match now: release it.
                self.raw.sever()
                thread.join(5.0)
        self.raw.close()
