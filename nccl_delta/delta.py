"""The two-phase membership API: replace the process behind logical rank r by rebuilding only r's groups.

What is rebuilt: the native communicator of every group that contains r (TP, PP, DP, the model-parallel
group ... a number set by the layout, not by the world size), WORLD's ring links to r, and the pair
communicators with r (built again on first use). No other group, and never a communicator of the whole
job: WORLD has none (see :mod:`nccl_delta.backend`).

Protocol for a planned migration of logical rank ``r`` (or of several ranks at once, e.g. every
rank of a drained node: each step then covers all of them) at epoch ``e``
1. Joiner process (new): ``nccl_delta.expect_join(e)``, then the same ``init_process_group`` and
   group creation as the job (e.g. megatron's ``initialize_model_parallel``), which builds nothing,
   then ``current_world().join(e)``: it builds every group's communicator in generation e (all at
   once), then its WORLD ring links, and blocks until all are up (deadline: ``connect_timeout_s``).
2. Every stayer: ``prepare(ranks, e)`` (phase 1). Returns at once. A stayer in a group with a
   replaced rank builds that group's replacement communicator (generation e, with the joiner in r's
   place; on NCCL with a warm-up op) on background threads while training continues on the old one;
   a WORLD ring neighbour of r builds its new link likewise.
3. At an iteration boundary, every stayer: ``switch(e)`` (phase 2). The groups swap to their
   replacements behind the same handles, the old communicators are closed, the pair communicators
   with r are dropped. No barrier: each stayer only touches its own groups with r.
4. The leaver stops using the communicator and exits.

Unexpected failure of rank ``r`` (an op raised :class:`CommLinkError`, or the control plane said so):
1. Every live process: ``abandon(e, dead={r})`` (any thread). Every group with r, and every group
   with an op in flight, is aborted: its pending ops raise :class:`CommAbandoned` at once, even one
   waiting on a hung peer. An idle group is only quiesced: new ops raise, its communicator stays.
   WORLD's links are severed or quiesced by the same rule.
2. Every stayer: ``recover(e, replaced={r})``; the joiner: ``join(e)``. The stayers publish their
   ledgers (:mod:`nccl_delta.ledgers`) and keep a quiet group (or link) only when every member agrees
   nothing is left in it. Every other group is rebuilt in generation e, all at once.

An abandon of a newer epoch may come while ``recover`` or ``switch`` builds and installs the
communicators of its own epoch: it cuts what is there, and an install after it would open the group
again behind its back (a member would train on while its peers recover the newer epoch). So each ends
by cutting, under the world's lock as ``abandon`` does, whatever it opened after such an abandon
(:func:`cut_reopened`); ``recover`` then raises :class:`CommAbandoned` so that its caller moves on to the
newer epoch at once, and after ``switch`` the next op fails fast as after any abandon.

Failures: ``switch`` raises :class:`~nccl_delta.errors.SwapAborted` (nothing swapped, the old epoch
stays in force) if the replacements are not up within its deadline or failed to build.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nccl_delta.errors import CommAbandoned, CommLinkError, CommTimeout, SwapAborted

from .finishing import defer, defer_group
from .ledgers import agree_on_kept
from .links import Link
from .native_group import OPEN

if TYPE_CHECKING:
    from .native import NativeComm
    from .native_group import NativeGroup
    from .world import DeltaWorld

logger = logging.getLogger(__name__)


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
    """New WORLD ring links to the joiners: (transport, rank, link)."""
    groups: list[tuple[NativeGroup, NativeComm]] = field(default_factory=list)
    """Replacement communicators of this stayer's groups with a replaced rank."""
    planned: int = 0
    """How many links and communicators this stayer must build (0 when it shares nothing with a replaced rank)."""
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

    def discard(self) -> None:
        for *_, link in self.links:
            link.close()
        for _, comm in self.groups:
            comm.abort()
            comm.close()


