"""DeltaWorld: the one object per process that owns every delta group and every link.

Contract
- Exactly one per process. It is created when torch creates the default
  group on the ``nccl_delta`` backend (``init_process_group``) and dropped
  when that group is destroyed. :func:`current_world` returns it.
- Groups are added by the backend creator in torch's creation order. That
  order must be the same on every process serving a rank, including a joiner,
  because a group's name (and so its rendezvous prefix) comes from it.
- The membership API (prepare / switch / abandon / recover / join) is the only
  thing that changes links after creation; see :mod:`nccl_delta.delta` for the
  protocol. Call it at an iteration boundary from the training thread, except
  ``abandon``, which may come from any thread (e.g. an etcd watch).
- Links: one per peer process and transport, in :attr:`DeltaWorld.links`,
  shared by every group containing both ends (groups tag their traffic apart,
  see :mod:`nccl_delta.group`). So a rank holds one link per distinct ring
  neighbour, whatever the number of groups, and a rebuild costs one link
  set-up per peer, all peers at once.
- Link generations: the link between logical ranks a and b is built in
  generation ``max(base, incarnation[a], incarnation[b])``, where
  ``incarnation[r]`` is the epoch at which r's current process joined and
  ``base`` is the epoch of the last ``recover``. Both ends compute the same
  number without talking, and a rebuilt link never reuses an old prefix.
- Superseded set-ups: a link set-up (``connect_links``: ``recover``, ``join``,
  phase 1, a first use) waits for its links on the calling thread with a short
  poll and gives up with :class:`CommAbandoned` as soon as ``abandon`` names an
  epoch newer than the one it began in (:meth:`DeltaWorld.superseded`). So a
  recovery restarted at a newer epoch never waits for a dead peer of an older one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from torch._C._distributed_c10d import Store

from nccl_delta.errors import CommAbandoned

from . import links as links_mod
from .config import DeltaConfig
from .group import DeltaGroup
from .links import Link, LinkId
from .native_group import NativeGroup
from .pairs import Pair

if TYPE_CHECKING:
    from .delta import PreparedSwap, RecoverReport, SwitchReport

logger = logging.getLogger(__name__)

_WORLD: DeltaWorld | None = None
_WORLD_LOCK = threading.Lock()


class DeltaWorld:
    """All delta groups of this process, its logical rank and the membership epoch it has seen."""

    def __init__(self, *, rank: int, world_size: int, store: Store, config: DeltaConfig, join_epoch: int | None = None):
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.config = config
        self.transport = config.resolved_transport()
        self.device_type = "cuda" if self.transport == "nccl" else "cpu"
        """The device of the groups' primary communicators (NCCL on ``cuda``, gloo on ``cpu``)."""
        self.groups: dict[str, DeltaGroup | NativeGroup] = {}
        """Every group of this process by name: WORLD's ring (:class:`DeltaGroup`) and the native groups."""
        self.pairs: dict[int, Pair] = {}
        """Peer -> the pair communicator WORLD's point-to-point ops with it use (built on first use)."""
        self._pairs_lock = threading.Lock()
        self.links: dict[tuple[str, int], Link] = {}
        """``(transport, peer) -> Link``: the one live link to each peer, shared by all groups."""
        self._links_lock = threading.Lock()
        self.incarnation: dict[int, int] = {}
        self.base_generation = 0
        self.epoch = 0
        self.abandoned: str | None = None
        self.newest_abandon = 0
        """The newest epoch ``abandon`` was called for (0: never); set-ups begun in older epochs give up."""
        self.joining = join_epoch is not None
        if join_epoch is not None:
            self.epoch = join_epoch
            self.incarnation[rank] = join_epoch
        self.in_finishing = False
        """Whether the training thread is inside :meth:`finishing` (see :mod:`nccl_delta.finishing`)."""
        self.deferred: dict[tuple[str, int], Link] = {}
        """Links an abandon inside :meth:`finishing` left to their op, watched until the block ends."""
        self.deferred_groups: dict[str, NativeGroup] = {}
        """Native groups an abandon inside :meth:`finishing` left to their op, watched likewise."""
        self.finish_watcher: threading.Thread | None = None
        self.prepared: dict[int, PreparedSwap] = {}
        self.world_group_name: str | None = None
        self.groups_joined_at: float | None = None
        """``time.time()`` when this joiner's groups were built (``join``), before its WORLD ring links."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaWorld(rank={self.rank}/{self.world_size}, epoch={self.epoch}, groups={len(self.groups)})"

    # --- groups ----------------------------------------------------------------
    def add_group(self, *, name: str, members: list[int], store: Store) -> DeltaGroup | NativeGroup:
        """Register a group this process belongs to and build its communicator (WORLD: its ring links),
        unless this is a joiner (``join`` builds them) or an abandon is pending (``recover`` does)."""
        if name in self.groups:
            raise ValueError(f"group {name!r} exists already: groups must have unique names")
        group: DeltaGroup | NativeGroup
        if name == self.world_group_name:
            group = DeltaGroup(world=self, name=name, members=members, store=store)
        else:
            group = NativeGroup(world=self, name=name, members=members, store=store)
        self.groups[name] = group
        if not self.joining and self.abandoned is None:
            if isinstance(group, DeltaGroup):
                group.connect_ring(self.transport)
            elif group.size > 1:
                group.install(group.build(self.epoch))
        return group

    def remove_group(self, name: str) -> None:
        """Forget a group; a native one's communicator is closed (WORLD's links stay until :meth:`close`)."""
        group = self.groups.pop(name, None)
        if isinstance(group, NativeGroup):
            group.close()

    def native_groups(self) -> list[NativeGroup]:
        """Every native group with a communicator of its own (more than one member), pairs included."""
        groups = [g for g in list(self.groups.values()) if isinstance(g, NativeGroup) and g.size > 1]
        with self._pairs_lock:
            return groups + [pair.group for pair in self.pairs.values()]

    def describe(self) -> str:
        """What this process's communicator looks like now, for a diagnosis (reads without the world's
        lock: a thread that holds it may be the one that hangs)."""
        lines = [
            f"nccl_delta rank {self.rank}: epoch {self.epoch}, newest abandon {self.newest_abandon}, "
            f"abandoned {self.abandoned!r}, in finishing {self.in_finishing}, deferred "
            f"{sorted(self.deferred)} groups {sorted(self.deferred_groups)}, finish watcher "
            f"{'alive' if self.finish_watcher is not None and self.finish_watcher.is_alive() else 'none'}"
        ]
        for group in self.native_groups():
            comms = ", ".join(
                f"{kind}: aborted {comm.aborted}, severable {comm.severable}, {len(comm.connections())} sockets"
                for kind, comm in list(group.comms.items())
            )
            pending = sum(1 for work in list(group._recent) if not work.is_completed())
            lines.append(f"  {group!r}: {group.reason or ''} issued {group.issued}, pending {pending}; {comms}")
        for (transport, peer), link in self.links_snapshot():
            lines.append(f"  link {transport} to {peer}: {link!r}")
        return "\n".join(lines)

    def pair(self, peer: int) -> Pair:
        """WORLD's point-to-point with ``peer`` (:mod:`nccl_delta.pairs`); its build starts on first use."""
        with self._pairs_lock:
            pair = self.pairs.get(peer)
            if pair is None:
                if self.abandoned is not None:
                    raise CommAbandoned(f"rank {self.rank}: no new communicator with rank {peer}: {self.abandoned}")
                pair = self.pairs[peer] = Pair(self, peer)
            return pair

    def drop_pair(self, peer: int) -> None:
        """Forget the pair communicator with ``peer`` (the next point-to-point op builds a new one)."""
        with self._pairs_lock:
            pair = self.pairs.pop(peer, None)
        if pair is not None:
            pair.close()

    def superseded(self, since: int) -> bool:
        """Whether ``abandon`` named an epoch newer than ``since`` (work begun in ``since`` is void)."""
        return self.newest_abandon > since

    def generation(self, peer: int) -> int:
        return max(self.base_generation, self.incarnation.get(self.rank, 0), self.incarnation.get(peer, 0))

    def ring_neighbours(self) -> dict[int, str]:
        """Every peer that is a ring neighbour of this process in some group -> the first such group."""
        out: dict[int, str] = {}
        for group in list(self.groups.values()):
            if not isinstance(group, DeltaGroup):
                continue
            for peer in group.ring_peers():
                out.setdefault(peer, group.name)
        return out

    # --- links -------------------------------------------------------------------
    def links_snapshot(self) -> list[tuple[tuple[str, int], Link]]:
        with self._links_lock:
            return list(self.links.items())

    def links_to(self, rank: int) -> list[tuple[str, Link]]:
        """Every (transport, link) of this process whose peer is ``rank``."""
        return [(transport, link) for (transport, peer), link in self.links_snapshot() if peer == rank]

    def install(self, transport: str, peer: int, link: Link | None) -> bool:
        """Replace the link to ``peer`` (``None`` removes it) and close the old one; returns whether there was one."""
        with self._links_lock:
            old = self.links.pop((transport, peer), None)
            if link is not None:
                self.links[(transport, peer)] = link
        if old is not None:
            old.close()
        return old is not None

    def drop_links(self) -> None:
        """Close every link (the groups stay; ops fail until links are built again)."""
        for transport, peer in [key for key, _ in self.links_snapshot()]:
            self.install(transport, peer, None)

    def connect_links(
        self,
        peers: dict[int, str],
        transport: str,
        *,
        generation: int | None = None,
        store: Store | None = None,
        install: bool = True,
    ) -> dict[int, Link]:
        """Build the missing links to ``peers`` (all at once, one thread each) and return them.

        ``peers`` maps each peer to the name of the group that needs the link (for messages).
        Both ends of each link call this at about the same time. A link that exists already is
        returned as it is. With ``install`` the new links go into :attr:`links`; without, the
        caller installs them (phase 1 of a swap). Each thread gets its own client when the store
        can be cloned (a TCPStore client blocks every thread on one get); a store that cannot
        (the Python etcd store, thread-safe) is shared.
        """
        store = store or self.store
        out: dict[int, Link] = {}
        todo: list[int] = []
        for peer in peers:
            link = self.links.get((transport, peer)) if install else None
            if link is not None:
                out[peer] = link
            else:
                todo.append(peer)
        if not todo:
            return out

        def build(peer: int, client: Store) -> Link:
            gen = self.generation(peer) if generation is None else generation
            lid = LinkId(
                group=peers[peer], a=min(self.rank, peer), b=max(self.rank, peer), generation=gen, transport=transport
            )
            return links_mod.connect(lid, self.rank, client, self.config)

        clients = _clients(store, len(todo))
        builders: dict[int, Callable[[], Link]] = {
            peer: functools.partial(build, peer, client) for peer, client in zip(todo, clients, strict=False)
        }
        built = _build_all(self, builders)
        if install:
            for peer, link in built.items():
                self.install(transport, peer, link)
        out.update(built)
        return out

    # --- membership API (see nccl_delta.delta for the protocol) ----------------
    def prepare(self, rank: int | Iterable[int], epoch: int, *, joiner: str | None = None) -> PreparedSwap:
        from .delta import prepare

        return prepare(self, rank, epoch, joiner=joiner)

    def switch(self, epoch: int, *, timeout_s: float | None = None) -> SwitchReport:
        from .delta import switch

        return switch(self, epoch, timeout_s=timeout_s)

    def abandon(self, epoch: int, reason: str = "abandoned by the control plane", *, dead: Iterable[int] = ()) -> int:
        from .delta import abandon

        return abandon(self, epoch, reason, dead=dead)

    def finishing(self) -> contextlib.AbstractContextManager[None]:
        """The block of an iteration's last collectives (the optimizer step): an abandon arriving in
        it lets the collective in progress end alike on every live member (:mod:`nccl_delta.finishing`)."""
        from .finishing import finishing

        return finishing(self)

    def recover(self, epoch: int, *, replaced: Iterable[int] = ()) -> RecoverReport:
        from .delta import recover

        return recover(self, epoch, replaced=replaced)

    def join(self, epoch: int) -> None:
        from .delta import join

        join(self, epoch)

    def close(self) -> None:
        """Forget every group, close every communicator and link (idempotent)."""
        groups = self.native_groups()
        self.groups.clear()
        with self._pairs_lock:
            pairs, self.pairs = list(self.pairs.values()), {}
        for pair in pairs:
            pair.closed = True
        for group in groups:
            group.close()
        self.drop_links()


