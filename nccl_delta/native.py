"""One group's native communicator in one generation: torch's own ``ProcessGroupGloo`` or ``ProcessGroupNCCL``.

Contract
- :func:`build_comm` is called by every member of a group with the same ``prefix`` (the group's name
  and generation) and blocks until the communicator is up on all of them, or raises. It may run on
  any thread (the constructors release the GIL). It builds nothing but torch's own backend object
  over a :class:`PrefixStore`: every collective runs in c10d's C++ code, asynchronously.
- CPU (gloo): the group gets a gloo device of its own; its listener address is published under the
  prefix and the other members' are read back, so that :meth:`NativeComm.abort` can find and shut
  down the group's sockets, which makes any op pending on them raise at once on every end
  (gloo's ``abort()`` leaves such an op blocked; see :mod:`nccl_delta.sockets`).
- GPU (NCCL): the communicator is created eagerly on the current device and carries one small
  all-reduce before :func:`build_comm` returns (NCCL connects lazily; the warm-up makes phase 1 of
  a planned move do the connecting). :meth:`NativeComm.abort` is ``ncclCommAbort`` through torch.
- A communicator that saw an error, or was aborted, is never used again; the owner builds a new one
  under a new generation's prefix.
- :meth:`NativeComm.close` tears the backend down on the reaper thread (a gloo group joins its
  threads, which can take milliseconds), off the caller's critical path.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from . import sockets
from .config import DeltaConfig
from .links import reap

logger = logging.getLogger(__name__)

_ADDRESS_IN_ERROR = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")
"""The peer address gloo names in a pair error: ``Connection closed by peer [127.0.0.1]:47521``."""


@dataclass(kw_only=True)
class NativeComm:
    """The backend of one group on one device type, in one generation."""

    backend: Any
    """``ProcessGroupGloo`` or ``ProcessGroupNCCL`` (c10d binds their ops; torch's stub omits most)."""
    device_type: str
    """``cpu`` (gloo) or ``cuda`` (NCCL)."""
    generation: int
    """The membership epoch it was built in; part of its rendezvous prefix."""
    listener: sockets.Address | None = None
    """gloo: this process's listener of the group (None on NCCL, or when it could not be told apart)."""
    peer_listeners: dict[sockets.Address, int] = field(default_factory=dict)
    """gloo: every other member's listener -> its group rank."""
    peer_locals: dict[sockets.Address, int] = field(default_factory=dict)
    """gloo: local addresses of the sockets other members opened -> their group rank (names a peer
    whose connection to our listener closed)."""
    own_sockets: sockets.Endpoints = field(default_factory=dict)
    """gloo: the group's connections as built (fd -> (local, peer)): what :meth:`abort` shuts down.
    Recorded once, not found again by address when cutting: a peer's listener port, closed with its
    old communicator, may be reused by a newer one, whose connections must not be cut."""
    aborted: bool = False

    @property
    def severable(self) -> bool:
        """Whether :meth:`abort` can unblock a pending op (always on NCCL; on gloo once the listener is known)."""
        return self.device_type != "cpu" or self.listener is not None

    def connections(self) -> sockets.Endpoints:
        """gloo: the group's connections that still carry what they carried when built (empty on NCCL)."""
        return {fd: ends for fd, ends in self.own_sockets.items() if sockets.endpoint(fd) == ends}

    def abort(self) -> None:
        """Make every pending and later op raise now, on this end (any thread; idempotent; never waits).

        gloo: its sockets are shut down, which fails the ops pending on them at both ends; torch's
        ``abort()`` then runs on the reaper thread, since it may join gloo's threads and the caller
        may hold the world's lock (an abandon does). NCCL: torch's ``abort()`` (``ncclCommAbort``),
        which is what fails the pending ops there."""
        if self.aborted:
            return
        self.aborted = True
        backend, generation, device_type = self.backend, self.generation, self.device_type

        def torch_abort() -> None:
            try:
                backend.abort()
            except Exception as exc:  # an already broken communicator: nothing left to abort
                logger.debug("abort of a %s communicator (generation %d): %s", device_type, generation, exc)

        if device_type == "cpu":
            sockets.shut_down(self.own_sockets)  # each only while it still carries its connection
            reap(torch_abort)
        else:
            torch_abort()

    def close(self) -> None:
        """Retire the communicator (after a swap, or when its group is forgotten); off-thread."""
        reap(self.teardown)

    def teardown(self) -> None:
        """What the reaper runs: drop the backend (joins gloo's threads)."""
        if self.device_type == "cuda" and not self.aborted:
            try:
                self.backend.abort()  # never waits for a peer, unlike shutdown()
            except Exception:  # already torn down by its error
                pass
        self.backend = None

    def suspects(self, exc: BaseException) -> tuple[int, ...]:
        """The group ranks an error of this communicator names (gloo's "closed by peer [host]:port")."""
        found = []
        for host, text in _ADDRESS_IN_ERROR.findall(str(exc)):
            port = int(text)
            # gloo prints the port as it sits in the socket address, in network byte order.
            for candidate in (port, ((port & 0xFF) << 8) | (port >> 8)):
                rank = self.peer_listeners.get((host, candidate), self.peer_locals.get((host, candidate)))
                if rank is not None:
                    found.append(rank)
                    break
        return tuple(sorted(set(found)))


def build_comm(
    *,
    store: Store,
    prefix: str,
    rank: int,
    size: int,
    device_type: str,
    generation: int,
    config: DeltaConfig,
) -> NativeComm:
    """Build one group's communicator (every member calls this with the same ``prefix``)."""
    group_store = PrefixStore(prefix, store)
    if device_type == "cuda":
        return _build_nccl(group_store, rank, size, generation, config)
    return _build_gloo(group_store, rank, size, generation, config)


def _build_gloo(store: PrefixStore, rank: int, size: int, generation: int, config: DeltaConfig) -> NativeComm:
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub's Options lacks _devices/_timeout
    opts._timeout = datetime.timedelta(seconds=config.op_timeout_s)
    device, listener = sockets.new_gloo_device(config.link_host)
    opts._devices = [device]
    before = sockets.socket_inodes()
    backend = ProcessGroupGloo(store, rank, size, opts)
    comm = NativeComm(backend=backend, device_type="cpu", generation=generation, listener=listener)
    # Who listens where, and which local addresses each member's new sockets have: the group's
    # sockets for abort(), and a peer's name in an error. Noise from other groups built meanwhile on
    # other threads is harmless: an address a member lists is one of that member's own sockets.
    new = sockets.connected_endpoints(sockets.new_sockets(before))
    mine = [list(local) for local, _ in new.values()]
    store.set(f"tm/{rank}", json.dumps({"listen": list(listener) if listener else None, "locals": mine}))
    for peer in range(size):
        if peer == rank:
            continue
        info = json.loads(store.get(f"tm/{peer}").decode())
        if info["listen"] is not None:
            comm.peer_listeners[(str(info["listen"][0]), int(info["listen"][1]))] = peer
        for host, port in info["locals"]:
            comm.peer_locals[(str(host), int(port))] = peer
    if listener is not None:  # a connection to or from a listener of this group's is one of its own
        comm.own_sockets = {
            fd: ends for fd, ends in new.items() if ends[0] == listener or ends[1] in comm.peer_listeners
        }
    if not comm.severable or len(comm.peer_listeners) < size - 1 or len(comm.own_sockets) < size - 1:
        logger.warning(
            "group communicator %s: its sockets could not all be identified; an abandon falls back to the "
            "op timeout (%.0fs) for ops pending on it",
            store,
            config.op_timeout_s,
        )
    return comm


def _build_nccl(store: PrefixStore, rank: int, size: int, generation: int, config: DeltaConfig) -> NativeComm:
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=config.op_timeout_s)
    backend: Any = ProcessGroupNCCL(store, rank, size, opts)
    device = torch.device("cuda", torch.cuda.current_device())
    backend.eager_connect_single_device(device)
    warm = torch.zeros(1, device=device)
    backend.allreduce([warm]).wait()
    torch.cuda.current_stream(device).synchronize()
    return NativeComm(backend=backend, device_type="cuda", generation=generation)
