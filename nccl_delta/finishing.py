"""Finishing an iteration's last collectives across an abandon: no rank completes a step its peers lose.

Why: ``abandon`` severs every link with an op in flight. If it lands while live ranks are inside the
*last* collective of an iteration (the gradient-norm all-reduce of the optimizer step, on the
model-parallel group), a ring all-reduce can already have delivered everything on one member and not
yet on another. The first applies the step (it holds iteration k+1), the second rewinds (k). When the
first is its shard's only live replica (its data-parallel peer just failed), no replica of that
shard is left at k, and the job falls back to the checkpoint although nothing was lost.

Contract (:meth:`DeltaWorld.finishing`, the block around the optimizer step, on the training thread):
- An ``abandon`` that arrives inside the block severs the links to its dead ranks at once and defers
  every other link: the collective in progress runs on among live ranks. A *new* op raises
  :class:`~nccl_delta.errors.CommAbandoned` at its start, as everywhere.
- So a collective whose members are all live and inside it completes on all of them, and one that a
  member never enters (it raised before) completes on none: every member holds the same iteration.
- A deferred link is severed (its op raises) once its peer has stopped, which the peer says by
  publishing its ledgers for the abandon's epoch (``recover``), with nothing it sent still on the way;
  or a dead-rank abandon names the peer; or :attr:`DeltaConfig.finish_grace_s` passes (a live peer
  that neither finishes nor stops). A watcher thread looks, with the ledger poll's back-off.
- Leaving the block quiesces every deferred link that is idle (``recover`` may keep it) and severs the
  rest. Only the training thread enters the block; ``recover`` cannot run inside it.
- Native groups (:mod:`nccl_delta.native_group`) follow the same rules: a deferred group with an op in
  flight is aborted once a member has published a ledger showing it will never complete that op (it
  issued fewer collectives, sent us fewer messages or posted fewer receives than we did), or once the
  grace passes; leaving the block quiesces the idle ones and aborts the rest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .links import Link
    from .native_group import NativeGroup
    from .world import DeltaWorld

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def finishing(world: DeltaWorld) -> Iterator[None]:
    """The block of an iteration's last collectives (see the module docstring)."""
    with world._lock:
        world.in_finishing = True
    try:
        yield
    finally:
        with world._lock:
            world.in_finishing = False
            deferred, world.deferred = world.deferred, {}
            groups, world.deferred_groups = world.deferred_groups, {}
            reason = world.abandoned or "abandoned by the control plane"
        for link in deferred.values():
            if not link.quiesce(reason):
                link.sever(reason)
        for group in groups.values():
            if not group.quiesce(reason):
                group.abort(reason)


def defer(world: DeltaWorld, key: tuple[str, int], link: Link, epoch: int) -> None:
    """Inside ``finishing`` (caller holds ``world._lock``): leave ``link`` to its op, watched."""
    world.deferred[key] = link
    _watch_from(world, epoch)


def defer_group(world: DeltaWorld, group: NativeGroup, epoch: int) -> None:
    """Inside ``finishing`` (caller holds ``world._lock``): leave ``group`` to its op, watched."""
    world.deferred_groups[group.name] = group
    _watch_from(world, epoch)


def _watch_from(world: DeltaWorld, epoch: int) -> None:
    if world.finish_watcher is None or not world.finish_watcher.is_alive():
        world.finish_watcher = threading.Thread(
            target=_watch, args=(world, epoch), name="nccl_delta_finish_watch", daemon=True
        )
        world.finish_watcher.start()


