"""The two-phase membership API: replace the process behind logical rank r by touching only r's links.

Protocol for a planned migration of logical rank ``r`` (or of several ranks at once, e.g. every
rank of a drained node: each step then covers all of them) at epoch ``e``
1. Joiner process (new): ``nccl_delta.expect_join(e)``, then the same
   ``init_process_group`` and group creation as the job (e.g. megatron's
   ``initialize_model_parallel``), which builds no links, then
   ``current_world().join(e)``: it connects to every ring neighbour of r (in
   any group), one link per neighbour, all at once, and blocks until all are
   up (deadline: ``connect_timeout_s``). A neighbour that is replaced in the
   same epoch is another joiner: the two meet in generation e.
2. Every stayer: ``prepare(ranks, e)`` (phase 1). Returns at once. A stayer
   that is a ring neighbour of a replaced rank in some group builds its one new
   link to each such rank on a background thread while training continues on
   the old links; any other stayer only records the epoch.
3. At an iteration boundary, every stayer: ``switch(e)`` (phase 2). A
   neighbour re-points its link to r (every group using it follows), closes
   the old one, and reports how many links it touched. No barrier and no
   global rebuild: cost is independent of world size.
4. The leaver stops using the communicator and exits.

Unexpected failure of rank ``r`` (a link raised :class:`CommLinkError`, or the
lease of r expired):
1. Every live process: ``abandon(e, dead={r})`` (any thread). Every link with
   an op in flight, and every link to r, is severed, so any op in flight on any
   thread raises :class:`CommAbandoned` at once, even one waiting on a hung
   peer. An idle link is only quiesced: new ops on it raise, it stays
   connected. Processes that will exit instead should call ``os._exit`` after
   cleanup (gloo aborts at exit with abandoned ops).
2. Every stayer: ``recover(e, replaced={r})``; the joiner: ``join(e)``. The
   stayers publish each quiet link's ledger (messages sent and received per
   tag, pair collectives) under ``nccl_delta/ledgers/e<e>/<rank>`` in the store
   and keep a link only when both ends are quiet and the ledgers match: no
   message is left in the pair, so the streams stay in step. Every other link
   to a ring neighbour is rebuilt in generation e, all at once. So a failure
   rebuilds the links that were busy or touched r, not every link of the job.

Failures: ``switch`` raises :class:`~nccl_delta.errors.SwapAborted` (links unchanged, the
old epoch stays in force) if the new links are not up within its deadline or
failed to connect.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nccl_delta.errors import CommAbandoned, CommTimeout, SwapAborted

from .finishing import defer
from .links import Ledger, Link

if TYPE_CHECKING:
    from .world import DeltaWorld


@dataclass(kw_only=True)
class PreparedSwap:
    """Phase-1 state of one stayer for one epoch."""

    ranks: list[int]
    """Logical ranks being replaced."""
    epoch: int
    """Membership epoch the swap belongs to."""
    joiner: str | None = None
    """Control-plane id of the joining member (for messages only)."""
    links: list[tuple[str, int, Link]] = field(default_factory=list)
    """New links to the joiners: (transport, rank, link), one per replaced rank that is a ring neighbour
    in some group."""
    planned: int = 0
    """How many links this stayer must build (0 when it neighbours no replaced rank)."""
    error: BaseException | None = None
    """The first error of the background build, if any."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the background build finished (successfully or not)."""

    def wait(self, timeout_s: float) -> bool:
        return self.done.wait(timeout_s)

    @property
    def rank(self) -> int:
        """The first replaced rank (for messages)."""
        return self.ranks[0]


@dataclass(kw_only=True)
class SwitchReport:
    """What phase 2 did on this stayer."""

    rank: int
    """The first replaced rank; ``ranks`` has them all."""
    epoch: int
    links_touched: int
    """Links re-pointed to the joiner plus stale links to the leaver that were closed."""
    switch_s: float
    """Seconds spent in phase 2 on this process (excluding any wait for phase 1)."""
    wait_s: float
    """Seconds ``switch`` waited for phase 1 to finish."""
    ranks: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class RecoverReport:
    """What ``recover`` did on this process."""

    epoch: int
    kept: int
    """Quiet links kept, their ledgers matching at both ends."""
    rebuilt: int
    """Ring links built anew in generation ``epoch``."""