@dataclass(kw_only=True)
class SwitchReport:
    """What phase 2 did on this stayer."""

    rank: int
    """The first replaced rank; ``ranks`` has them all."""
    epoch: int
    links_touched: int
    """WORLD ring links re-pointed to the joiner, stale links and pair communicators to the leaver closed."""
    groups_switched: int
    """Groups whose communicator was swapped for its replacement."""
    groups: dict[str, int] = field(default_factory=dict)
    """Those groups' names and sizes."""
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
    """Quiet WORLD links kept, their ledgers matching at both ends."""
    rebuilt: int
    """WORLD ring links built anew in generation ``epoch``."""
    groups_kept: int = 0
    """Quiet groups kept, every member's ledger agreeing."""
    groups_rebuilt: int = 0
    """Groups whose communicator was built anew in generation ``epoch``."""
    members_rebuilt: int = 0
    """The members of those groups, summed (the size of the communicator set-ups this rank took part in)."""
    agree_s: float = 0.0
    """Seconds spent agreeing on what is kept (the ledger exchange with every peer)."""
    groups_s: float = 0.0
    """Seconds spent building the groups' communicators (a rendezvous with the joiner and the other stayers)."""
    rings_s: float = 0.0
    """Seconds spent building WORLD ring links."""


def affected_groups(world: DeltaWorld, ranks: Iterable[int]) -> list[NativeGroup]:
    """This process's groups (pairs and groups of the whole job aside) that contain one of ``ranks``:
    what a replacement rebuilds."""
    ranks = set(ranks)
    pairs = {id(pair.group) for pair in list(world.pairs.values())}
    return [g for g in world.native_groups() if id(g) not in pairs and not g.spans_world and set(g.members) & ranks]


def reset_world_spanning(world: DeltaWorld) -> int:
    """Drop the communicators of the groups of the whole job; their next op builds them again."""
    groups = [g for g in world.native_groups() if g.spans_world]
    for group in groups:
        group.reset()
    return len(groups)


def build_groups(world: DeltaWorld, groups: list[NativeGroup], generation: int) -> dict[str, NativeComm]:
    """Build the communicators of ``groups`` in ``generation``, all at once (see :func:`build_concurrently`)."""
    from .world import build_concurrently

    def build(group: NativeGroup) -> NativeComm:
        start = time.monotonic()
        try:
            return group.build(generation)
        except Exception as exc:  # gloo and NCCL raise RuntimeError for a timeout and a refused peer alike
            waited = time.monotonic() - start
            cls = CommTimeout if waited >= world.config.connect_timeout_s * 0.95 else CommLinkError
            raise cls(
                f"rank {world.rank}: could not build group {group.name!r} (members {group.members}, generation "
                f"{generation}) after {waited:.1f}s: {exc}. Check that every member is alive and built the same "
                "groups in the same order."
            ) from exc

    def discard(comm: NativeComm) -> None:
        comm.abort()
        comm.close()

    builders: dict[str, Callable[[], NativeComm]] = {g.name: functools.partial(build, g) for g in groups}
    return build_concurrently(world, builders, discard, "communicator set-up")


def prepare(world: DeltaWorld, rank: int | Iterable[int], epoch: int, *, joiner: str | None = None) -> PreparedSwap:
    """Phase 1 on a stayer: start building the replacements of the groups and links of ``rank`` (one
    rank or several) in the background."""
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
    groups = affected_groups(world, ranks)
    swap.planned = len(todo) + len(groups)
    world.prepared[epoch] = swap
    if not swap.planned:
        swap.done.set()
        return swap

    def build() -> None:
        try:
            # Groups first, then links: the joiner's join() builds in the same order.
            comms = build_groups(world, groups, epoch)
            swap.groups += [(g, comms[g.name]) for g in groups]
            links = world.connect_links(todo, world.transport, generation=epoch, install=False)
            swap.links += [(world.transport, r, link) for r, link in sorted(links.items())]
        except BaseException as exc:  # reported by switch()
            swap.error = exc
        finally:
            swap.done.set()

    threading.Thread(target=build, name=f"nccl_delta_prepare_e{epoch}", daemon=True).start()
    return swap


