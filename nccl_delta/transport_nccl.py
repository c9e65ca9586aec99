"""NCCL pair transport: two standalone 2-rank ``ProcessGroupNCCL`` per link, one per direction (GPU).

Contract
- Same as :mod:`nccl_delta.transport_gloo`: both ends call
  :func:`connect_nccl_pair` with the same prefix and opposite sides; sends and
  receives are non-blocking and ``wait`` has a deadline.
- Selected automatically for CUDA tensors (``DeltaGroup.transport_for``) and
  as the eager transport when CUDA is available (``DeltaConfig.transport``).
- Groups are kept apart by :class:`nccl_delta.framing.FramedPair`: NCCL has no
  tags and matches sends and receives in posting order per direction, while a
  link carries the messages of every group containing both ends. The handle
  :func:`connect_nccl_pair` returns is a framed pair over :class:`NcclChannels`.
- One communicator per direction: ``ProcessGroupNCCL`` runs every send and
  receive to one peer on one CUDA stream, so on a single communicator a
  receive posted before a send would hold that send back until the peer's
  data arrived; if the peer did the same, both would wait forever. With one
  communicator per direction a send only ever waits for the peer's receive.
- The communicators are created eagerly, in the same order on both ends (the
  lower side's direction first), and each direction carries one message
  before ``connect`` returns, so a link is really up, and nothing is created
  lazily inside a send or a receive, where two ends could block each other.
- :meth:`NcclChannels.sever` calls ``ncclCommAbort`` (``abort()``) on both
  communicators, which fails this end's pending ops; the peer's pending ops
  fail by their own deadline or NCCL's watchdog (NCCL cannot tell the peer).
- Importable without CUDA (this module only touches NCCL when called).
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

import torch
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed import Work

from nccl_delta.errors import CommLinkError

from .framing import FramedPair

if TYPE_CHECKING:
    from torch._C import _distributed_c10d as _c10d

    from .transport_gloo import PairGroup

ProcessGroupNCCL: type[_c10d.ProcessGroupNCCL] | None
try:  # absent from CPU-only builds
    from torch._C._distributed_c10d import ProcessGroupNCCL
except ImportError:  # pragma: no cover - depends on the torch build
    ProcessGroupNCCL = None


_WATCHDOG_MARGIN = datetime.timedelta(seconds=30)


def nccl_available() -> bool:
    return ProcessGroupNCCL is not None and torch.cuda.is_available()


class NcclChannels:
    """The raw transport of one GPU link: a communicator per direction, no tags (see the module docstring).

    ``send_pg`` carries this end's sends, ``recv_pg`` the peer's; in each, rank ``s`` is side ``s``."""

    def __init__(self, send_pg: PairGroup, recv_pg: PairGroup, side: int, device: torch.device):
        self.pgs: tuple[PairGroup, PairGroup] | None = (send_pg, recv_pg)
        self.side = side
        self.peer_side = 1 - side
        self.device = device
        self._severed = False
        self._lock = threading.Lock()

    severable = True

    def isend(self, tensor: torch.Tensor, tag: int) -> Work:
        """Post a send; ``tag`` is ignored: NCCL matches in posting order (framing carries the tag)."""
        assert self.pgs is not None, "the pair was closed"
        return self.pgs[0].send([tensor], self.peer_side, 0)

    def irecv(self, tensor: torch.Tensor, tag: int) -> Work:
        assert self.pgs is not None, "the pair was closed"
        return self.pgs[1].recv([tensor], self.peer_side, 0)

    def wait(self, work: Work, timeout: datetime.timedelta) -> None:
        work.wait(timeout)

    def peer_closed(self) -> bool | None:
        """Unknown for NCCL: a lost peer shows up as an op error or the watchdog's timeout."""
        return None

    def sever(self) -> None:
        with self._lock:
            if self._severed:
                return
            self._severed = True
            pgs = self.pgs
        for pg in pgs or ():
            try:
                pg.abort()
            except Exception:
                pass  # already aborted or torn down by an error

    def close(self) -> None:
        with self._lock:
            pgs, self.pgs = self.pgs, None
            severed = self._severed
        for pg in pgs or ():
            if not severed:
                try:
                    pg.shutdown()
                except Exception:
                    pass


def connect_nccl_pair(
    store: Store, prefix: str, side: int, timeout: datetime.timedelta, op_timeout: datetime.timedelta | None = None
) -> FramedPair:
    """Build the two communicators of one link on the current CUDA device; both ends call this."""
    if not nccl_available():
        raise CommLinkError(
            "the nccl transport needs CUDA and a torch build with NCCL; set NCCL_DELTA_TRANSPORT=gloo on CPU machines"
        )
    assert ProcessGroupNCCL is not None  # nccl_available() checked it
    op_timeout = op_timeout or timeout
    device = torch.device("cuda", torch.cuda.current_device())
    # directions[d] carries side d's sends. Both ends build d=0, then d=1: each constructor and
    # eager connect waits for the peer's, so the order must be the same on both ends.
    directions: list[PairGroup] = []
    for d in (0, 1):
        opts = ProcessGroupNCCL.Options()
        # NCCL's watchdog tears down an op (by default, the process) pending longer than this: it
        # must leave the op deadline time to fire first, and sever only the link.
        opts._timeout = max(timeout, op_timeout + _WATCHDOG_MARGIN)
        opts.is_high_priority_stream = False
        # See PairGroup: the stub's ProcessGroupNCCL lacks the send/recv/allreduce bindings.
        pg: PairGroup = ProcessGroupNCCL(PrefixStore(f"{prefix}d{d}/", store), side, 2, opts)  # type: ignore[assignment]
        try:
            pg.eager_connect_single_device(device)
        except AttributeError:
            pass  # older builds: the first message below brings the communicator up
        directions.append(pg)
    # One message each way, direction 0 first on both ends: a send or receive may still create
    # the communicator NCCL uses for point-to-point, and that must happen here, in a fixed order.
    for d, pg in enumerate(directions):
        probe = torch.ones(1, device=device)
        work = pg.send([probe], 1 - side, 0) if d == side else pg.recv([probe], 1 - side, 0)
        work.wait(timeout)
    raw = NcclChannels(directions[side], directions[1 - side], side, device)
    return FramedPair(raw, device=device, timeout=op_timeout)
