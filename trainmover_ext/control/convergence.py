"""After an abandoned iteration: pick the resume iteration and the state copies (pure logic).

The controller alone decides this (:func:`~trainmover_ext.control.decide.decide` turns it into a
``convergence/<e>`` record); ranks only report what they hold and carry the record out.

Every live rank reports the number of optimizer steps it completed. Ranks in
different data-parallel replicas of one parameter shard may differ by one step
(a kill during the optimizer step lets some replicas finish). The job resumes
at ``k = min over shards of (max over a shard's live replicas)``: the newest
iteration that every shard completed somewhere. A rank whose iteration is not
``k``, and every joiner, copies its state from a live replica of its shard that
is at ``k``: the one nearest it in the data-parallel ring, so that the copy
runs over a communicator link that exists already. When some shard has no such
replica (data-parallel size 1, the distributed optimizer, or every replica
lost), every rank falls back to the latest checkpoint.

A shard is given by its *ring*: the ranks holding the same state, in data-parallel
order (:meth:`GridShape.ring_of`, or a rank record's ``replicas`` plus the rank
itself). With the distributed optimizer every rank's ring is just itself: its
optimizer shard exists nowhere else.

Unit-tested without I/O; see tests/control/test_convergence.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class GridShape:
    """The TP x PP x DP grid in megatron's rank order: tp fastest, then dp, then pp (megatron's
    default), or tp, pp, dp with ``pp_before_dp`` (``--use-tp-pp-dp-mapping``)."""

    tp: int
    pp: int
    dp: int
    pp_before_dp: bool = False
    ep: int = 1
    """Expert parallelism (MoE): the experts are split over ``ep`` consecutive data-parallel ranks, so
    a rank's replicas are the data-parallel ranks with its EP rank (megatron's expert-data-parallel
    group; expert tensor parallelism equals TP). Only with the default rank order."""
    cp: int = 1
    """Context parallelism: megatron puts it right after TP (``tp-cp-ep-dp-pp``); the ranks of one
    context-parallel group hold the same parameters, so a rank's replicas span data and context
    parallelism (megatron's ``dp-cp`` group)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def shard_of(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, ep_rank): ranks with the same shard hold the same parameters."""
        tp_rank = rank % self.tp
        rest = rank // (self.tp * self.cp)  # the context-parallel rank is in between
        pp_rank = rest % self.pp if self.pp_before_dp else rest // self.dp
        dp_rank = rest // self.pp if self.pp_before_dp else rest % self.dp
        return tp_rank, pp_rank, dp_rank % self.ep

    def replicas_of(self, rank: int) -> list[int]:
        """Every rank of ``rank``'s shard, itself included, ascending."""
        shard = self.shard_of(rank)
        return [r for r in range(self.world_size) if self.shard_of(r) == shard]

    def rings(self, replicas_share_state: bool = True) -> dict[int, list[int]]:
        """Every rank's shard ring (see the module docstring); with the distributed optimizer
        (``replicas_share_state=False``) each rank's ring is itself."""
        return {r: self.replicas_of(r) if replicas_share_state else [r] for r in range(self.world_size)}


@dataclass(kw_only=True)
class ConvergencePlan:
    """Where every rank resumes and which state copies bring it there."""

    resume_iteration: int
    """Iteration (completed optimizer steps) every rank holds after the copies."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source rank, target rank) pairs, sorted by target."""
    from_checkpoint: bool = False
    """True: no replica can serve some shard; every rank loads the latest checkpoint instead."""
    reason: str = ""
    mirror: bool = False
    """The copies come from holders' mirrors of the targets' optimizer shards (each source holds its
    target's), and every rank rebuilds its model parameters from the main parameters afterwards."""


def plan_mirror_convergence(
    holders: dict[int, int],
    iterations: dict[int, int],
    shards: dict[int, int],
    mirrors: dict[int, list[int]],
    joiners: set[int],
    staged: dict[int, list[int]] | None = None,
) -> ConvergencePlan:
    """The resume point with the distributed optimizer's host-memory mirror.

    ``holders`` maps every rank of the job to the rank holding its shard's mirror; ``iterations``
    each live stayer with usable state to its completed steps; ``shards`` the same stayers to the
    boundary their own optimizer shard is at (one past ``iterations`` when the step ran on it and the
    iteration then failed); ``mirrors`` each live reporting holder to the iterations of its ward's
    shard it holds committed; ``joiners`` the ranks served by new processes; ``staged`` each stayer to
    the boundaries of its own two last staged copies (what it sent its holder last).

    A rank is *level* at ``k`` when it completed ``k`` steps and its shard is at ``k``; otherwise its
    own staged copy of ``k`` (a copy ``(r, r)``: no traffic) or its holder's committed copy of ``k``
    brings it there. The own copy is what saves a rank whose holder died while the rank's step of the
    next iteration ran (its shard moved on in place). The job resumes at the newest ``k`` every rank
    can reach, one way or the other; when there is none (a holder lost with its ward, or a ward whose
    newest copy never landed while its holder's older one is too old), every rank falls back to the
    checkpoint, and the reason names the shard.
    """
    missing = set(holders) - set(iterations) - joiners
    if missing:
        raise ValueError(f"ranks {sorted(missing)} are neither reporting stayers nor joiners")

    def level(rank: int, k: int) -> bool:
        return iterations.get(rank) == k and shards.get(rank) == k

    own = staged or {}

    def source(rank: int, k: int) -> int | None:
        """Who restores ``rank`` to ``k``: itself (level, or its staged copy), its holder, or nobody."""
        if level(rank, k) or k in own.get(rank, []):
            return rank
        holder = holders[rank]
        return holder if holder != rank and k in mirrors.get(holder, []) else None

    candidates = sorted({*iterations.values(), *(i for held in mirrors.values() for i in held)}, reverse=True)
    for k in candidates:
        sources = {r: source(r, k) for r in holders}
        if all(src is not None for src in sources.values()):
            copies = [(src, r) for r, src in sorted(sources.items()) if src is not None and not level(r, k)]
            return ConvergencePlan(resume_iteration=k, copies=copies, mirror=True)
    lost = sorted(r for r in holders if r in joiners or iterations.get(r) != shards.get(r))
    why = "; ".join(
        f"rank {r}'s holder rank {holders[r]} "
        + (f"holds iterations {mirrors[holders[r]]}" if holders[r] in mirrors else "was lost or holds nothing")
        for r in lost[:4]
    )
    return ConvergencePlan(
        resume_iteration=-1,
        from_checkpoint=True,
        reason=f"no iteration that every optimizer shard reaches from its own rank or its mirror ({why})",
    )


def plan_convergence(rings: dict[int, list[int]], iterations: dict[int, int], joiners: set[int]) -> ConvergencePlan:
    """Decide the resume point.

    ``rings`` maps every rank of the job to its shard's ring (itself included, data-parallel
    order); ``iterations`` maps each live stayer rank to its completed steps; ``joiners`` are
    ranks served by new processes (no state).
    """
    missing = set(rings) - set(iterations) - joiners
    if missing:
        raise ValueError(f"ranks {sorted(missing)} are neither reporting stayers nor joiners")
    shard_of = {rank: tuple(ring) for rank, ring in rings.items()}
    best: dict[tuple[int, ...], int] = {}
    for rank, it in iterations.items():
        shard = shard_of[rank]
        best[shard] = max(best.get(shard, -1), it)
    lost = sorted(set(shard_of.values()) - set(best))
    if lost:
        return ConvergencePlan(
            resume_iteration=-1,
            from_checkpoint=True,
            reason=f"no live replica of the state of rank(s) {sorted(r for s in lost for r in s)}",
        )
    k = min(best.values())
    copies = []
    for target in sorted(rings):
        if target not in joiners and iterations[target] == k:
            continue
        sources = [r for r in rings[target] if r in iterations and iterations[r] == k]
        if not sources:
            return ConvergencePlan(
                resume_iteration=-1,
                from_checkpoint=True,
                reason=f"no live replica of rank {target}'s state is at iteration {k}",
            )
        copies.append((nearest_in_ring(rings[target], target, sources), target))
    return ConvergencePlan(resume_iteration=k, copies=copies)


def nearest_in_ring(ring: list[int], target: int, sources: list[int]) -> int:
    """The source nearest ``target`` along ``ring`` (the data-parallel group in rank order), lowest rank on a
    tie: a ring neighbour already holds a communicator link to the target, which the copy then uses."""
    at = {rank: i for i, rank in enumerate(ring)}
    n = len(ring)

    def distance(rank: int) -> int:
        d = abs(at[rank] - at[target])
        return min(d, n - d)

    return min(sources, key=lambda rank: (distance(rank), rank))
