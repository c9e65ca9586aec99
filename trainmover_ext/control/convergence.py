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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def shard_of(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank): ranks with the same shard hold the same parameters."""
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp if self.pp_before_dp else rank // (self.tp * self.dp)
        return tp_rank, pp_rank

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
