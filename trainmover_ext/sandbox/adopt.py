"""A standby's kept role: the model it warmed last, adopted by the rank it is promoted into.

Who calls it: :func:`~trainmover_ext.sandbox.shadow.warm_standby` keeps one
role's session (``keep_role``, warmed last so that the standby's peak memory
stays one role's), and a promoted standby (``migration.standby.serve_rank``, the
warm-up benchmark's newcomer) adopts it instead of building the model again.

Contract:

- A kept session was built as the recording's rank, under the replay world:
  model chunks (DDP-wrapped, compiled under ``--tm-compile``), optimizer,
  scheduler and dataset. It *fits* only that rank (:meth:`KeptRole.fits`): every
  value derived from the rank at build time (the vocabulary shard, the seeds,
  the distributed optimizer's shard) is that rank's.
- :func:`adopt` runs once the real world's groups exist (after
  ``initialize_distributed``). It re-points every reference to a replay group
  that is reachable from the kept session to the real group of the same name
  and members, fails if any is left where it cannot be replaced, and returns a ``Session`` for the real
  layout. Compiled code stays valid: dynamo guards on the groups' class, which
  is the job's (see ``sandbox/replay.py``).
- It saves the build, not the state: parameters, optimizer state, scheduler,
  RNG and data position still come from the state transfer, which overwrites
  what the shadow iterations left.
- :class:`KeptRoleUnusable` says why a kept session cannot be adopted (another
  rank, another device, a group without a real counterpart, or one held where it
  cannot be replaced, e.g. in a tuple). :func:`keep_if_fits` and :func:`adopt_or_build`
  are the promotion's two steps: they free parts that do not fit before the
  rank's world is built, and fall back to building the model, saying why.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainmover_ext.errors import KeptRoleUnusable

# Objects the walk never enters: they cannot hold a group the kept session uses.
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    range,
    type,
    types.ModuleType,
    types.CodeType,
    types.BuiltinFunctionType,
    types.FrameType,
    weakref.ref,
    torch.dtype,
    torch.device,
)
WALK_LIMIT = 2_000_000
"""Objects a walk may visit before it gives up (a kept session of the tiny GPT has about 20 000)."""


@dataclass(kw_only=True)
class KeptRole:
    """One warmed role's training parts, kept by a standby for the rank it was recorded at."""

    role: str
    rank: int
    """The job rank the parts were built as (the recording's rank)."""
    session: Any = field(repr=False)
    """The ``trainmover_training.training.Session`` of the shadow iterations (its layout is the replay's)."""
    replay_groups: dict[str, tuple] = field(default_factory=dict, repr=False)
    """Replay group name -> (group, global ranks), for every group the replay world created."""

    def fits(self, rank: int) -> bool:
        """Whether the parts were built for ``rank`` (the same coordinates in every parallel dimension)."""
        return rank == self.rank

    def roots(self) -> list:
        s = self.session
        return [s.model, s.optimizer, s.scheduler]

    def drop(self) -> None:
        """Let go of the parts (the caller collects and trims the heap before it builds another model)."""
        self.session = None
        self.replay_groups.clear()


def release_kept(kept: KeptRole | None) -> None:
    """Free a kept role's parts and give their pages back, before another model is built.

    The warm-up froze everything but the kept parts (``warm_standby``), so one collection frees
    their cycles and walks only what is not frozen; what it leaves is frozen too."""
    from .shadow import release_free_memory

    if kept is not None:
        kept.drop()
    gc.collect()
    release_free_memory()
    gc.freeze()


def real_groups() -> dict[str, tuple]:
    """Name -> (group, global ranks) for every group of this process's (real) world."""
    from torch.distributed import distributed_c10d as c10d

    return {
        name: (pg, list(dist.get_process_group_ranks(pg)))
        for pg, name in c10d._world.pg_names.items()
        if isinstance(pg, dist.ProcessGroup)
    }


def adopt(kept: KeptRole, layout, metrics, rank: int) -> tuple[Any, int]:
    """The kept parts as ``rank``'s ``Session`` on ``layout``, and how many group references were
    re-pointed (see the module doc); raises :class:`KeptRoleUnusable`."""
    from trainmover_training.training import Session

    if kept.session is None:
        raise KeptRoleUnusable("the kept parts were dropped")
    if not kept.fits(rank):
        raise KeptRoleUnusable(f"the kept {kept.role} model was built as rank {kept.rank}, not rank {rank}")
    if kept.session.layout.device != layout.device:
        raise KeptRoleUnusable(
            f"the kept {kept.role} model is on {kept.session.layout.device}, the rank runs on {layout.device}"
        )
    real = real_groups()
    mapping: dict[int, dist.ProcessGroup] = {}
    for name, (old, members) in kept.replay_groups.items():
        new = real.get(name)
        if new is None or new[1] != members:
            found = "none" if new is None else f"ranks {new[1]}"
            raise KeptRoleUnusable(f"replay group {name!r} (ranks {members}) has no real counterpart ({found})")
        mapping[id(old)] = new[0]
    # One walk re-points every reference it can and reports the others: none may be left.
    replaced, stuck = walk(kept.roots(), mapping, rewrite=True)
    if stuck:
        raise KeptRoleUnusable(f"replay groups are held where they cannot be replaced: {sorted(set(stuck))}")
    s = kept.session
    session = Session(
        args=s.args,
        layout=layout,
        model=s.model,
        optimizer=s.optimizer,
        scheduler=s.scheduler,
        dataset=s.dataset,
        forward_step_func=s.forward_step_func,
        metrics=metrics,
    )
    kept.drop()
    return session, replaced


