"""What every stayer keeps after an abandon: the quiet links and groups whose ledgers agree at every end.

Contract (``recover(e)``, on every stayer; a fresh joiner keeps nothing)
- Each stayer publishes one record under :func:`ledger_key` ``(e, rank)``: for each quiet link
  (``"<transport>/<peer>"``) and each quiet native group (``"group/<name>"``) its ledger, ``None``
  for anything that cannot be kept (cut, broken, busy at the abandon, or containing a replaced rank).
- It waits only for the records of the peers it shares something keepable with, and keeps a link
  when both ends' ledgers match, a group when every member's ledgers agree. Every end compares the
  same records, so every end decides alike.
- A wait gives up with :class:`CommAbandoned` once a newer epoch supersedes this one (a peer that died
  before publishing never will), and with :class:`CommTimeout` after ``connect_timeout_s``.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from nccl_delta.errors import CommAbandoned, CommTimeout

from .links import Ledger
from .native_group import ledgers_agree

if TYPE_CHECKING:
    from .native_group import NativeGroup
    from .world import DeltaWorld

POLL_FIRST_S = 0.005
POLL_MAX_S = 0.08
"""How often :func:`wait_keys` looks: after 5 ms, then twice as long each time, up to 80 ms. Peers
publish their ledgers within milliseconds of each other, so the first looks find them; a long wait (a
peer starved or hung) then reads every key 12 times a second rather than 50, which on a crowded
machine leaves the CPU to the peers being waited for."""


def ledger_key(epoch: int, rank: int) -> str:
    return f"nccl_delta/ledgers/e{epoch}/{rank}"


def group_key(group: NativeGroup) -> str:
    return f"group/{group.name}"


def agree_on_kept(world: DeltaWorld, epoch: int, replaced: set[int]) -> tuple[set[tuple[str, int]], set[str]]:
    """Publish this process's ledgers; return the ``(transport, peer)`` links and the group names to keep."""
    entries = {key: link for key, link in world.links_snapshot() if key[1] not in replaced}
    mine: dict[str, Any] = {f"{transport}/{peer}": link.ledger() for (transport, peer), link in entries.items()}
    groups = world.native_groups()
    for group in groups:
        mine[group_key(group)] = None if set(group.members) & replaced else group.ledger()
    world.store.set(ledger_key(epoch, world.rank), json.dumps(mine))
    peers = {peer for (transport, peer) in entries if mine[f"{transport}/{peer}"] is not None}
    for group in groups:
        if mine[group_key(group)] is not None:
            peers.update(m for m in group.members if m != world.rank)
    if not peers:
        return set(), set()
    wait_keys(world, [ledger_key(epoch, p) for p in sorted(peers)], epoch)
    theirs = {p: json.loads(world.store.get(ledger_key(epoch, p))) for p in sorted(peers)}
    links = {
        (transport, peer)
        for transport, peer in entries
        if ledgers_match(mine[f"{transport}/{peer}"], theirs.get(peer, {}).get(f"{transport}/{world.rank}"))
    }
    kept_groups = set()
    for group in groups:
        key = group_key(group)
        if mine[key] is None:
            continue
        by_member = {m: (mine[key] if m == world.rank else theirs.get(m, {}).get(key)) for m in group.members}
        if ledgers_agree(by_member):
            kept_groups.add(group.name)
    return links, kept_groups


def wait_keys(world: DeltaWorld, keys: list[str], epoch: int) -> None:
    """Block until every key is in the store (see the module docstring)."""
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
