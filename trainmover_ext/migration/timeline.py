"""Per-step timestamps of a migration, written into its plan (``migrations/<e>``).

The controller writes ``detected`` and ``decided``; the migration layer adds
``joined``/``links_rebuilt``, ``transferred``, ``first_iteration`` and moves
``status`` on. ``trainmover status`` and ``trainmover events`` show them.
Updates are compare-and-swap on the key's revision, retried, so concurrent
writers never lose each other's steps; a failed update is logged, never fatal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.records import MigrationPlan, migration_key_suffix
from trainmover_ext.errors import StoreError
from trainmover_ext.kv.base import Guard, Put

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


def _update_plan(space: JobSpace, epoch: int, change: Callable[[MigrationPlan], None], what: str) -> bool:
    """Apply ``change`` to the plan of ``epoch`` by compare-and-swap, retried (up to 16 rounds) so that
    concurrent writers never lose each other's steps. Returns True when written; an unreachable etcd is
    logged (``what`` names the step), never raised."""
    key = space.key("migrations", migration_key_suffix(epoch))
    for _ in range(16):
        try:
            entry = space.kv.get(key)
            if entry is None:
                return False
            plan = MigrationPlan.from_bytes(entry.value, key=key)
            change(plan)
            if space.commit([Guard.mod_revision(key, entry.mod_revision)], [Put(key, plan.to_bytes())]):
                return True
        except StoreError as exc:
            logger.warning("could not record step %s of epoch %d: %s", what, epoch, exc)
            return False
    return False


def mark_step(
    space: JobSpace,
    epoch: int,
    step: str,
    *,
    only_if: bool = True,
    status: str | None = None,
    at: float | None = None,
    resume_iteration: int | None = None,
    fields: dict[str, Any] | None = None,
) -> bool:
    """Record ``step`` at ``at`` (default now) in the plan of ``epoch``, optionally with the
    resume iteration, other plan ``fields`` and a new status. Returns True when written."""
    if not only_if:
        return False
    when = time.time() if at is None else at

    def change(plan: MigrationPlan) -> None:
        plan.steps[step] = when
        if resume_iteration is not None:
            plan.resume_iteration = int(resume_iteration)
        for name, value in (fields or {}).items():
            setattr(plan, name, value)
        if status:
            plan.status = status

    return _update_plan(space, epoch, change, step)


def mark_rank_step(space: JobSpace, epoch: int, step: str, rank: int, *, resume_iteration: int | None = None) -> bool:
    """Record ``<step>/<rank>`` (one rank's part of a move of several), and ``step`` itself once every
    rank of the plan has its own: a plan of one rank gets both at once. The last of several concurrent
    writers sees the others' steps (compare-and-swap) and adds ``step``."""
    when = time.time()

    def change(plan: MigrationPlan) -> None:
        plan.steps[f"{step}/{rank}"] = when
        if all(f"{step}/{r.rank}" in plan.steps for r in plan.replacement_list()):
            plan.steps[step] = when
        if resume_iteration is not None:
            plan.resume_iteration = int(resume_iteration)

    return _update_plan(space, epoch, change, f"{step}/{rank}")