def prepare(world: DeltaWorld, rank: int | Iterable[int], epoch: int, *, joiner: str | None = None) -> PreparedSwap:
    """Phase 1 on a stayer: start building links to the joiners of ``rank`` (one rank or several) in the
    background."""
    ranks = [rank] if isinstance(rank, int) else sorted(set(rank))
    if not ranks:
        raise SwapAborted(f"prepare({epoch}) without a rank to replace")
    if world.rank in ranks:
        raise SwapAborted(f"rank {world.rank} cannot prepare its own replacement; prepare runs on stayers")
    if epoch <= world.epoch or epoch in world.prepared:
        raise SwapAborted(f"epoch {epoch} is not newer than the current epoch {world.epoch} or was prepared already")
    swap = PreparedSwap(ranks=ranks, epoch=epoch, joiner=joiner)
    neighbours = world.ring_neighbours()
    todo = {r: neighbours[r] for r in ranks if r in neighbours}
    swap.planned = len(todo)
    world.prepared[epoch] = swap
    if not todo:
        swap.done.set()
        return swap

    def build() -> None:
        try:
            links = world.connect_links(todo, world.transport, generation=epoch, install=False)
            swap.links += [(world.transport, r, link) for r, link in sorted(links.items())]
        except BaseException as exc:  # reported by switch()
            swap.error = exc
        finally:
            swap.done.set()

    threading.Thread(target=build, name=f"nccl_delta_prepare_e{epoch}", daemon=True).start()
    return swap


def switch(world: DeltaWorld, epoch: int, *, timeout_s: float | None = None) -> SwitchReport:
    """Phase 2 on a stayer: re-point the replaced ranks to their joiners; touches only their links."""
    swap = world.prepared.get(epoch)
    if swap is None:
        raise SwapAborted(f"switch({epoch}) without prepare(rank, {epoch}) on rank {world.rank}")
    timeout_s = world.config.connect_timeout_s if timeout_s is None else timeout_s
    t0 = time.perf_counter()
    if not swap.wait(timeout_s):
        raise SwapAborted(
            f"rank {world.rank}: links to the joiners for ranks {swap.ranks} (epoch {epoch}) not up after "
            f"{timeout_s:.1f}s; the old links stay in use. Check that the joiners called join({epoch})."
        )
    wait_s = time.perf_counter() - t0
    world.prepared.pop(epoch, None)
    if swap.error is not None:
        for *_, link in swap.links:
            link.close()
        raise SwapAborted(
            f"rank {world.rank}: building links to the joiners for ranks {swap.ranks} failed: {swap.error}"
        ) from swap.error
    t1 = time.perf_counter()
    touched = 0
    replaced: set[tuple[str, int]] = set()
    for transport, rank, link in swap.links:
        world.install(transport, rank, link)
        replaced.add((transport, rank))
        touched += 1
    # A link to a leaver that phase 1 did not rebuild (a p2p link outside every ring, another
    # transport) is closed; both ends rebuild it on first use in the new generation.
    for rank in swap.ranks:
        for transport, _ in world.links_to(rank):
            if (transport, rank) not in replaced and world.install(transport, rank, None):
                touched += 1
        world.incarnation[rank] = epoch
    with world._lock:  # abandon(epoch) is a no-op from here on
        world.epoch = epoch
    return SwitchReport(
        rank=swap.rank,
        ranks=list(swap.ranks),
        epoch=epoch,
        links_touched=touched,
        switch_s=time.perf_counter() - t1,
        wait_s=wait_s,
    )


def abandon(world: DeltaWorld, epoch: int, reason: str, *, dead: Iterable[int] = ()) -> int:
    """Make every op in flight or to come fail fast (any thread); returns how many links were severed.

    Links to ``dead`` ranks and links with an op in flight are severed; idle ones are quiesced
    (see the module docstring). Inside :meth:`DeltaWorld.finishing` every link to a live peer is
    deferred instead, so the step's last collective ends alike on all its members
    (:mod:`nccl_delta.finishing`). A no-op once this process is in ``epoch`` (``recover`` or ``switch``
    reached it): a late call, e.g. from a watch thread that saw the plan again, must not touch the
    links the new epoch is building. The check and the abandon hold the world's lock, which
    ``recover`` takes to enter the epoch."""
    with world._lock:
        if world.epoch >= epoch:
            return 0
        world.newest_abandon = max(world.newest_abandon, epoch)
        world.abandoned = f"epoch {epoch} abandoned: {reason}"
        dead = set(dead)
        severed = 0
        for (transport, peer), link in world.links_snapshot():
            if peer not in dead and world.in_finishing:
                defer(world, (transport, peer), link, epoch)  # see nccl_delta.finishing
            elif peer in dead or not link.quiesce(world.abandoned):
                world.deferred.pop((transport, peer), None)
                link.sever(world.abandoned)
                severed += 1
        return severed


def recover(world: DeltaWorld, epoch: int, *, replaced: Iterable[int] = ()) -> RecoverReport:
    """After ``abandon``: keep the quiet links both ends agree on, rebuild the other ring links in
    generation ``epoch`` (all stayers and the joiner at once); see the module docstring."""
    if epoch <= world.base_generation and world.abandoned is None:
        raise SwapAborted(f"recover({epoch}) is not newer than generation {world.base_generation}")
    replaced = set(replaced)
    with world._lock:  # from here on, abandon(epoch) is a no-op (see abandon)
        if world.superseded(epoch):
            raise CommAbandoned(f"rank {world.rank}: recover({epoch}) superseded: {world.abandoned}")
        world.abandoned = None
        world.base_generation = epoch
        world.epoch = epoch
        # A joiner whose join was cut short, and a stayer with a phase 1 in progress, take part
        # like any stayer: the swaps of older epochs are void, and their links are closed.
        world.joining = False
        stale = [e for e in world.prepared if e <= epoch]
        swaps = [world.prepared.pop(e) for e in stale]
    for swap in swaps:  # a build still running gives up by itself: this epoch superseded its own
        for *_, link in swap.links:
            link.close()
    for rank in replaced:
        world.incarnation[rank] = epoch
    keep = agree_on_kept_links(world, epoch, replaced)
    for (transport, peer), link in world.links_snapshot():
        if (transport, peer) in keep:
            link.resume()
        else:
            world.install(transport, peer, None)
    rebuilt = connect_all_rings(world, epoch)
    return RecoverReport(epoch=epoch, kept=len(keep), rebuilt=rebuilt)