POLL_S = 0.02
"""How often a set-up waiting for its links checks whether a newer epoch superseded it."""


K = TypeVar("K")
T = TypeVar("T")


def _build_all(world: DeltaWorld, builders: dict[int, Callable[[], Link]]) -> dict[int, Link]:
    """Build links at once (see :func:`build_concurrently`)."""
    return build_concurrently(world, builders, lambda link: link.close(), "link set-up")


def build_concurrently(
    world: DeltaWorld, builders: dict[K, Callable[[], T]], discard: Callable[[T], None], what: str
) -> dict[K, T]:
    """Run every builder on a daemon thread at once and return what each built.

    Raises the first builder's error (discarding what did come up), or :class:`CommAbandoned` as soon
    as ``abandon`` supersedes the epoch this call began in; whatever is finished after that is
    discarded by its own thread. Everything built at once, one thread each, because each build is a
    rendezvous with other processes: built one by one in different orders on two ends, they could
    wait for each other."""
    since = world.epoch
    lock = threading.Lock()
    results: dict[K, T] = {}
    errors: list[BaseException] = []
    gave_up = threading.Event()
    finished = threading.Semaphore(0)

    def run(key: K, builder: Callable[[], T]) -> None:
        try:
            built = builder()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            with lock:
                errors.append(exc)
        else:
            with lock:
                late = gave_up.is_set()
                if not late:
                    results[key] = built
            if late:
                discard(built)
        finally:
            finished.release()

    for key, builder in builders.items():
        threading.Thread(target=run, args=(key, builder), name=f"nccl_delta_build_{key}", daemon=True).start()
    done = 0
    while done < len(builders):
        if finished.acquire(timeout=POLL_S):
            done += 1
            continue
        if world.superseded(since):
            with lock:
                gave_up.set()
                up = list(results.values())
            for built in up:
                discard(built)
            raise CommAbandoned(f"rank {world.rank}: {what} of epoch {since} given up: {world.abandoned}")
    if errors:
        for built in results.values():
            discard(built)
        raise errors[0]
    return results


def _clients(store: Store, count: int) -> list[Store]:
    """``count`` store clients: independent clones when the store can be cloned, else ``store`` itself."""
    if count <= 1:
        return [store]
    try:
        return [store.clone() for _ in range(count)]  # type: ignore[attr-defined]  # bound in c10d; not in the stub
    except Exception:  # e.g. a store implemented in Python without clone()
        return [store] * count


def current_world() -> DeltaWorld:
    """The process's DeltaWorld; raises if ``init_process_group(backend="nccl_delta")`` has not run."""
    if _WORLD is None:
        raise RuntimeError(
            "no nccl_delta world: call nccl_delta.register() and "
            "torch.distributed.init_process_group(backend='nccl_delta', ...) first"
        )
    return _WORLD


def _install_world(world: DeltaWorld | None) -> None:
    global _WORLD
    with _WORLD_LOCK:
        if _WORLD is not None and world is not None:
            raise RuntimeError("an nccl_delta world exists already in this process; destroy the default group first")
        _WORLD = world
