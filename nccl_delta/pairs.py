"""WORLD's point-to-point with one peer: a native pair communicator, built in the background on first use.

Why: megatron sends one direction of a 2-stage pipeline over WORLD, and WORLD has no communicator of
its own (a replacement would have to rebuild it). Those ops, and a state transfer between two ranks
that share no group, go to a 2-member :class:`~nccl_delta.native_group.NativeGroup` of the two ranks.

Contract
- The first op with a peer starts building the pair on a thread of its own and returns a pending
  work at once: building inside the op would block it, and ranks sending around a ring (0 to 1, 1
  to 2, 2 to 0) would each wait in a build for a peer that waits in another. Ops posted meanwhile are
  issued in posting order once the pair is up; later ops go straight to it.
- Both ends build in the epoch they are in (they are in a matched send and receive of that epoch).
- An abandon fails pending works with :class:`CommAbandoned`; a pair whose build ends after an
  abandon discards it. ``recover`` keeps a quiet pair whose ledgers agree and drops any other
  (:meth:`Pair.close`); the next op builds it again.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.futures import Future

from nccl_delta.errors import CommAbandoned, CommLinkError, CommTimeout

from .native_group import NativeGroup, waiting_in
from .native_ops import NativeOps, as_list

if TYPE_CHECKING:
    from .world import DeltaWorld

POLL_S = 0.02
"""How often a pending work checks for an abandon while its pair is being built."""


class Pair:
    """The pair communicator of this process and ``peer`` (see the module docstring)."""

    def __init__(self, world: DeltaWorld, peer: int):
        self.world = world
        self.peer = peer
        a, b = sorted((world.rank, peer))
        self.group = NativeGroup(world=world, name=f"pair{a}-{b}", members=[a, b], store=world.store)
        self.ops = NativeOps(self.group)
        self.peer_index = self.group.members.index(peer)
        self.generation = world.epoch
        self.error: BaseException | None = None
        self.closed = False
        self._queue: list[PendingPairWork] | None = []
        """Ops posted before the pair was up, in posting order; ``None`` once it is."""
        self._lock = threading.Lock()
        self._settled = threading.Event()
        """Set once the build ended, whether the pair is up or failed."""
        threading.Thread(target=self._build, name=f"nccl_delta_pair_{peer}", daemon=True).start()

    def _build(self) -> None:
        try:
            comm = self.group.build(self.generation)
        except BaseException as exc:  # noqa: BLE001 - handed to every pending op
            error: BaseException = CommLinkError(
                f"rank {self.world.rank}: the pair communicator with rank {self.peer} (epoch {self.generation}) "
                f"could not be built: {exc}",
                peers=(self.peer,),
            )
            comm = None
        else:
            error = CommAbandoned(f"the pair with rank {self.peer} was dropped")
        with self.world._lock:  # abandon() holds it: a pair never opens after an abandon it missed
            usable = comm is not None and not self.closed and self.world.abandoned is None
            if usable:
                assert comm is not None
                self.group.install(comm)
            elif comm is not None:
                error = CommAbandoned(f"rank {self.world.rank}: {self.world.abandoned or 'the pair was dropped'}")
        if comm is not None and not usable:
            comm.abort()
            comm.close()
        with self._lock:
            queue, self._queue = self._queue or [], None
            if not usable:
                self.error = error
            for work in queue:
                work.issue(None if usable else error)
        self._settled.set()

    def settled(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the build to end (up or failed); whether it did."""
        return self._settled.wait(timeout_s)

    def send(self, tensors: Any, tag: int) -> dist.Work:
        return self._post("send", tensors, tag)

    def recv(self, tensors: Any, tag: int) -> dist.Work:
        return self._post("recv", tensors, tag)

    def _post(self, kind: str, tensors: Any, tag: int) -> dist.Work:
        with self._lock:
            if self._queue is not None:
                work = PendingPairWork(self, kind, as_list(tensors), tag)
                self._queue.append(work)
                return work
            if self.error is not None:
                raise self.error
        return self.issue(kind, as_list(tensors), tag)

    def issue(self, kind: str, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        if kind == "send":
            return self.ops.send(tensors, self.peer_index, tag)
        return self.ops.recv(tensors, self.peer_index, tag)

    def close(self) -> None:
        """Drop the pair (any thread): a build still running discards what it builds."""
        self.closed = True
        self.group.close()


class PendingPairWork(dist.Work):
    """An op posted while its pair was being built; issued, in order, once the pair is up."""

    def __init__(self, pair: Pair, kind: str, tensors: list[torch.Tensor], tag: int):
        super().__init__()
        self._pair, self._kind, self._tensors, self._tag = pair, kind, tensors, tag
        self._issued = threading.Event()
        self._work: dist.Work | None = None
        self._error: BaseException | None = None

    def issue(self, error: BaseException | None) -> None:
        """Called by the pair's builder, under the pair's lock, in posting order."""
        if error is None:
            try:
                self._work = self._pair.issue(self._kind, self._tensors, self._tag)
            except BaseException as exc:  # noqa: BLE001 - raised by wait()
                self._error = exc
        else:
            self._error = error
        self._issued.set()

    def _await_issue(self, timeout: datetime.timedelta | None) -> dist.Work:
        world = self._pair.world
        limit = world.config.connect_timeout_s + (timeout.total_seconds() if timeout else 0.0)
        deadline = time.monotonic() + limit
        while not self._issued.wait(POLL_S):
            if world.abandoned is not None:
                raise CommAbandoned(f"{self._kind} with rank {self._pair.peer}: {world.abandoned}")
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"{self._kind} with rank {self._pair.peer}: the pair communicator was not up within {limit:.0f}s",
                    peers=(self._pair.peer,),
                )
        if self._error is not None:
            raise self._error
        assert self._work is not None
        return self._work

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        with waiting_in(self._pair.group.name, 0, self._pair.peer):
            work = self._await_issue(timeout)
        return bool(work.wait() if timeout is None else work.wait(timeout))

    def is_completed(self) -> bool:
        return self._issued.is_set() and (self._work is None or self._work.is_completed())

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> Future[list[torch.Tensor]]:
        self.wait()
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(self._tensors)
        return fut

    def synchronize(self) -> None:
        self._await_issue(None).synchronize()