def ledger_key(epoch: int, rank: int) -> str:
    return f"nccl_delta/ledgers/e{epoch}/{rank}"


def agree_on_kept_links(world: DeltaWorld, epoch: int, replaced: set[int]) -> set[tuple[str, int]]:
    """Publish this process's ledgers and return the ``(transport, peer)`` links both ends keep.

    Every stayer publishes (peers may wait for it); it waits only for the peers of its own quiet
    links. Both ends of a link compare the same two ledgers, so they decide alike."""
    entries = {key: link for key, link in world.links_snapshot() if key[1] not in replaced}
    mine = {f"{transport}/{peer}": link.ledger() for (transport, peer), link in entries.items()}
    world.store.set(ledger_key(epoch, world.rank), json.dumps(mine))
    peers = sorted({peer for (transport, peer) in entries if mine[f"{transport}/{peer}"] is not None})
    if not peers:
        return set()
    _wait_keys(world, [ledger_key(epoch, p) for p in peers], epoch)
    theirs_by_peer = {p: json.loads(world.store.get(ledger_key(epoch, p))) for p in peers}
    return {
        (transport, peer)
        for transport, peer in entries
        if ledgers_match(mine[f"{transport}/{peer}"], theirs_by_peer.get(peer, {}).get(f"{transport}/{world.rank}"))
    }


POLL_FIRST_S = 0.005
POLL_MAX_S = 0.08
"""How often :func:`_wait_keys` looks: after 5 ms, then twice as long each time, up to 80 ms. Peers
publish their ledgers within milliseconds of each other, so the first looks find them; a long wait (a
peer starved or hung) then reads every key 12 times a second rather than 50, which on a crowded
machine leaves the CPU to the peers being waited for."""


def _wait_keys(world: DeltaWorld, keys: list[str], epoch: int) -> None:
    """Block until every key is in the store; :class:`CommAbandoned` once a newer epoch supersedes
    ``epoch`` (a peer that died before publishing never does), :class:`CommTimeout` after
    ``connect_timeout_s``. Looks at the store with a growing pause (:data:`POLL_FIRST_S`)."""
    deadline = time.monotonic() + world.config.connect_timeout_s
    pause = POLL_FIRST_S
    while not world.store.check(keys):
        if world.superseded(epoch):
            raise CommAbandoned(f"rank {world.rank}: ledgers of epoch {epoch} given up: {world.abandoned}")
        if time.monotonic() > deadline:
            raise CommTimeout(
                f"rank {world.rank}: the ledgers {keys} were not all published within "
                f"{world.config.connect_timeout_s:.0f}s; a peer of epoch {epoch} is hung or gone"
            )
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def ledgers_match(ours: Ledger | None, theirs: Ledger | None) -> bool:
    """Whether a link may be kept: both ends quiet, the same generation, the same number of pair
    collectives, and every message one end sent received by the other (per tag)."""
    return (
        ours is not None
        and theirs is not None
        and ours["generation"] == theirs["generation"]
        and ours["pair"] == theirs["pair"]
        and ours["sent"] == theirs["received"]
        and ours["received"] == theirs["sent"]
    )


def join(world: DeltaWorld, epoch: int) -> None:
    """On the joiner: connect every ring link of every group, in creation order, in generation ``epoch``."""
    if not world.joining:
        raise SwapAborted(
            f"rank {world.rank} is not a joiner: call nccl_delta.expect_join(epoch) before init_process_group"
        )
    if epoch != world.epoch:
        raise SwapAborted(f"join({epoch}) but this joiner expected epoch {world.epoch}")
    connect_all_rings(world, epoch)
    world.joining = False


def connect_all_rings(world: DeltaWorld, epoch: int) -> int:
    """Build the link to every ring neighbour (in any group) that has none, in generation ``epoch``.

    One link per neighbour, all at once (one thread each): the cost is one link set-up, not
    one per group (TP2xPP2xDP2 has up to ten groups over the same TP pair).
    """
    have = {peer for (transport, peer), _ in world.links_snapshot() if transport == world.transport}
    missing = {p: g for p, g in sorted(world.ring_neighbours().items()) if p not in have}
    if missing:
        world.connect_links(missing, world.transport, generation=epoch)
    return len(missing)