def _watch(world: DeltaWorld, epoch: int) -> None:
    """Sever each deferred link whose peer stopped (or once the grace passed), until none is left."""
    from .ledgers import POLL_FIRST_S, POLL_MAX_S, ledger_key

    deadline = time.monotonic() + world.config.finish_grace_s
    pause = POLL_FIRST_S
    while True:
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
        with world._lock:
            if not world.deferred and not world.deferred_groups:
                # Said under the lock: a defer after this starts a new watcher (this thread may
                # still be alive for a moment, and would never look at what it deferred).
                if world.finish_watcher is threading.current_thread():
                    world.finish_watcher = None
                return
            pending = dict(world.deferred)
            groups = dict(world.deferred_groups)
            newest = world.newest_abandon
            reason = world.abandoned or f"epoch {epoch} abandoned"
        expired = time.monotonic() > deadline
        for name, group in groups.items():
            if not expired and not _group_cannot_finish(world, group, newest):
                continue
            with world._lock:
                taken = world.deferred_groups.pop(name, None) is group
            if not taken:
                continue
            if expired:
                logger.warning(
                    "rank %d: the collective in group %r neither finished nor stopped within %.1fs of the abandon "
                    "(finish_grace_s); aborting the group",
                    world.rank,
                    name,
                    world.config.finish_grace_s,
                )
            group.abort(reason)
        for key, link in pending.items():
            if not expired and not _peer_stopped(world, key, link, ledger_key(newest, key[1])):
                continue
            with world._lock:
                taken = world.deferred.pop(key, None) is link
            if not taken:
                continue
            if expired:
                logger.warning(
                    "rank %d: the collective with rank %d neither finished nor stopped within %.1fs of the "
                    "abandon (finish_grace_s); severing the link",
                    world.rank,
                    key[1],
                    world.config.finish_grace_s,
                )
            link.sever(reason)


def _peer_stopped(world: DeltaWorld, key: tuple[str, int], link: Link, ledger: str) -> bool:
    """Whether our op waits on ``link`` for something that will never come: the peer published its
    ledgers (it stopped), nothing it sent is still on the way, and we still await a receive or a pair
    collective from it, or it never received a message we sent. A peer that completed the collective
    and stopped afterwards has received all we sent: its link is done, and our op ends on the others."""
    try:
        if not world.store.check([ledger]):
            return False
        theirs = json.loads(world.store.get(ledger)).get(f"{key[0]}/{world.rank}")
    except Exception as exc:  # the store is unreachable: the grace decides
        logger.info("rank %d: could not read %s: %s", world.rank, ledger, exc)
        return False
    if theirs is None:
        return True  # their side is not quiet: they severed it, and our op on it fails anyway
    with link._lock:
        received, sent = dict(link.received), dict(link.sent)
        awaiting, pairs = link.awaiting, link.pair_collectives
    if theirs["pair"] > pairs or any(n > received.get(int(t), 0) for t, n in theirs["sent"].items()):
        return False  # on the way to us: our op goes on
    unread = any(theirs["received"].get(str(t), 0) < n for t, n in sent.items())
    return awaiting > 0 or unread


def _group_cannot_finish(world: DeltaWorld, group: NativeGroup, epoch: int) -> bool:
    """Whether an op in flight on ``group`` waits for a member that has stopped without doing its part:
    its published ledger for ``epoch`` has the group cut (``None``), or fewer collectives, messages to us
    or receives from us than we issued. An idle group is left to the block's end."""
    from .ledgers import group_key, ledger_key

    if not group.busy():
        return False
    mine = group.counts()
    me = str(world.rank)
    for member in group.members:
        if member == world.rank:
            continue
        key = ledger_key(epoch, member)
        try:
            if not world.store.check([key]):
                continue
            theirs = json.loads(world.store.get(key)).get(group_key(group))
        except Exception as exc:  # the store is unreachable: the grace decides
            logger.info("rank %d: could not read %s: %s", world.rank, key, exc)
            continue
        if theirs is None or theirs["generation"] != mine["generation"]:
            return True
        if theirs["collectives"] < mine["collectives"]:
            return True
        if theirs["sent"].get(me, 0) < mine["received"].get(str(member), 0):
            return True
        if theirs["received"].get(me, 0) < mine["sent"].get(str(member), 0):
            return True
    return False