def switch(world: DeltaWorld, epoch: int, *, timeout_s: float | None = None) -> SwitchReport:
    """Phase 2 on a stayer: swap the replaced ranks' groups to their replacements; touches nothing else."""
    swap = world.prepared.get(epoch)
    if swap is None:
        raise SwapAborted(f"switch({epoch}) without prepare(rank, {epoch}) on rank {world.rank}")
    timeout_s = world.config.connect_timeout_s if timeout_s is None else timeout_s
    t0 = time.perf_counter()
    if not swap.wait(timeout_s):
        raise SwapAborted(
            f"rank {world.rank}: the replacements for ranks {swap.ranks} (epoch {epoch}) were not up after "
            f"{timeout_s:.1f}s; the old communicators stay in use. Check that the joiners called join({epoch})."
        )
    wait_s = time.perf_counter() - t0
    world.prepared.pop(epoch, None)
    if swap.error is not None:
        swap.discard()
        raise SwapAborted(
            f"rank {world.rank}: building the replacements for ranks {swap.ranks} failed: {swap.error}"
        ) from swap.error
    t1 = time.perf_counter()
    for group, comm in swap.groups:
        group.install(comm)
    reset_world_spanning(world)
    touched = 0
    replaced: set[tuple[str, int]] = set()
    for transport, rank, link in swap.links:
        world.install(transport, rank, link)
        replaced.add((transport, rank))
        touched += 1
    # A link to a leaver that phase 1 did not rebuild (another transport) is closed; both ends rebuild
    # it on first use in the new generation. Pair communicators with a leaver likewise.
    for rank in swap.ranks:
        for transport, _ in world.links_to(rank):
            if (transport, rank) not in replaced and world.install(transport, rank, None):
                touched += 1
        if rank in world.pairs:
            world.drop_pair(rank)
            touched += 1
        world.incarnation[rank] = epoch
    with world._lock:  # abandon(epoch) is a no-op from here on
        cut_reopened(world, since=world.epoch)
        world.epoch = epoch
    return SwitchReport(
        rank=swap.rank,
        ranks=list(swap.ranks),
        epoch=epoch,
        links_touched=touched,
        groups_switched=len(swap.groups),
        groups={g.name: g.size for g, _ in swap.groups},
        switch_s=time.perf_counter() - t1,
        wait_s=wait_s,
    )


def cut_reopened(world: DeltaWorld, *, since: int) -> bool:
    """With the world's lock held, after installing communicators of a later epoch than ``since``: if an
    abandon of an epoch newer than ``since`` came meanwhile, cut every group and link that is open again
    (quiesce the idle ones, abort or sever the others, as that abandon did); True if one came. See the
    module docstring."""
    if not world.superseded(since):
        return False
    reason = world.abandoned or f"epoch {world.newest_abandon} abandoned"
    for group in world.native_groups():
        if group.state == OPEN and not group.quiesce(reason):
            group.abort(reason)
    for _, link in world.links_snapshot():
        if link.state == "open" and not link.quiesce(reason):
            link.sever(reason)
    return True


def abandon(world: DeltaWorld, epoch: int, reason: str, *, dead: Iterable[int] = ()) -> int:
    """Make every op in flight or to come fail fast (any thread); returns how many groups and links were cut.

    Groups and links with a ``dead`` rank, and those with an op in flight, are cut; idle ones are
    quiesced (see the module docstring). Inside :meth:`DeltaWorld.finishing` everything without a dead
    rank is deferred instead, so the step's last collective ends alike on all its members
    (:mod:`nccl_delta.finishing`). A no-op once this process is in ``epoch`` (``recover`` or ``switch``
    reached it): a late call, e.g. from a watch thread that saw the plan again, must not touch what
    the new epoch is building. The check and the abandon hold the world's lock, which ``recover``
    takes to enter the epoch."""
    with world._lock:
        if world.epoch >= epoch:
            return 0
        world.newest_abandon = max(world.newest_abandon, epoch)
        world.abandoned = f"epoch {epoch} abandoned: {reason}"
        dead = set(dead)
        cut = 0
        for group in world.native_groups():
            try:
                if set(group.members) & dead:
                    group.abort(world.abandoned)
                    cut += 1
                elif world.in_finishing:
                    defer_group(world, group, epoch)  # see nccl_delta.finishing
                elif not group.quiesce(world.abandoned):
                    group.abort(world.abandoned)
                    cut += 1
            except Exception:  # one group's trouble must not leave the others open
                logger.exception(
                    "rank %d: abandoning group %r failed; the others are cut regardless", world.rank, group.name
                )
        for (transport, peer), link in world.links_snapshot():
            if peer not in dead and world.in_finishing:
                defer(world, (transport, peer), link, epoch)
            elif peer in dead or not link.quiesce(world.abandoned):
                world.deferred.pop((transport, peer), None)
                link.sever(world.abandoned)
                cut += 1
        return cut