def keep_if_fits(kept: KeptRole | None, rank: int) -> tuple[KeptRole | None, str | None]:
    """Before ``rank``'s world and model are built: the kept parts if they fit ``rank``; otherwise
    they are freed now (never two models in memory). Returns (parts or None, why not kept or None)."""
    if kept is None:
        return None, "no kept model"
    if kept.fits(rank):
        return kept, None
    why = f"the kept {kept.role} model was built as rank {kept.rank}"
    release_kept(kept)
    return None, why


def adopt_or_build(
    kept: KeptRole | None,
    layout,
    metrics,
    rank: int,
    build: Callable[[str], Any],
    why_not: str | None = "no kept model",
) -> tuple[Any, str | None, int]:
    """``rank``'s session: the kept parts adopted (see :func:`adopt`), or ``build(why_not)`` when there
    are none (``why_not`` from :func:`keep_if_fits`) or they cannot be adopted (then freed first).
    Returns (session, None if adopted else why not, group references re-pointed). Call
    :func:`keep_if_fits` before the world is built, and this once its groups exist."""
    if kept is None:
        why_not = why_not or "no kept model"
        return build(why_not), why_not, 0
    try:
        session, replaced = adopt(kept, layout, metrics, rank)
        return session, None, replaced
    except KeptRoleUnusable as exc:
        release_kept(kept)
        return build(str(exc)), str(exc), 0


def walk(roots: Iterable, mapping: dict[int, Any], *, rewrite: bool) -> tuple[int, list[str]]:
    """Visit every object reachable from ``roots`` (not through module globals or classes).

    Each reference to an object whose ``id`` is in ``mapping`` is replaced by ``mapping[id]`` when
    ``rewrite`` (in dicts, lists, instance attributes and closure cells). Returns how many were
    replaced and, per reference that was found but not replaced, the holder's type name (all of
    them when not ``rewrite``)."""
    seen: set[int] = set(mapping)  # never walk into the groups themselves
    stack = list(roots)
    replaced, stuck = 0, []

    def reference(value, holder: str, put) -> None:
        """``holder`` refers to ``value``: re-point it with ``put`` when it is a mapped group, else walk on."""
        nonlocal replaced
        if id(value) not in mapping:
            stack.append(value)
        elif rewrite:
            put(mapping[id(value)])
            replaced += 1
        else:
            stuck.append(holder)

    while stack:
        obj = stack.pop()
        if isinstance(obj, _LEAVES) or id(obj) in seen or isinstance(obj, dist.ProcessGroup):
            continue  # a real group is not walked into: it holds links, not the kept parts
        seen.add(id(obj))
        if len(seen) > WALK_LIMIT:
            raise KeptRoleUnusable(f"the kept parts reach more than {WALK_LIMIT} objects")
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                if id(key) in mapping:
                    stuck.append("dict key")
                reference(value, type(obj).__name__, lambda new, d=obj, k=key: d.__setitem__(k, new))
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                reference(value, "list", lambda new, seq=obj, j=i: seq.__setitem__(j, new))
        elif isinstance(obj, types.CellType):
            try:
                value = obj.cell_contents
            except ValueError:  # an empty cell
                continue
            reference(value, "cell", lambda new, cell=obj: setattr(cell, "cell_contents", new))
        elif isinstance(obj, types.FunctionType):
            stack.extend(obj.__closure__ or ())
            stack.extend((obj.__defaults__, obj.__kwdefaults__, obj.__dict__))
        elif isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
        elif isinstance(attrs := getattr(obj, "__dict__", None), dict) or _slot_names(type(obj)):
            if isinstance(attrs, dict):
                stack.append(attrs)
            for name in _slot_names(type(obj)):  # cached per class
                reference(
                    getattr(obj, name, None),
                    f"{type(obj).__name__}.{name}",
                    lambda new, o=obj, n=name: setattr(o, n, new),
                )
        else:
            # Other containers (tuples, sets, partials, C objects): their referents cannot be set.
            for value in gc.get_referents(obj):
                if id(value) in mapping:
                    stuck.append(type(obj).__name__)
                else:
                    stack.append(value)
    return replaced, stuck


@functools.cache
def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def kept_from(session, role: str, rank: int, groups: Iterable, members: dict[int, list]) -> KeptRole:
    """A :class:`KeptRole` of ``session``, with the replay world's ``groups`` (``members``: id -> global ranks)."""
    named = {}
    for pg in groups:
        name: str | None = getattr(pg, "_group_name", None)
        if name is not None:
            named[name] = (pg, list(members.get(id(pg), [])))
    return KeptRole(role=role, rank=rank, session=session, replay_groups=named)
