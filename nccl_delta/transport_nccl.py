"""NCCL pair transport: one standalone 2-rank ``ProcessGroupNCCL`` per link (GPU).

Contract
- Same as :mod:`nccl_delta.transport_gloo`: both ends call
  :func:`connect_nccl_pair` with the same prefix and opposite sides; sends and
  receives are non-blocking and ``wait`` has a deadline.
- Selected automatically for CUDA tensors (``DeltaGroup.transport_for``) and
  as the eager transport when CUDA is available (``DeltaConfig.transport``).
- The communicator is created eagerly (``bound_device_id``) so that a link is
  really up when ``connect`` returns, as with gloo; otherwise NCCL would
  connect on the first send, on the critical path of a switch.
- :meth:`NcclPair.sever` calls ``ncclCommAbort`` through ``abort()``, which,
  unlike gloo's, does unblock pending ops.
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

if TYPE_CHECKING:
    from torch._C import _distributed_c10d as _c10d

    from .transport_gloo import PairGroup

ProcessGroupNCCL: type[_c10d.ProcessGroupNCCL] | None
try:  # absent from CPU-only builds
    from torch._C._distributed_c10d import ProcessGroupNCCL
except ImportError:  # pragma: no cover - depends on the torch build
    ProcessGroupNCCL = None


def nccl_available() -> bool:
    return ProcessGroupNCCL is not None and torch.cuda.is_available()


class NcclPair:
    """The transport handle of one GPU link."""

    def __init__(self, pg: PairGroup, side: int, device: torch.device):
        self.pg: PairGroup | None = pg
        self.side = side
        self.peer_side = 1 - side
        self.device = device
        self._severed = False
        self._lock = threading.Lock()

    severable = True

    def isend(self, tensor: torch.Tensor, tag: int) -> Work:
        assert self.pg is not None, "the pair was closed"
        return self.pg.send([tensor], self.peer_side, 0)

    def irecv(self, tensor: torch.Tensor, tag: int) -> Work:
        assert self.pg is not None, "the pair was closed"
        return self.pg.recv([tensor], self.peer_side, 0)

    def wait(self, work: Work, timeout: datetime.timedelta) -> None:
        # NCCL's wait() orders the current stream after the op; the ring's reduction runs on
        # that stream and the next send is ordered after it by ProcessGroupNCCL, so the host
        # need not block.
        work.wait(timeout)

    def peer_closed(self) -> bool | None:
        """Unknown for NCCL: a lost peer shows up as an op error or the watchdog's timeout."""
        return None

    def sever(self) -> None:
        with self._lock:
            if self._severed:
                return
            self._severed = True
        try:
            if self.pg is not None:  # None once closed
                self.pg.abort()
        except Exception:
            pass  # already aborted or torn down by an error

    def close(self) -> None:
        if self.pg is not None and not self._severed:
            try:
                self.pg.shutdown()
            except Exception:
                pass
        self.pg = None


def connect_nccl_pair(store: Store, prefix: str, side: int, timeout: datetime.timedelta) -> NcclPair:
    """Build the 2-rank NCCL communicator of one link on the current CUDA device."""
    if not nccl_available():
        raise CommLinkError(
            "the nccl transport needs CUDA and a torch build with NCCL; set NCCL_DELTA_TRANSPORT=gloo on CPU machines"
        )
    assert ProcessGroupNCCL is not None  # nccl_available() checked it
    device = torch.device("cuda", torch.cuda.current_device())
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    # See PairGroup: the stub's ProcessGroupNCCL lacks the send/recv/allreduce bindings.
    pg: PairGroup = ProcessGroupNCCL(PrefixStore(prefix, store), side, 2, opts)  # type: ignore[assignment]
    try:
        pg.eager_connect_single_device(device)
    except AttributeError:
        # Older builds: a 1-element exchange brings the communicator up before we return.
        probe = torch.zeros(1, device=device)
        pg.allreduce([probe]).wait()
    return NcclPair(pg, side, device)