def recover(world: DeltaWorld, epoch: int, *, replaced: Iterable[int] = ()) -> RecoverReport:
    """After ``abandon``: keep the quiet groups and links every end agrees on, rebuild the others in
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
        # like any stayer: the swaps of older epochs are void, and what they built is closed.
        world.joining = False
        stale = [e for e in world.prepared if e <= epoch]
        swaps = [world.prepared.pop(e) for e in stale]
    for swap in swaps:  # a build still running gives up by itself: this epoch superseded its own
        swap.discard()
    for rank in replaced:
        world.incarnation[rank] = epoch
    t_agree = time.monotonic()
    keep_links, keep_groups = agree_on_kept(world, epoch, replaced)
    t_groups = time.monotonic()
    for (transport, peer), link in world.links_snapshot():
        if (transport, peer) in keep_links:
            link.resume()
        else:
            world.install(transport, peer, None)
    for peer, pair in list(world.pairs.items()):
        if pair.group.name in keep_groups:
            pair.group.resume()
        else:
            world.drop_pair(peer)  # built again on first use, by both ends in this epoch
    rebuild, kept = [], 0
    for group in affected_groups(world, [world.rank]):  # every group of this process
        if group.name in keep_groups:
            group.resume()
            kept += 1
        else:
            rebuild.append(group)
    comms = build_groups(world, rebuild, epoch)
    for group in rebuild:
        group.install(comms[group.name])
    for group in world.native_groups():
        if group.spans_world and group.name not in keep_groups:
            group.reset()
    t_rings = time.monotonic()
    rebuilt = connect_all_rings(world, epoch)
    with world._lock:
        if cut_reopened(world, since=epoch):
            raise CommAbandoned(f"rank {world.rank}: recover({epoch}) superseded while it rebuilt: {world.abandoned}")
    return RecoverReport(
        epoch=epoch,
        kept=len(keep_links),
        rebuilt=rebuilt,
        groups_kept=kept,
        groups_rebuilt=len(rebuild),
        members_rebuilt=sum(g.size for g in rebuild),
        agree_s=t_groups - t_agree,
        groups_s=t_rings - t_groups,
        rings_s=time.monotonic() - t_rings,
    )


def join(world: DeltaWorld, epoch: int) -> None:
    """On the joiner: build every group's communicator, then every WORLD ring link, in generation ``epoch``."""
    if not world.joining:
        raise SwapAborted(
            f"rank {world.rank} is not a joiner: call nccl_delta.expect_join(epoch) before init_process_group"
        )
    if epoch != world.epoch:
        raise SwapAborted(f"join({epoch}) but this joiner expected epoch {world.epoch}")
    groups = affected_groups(world, [world.rank])
    comms = build_groups(world, groups, epoch)
    for group in groups:
        group.install(comms[group.name])
    world.groups_joined_at = time.time()
    connect_all_rings(world, epoch)
    world.joining = False


def connect_all_rings(world: DeltaWorld, epoch: int) -> int:
    """Build the link to every WORLD ring neighbour that has none, in generation ``epoch``, all at once."""
    have = {peer for (transport, peer), _ in world.links_snapshot() if transport == world.transport}
    missing = {p: g for p, g in sorted(world.ring_neighbours().items()) if p not in have}
    if missing:
        world.connect_links(missing, world.transport, generation=epoch)
    return len(missing)
