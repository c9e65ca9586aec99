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
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.records import MigrationPlan, migration_key_suffix
from trainmover_ext.errors import StoreError
from trainmover_ext.kv.base import Guard, Put

if TYPE_CHECKING:
    from trainmover_ext.kv.job import JobSpace

logger = logging.getLogger(__name__)


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
    at = time.time() if at is None else at
    key = space.key("migrations", migration_key_suffix(epoch))
    for _ in range(8):
        try:
            entry = space.kv.get(key)
            if entry is None:
                return False
            plan = MigrationPlan.from_bytes(entry.value, key=key)
            plan.steps[step] = at
            if resume_iteration is not None:
                plan.resume_iteration = int(resume_iteration)
            for name, value in (fields or {}).items():
                setattr(plan, name, value)
            if status:
                plan.status = status
            if space.commit([Guard.mod_revision(key, entry.mod_revision)], [Put(key, plan.to_bytes())]):
                return True
        except StoreError as exc:
            logger.warning("could not record step %s of epoch %d: %s", step, epoch, exc)
            return False
    return False


def mark_rank_step(space: JobSpace, epoch: int, step: str, rank: int, **kwargs: Any) -> bool:
    """Record ``<step>/<rank>`` (one rank's part of a move of several), and ``step`` itself once every
    rank of the plan has its own: a plan of one rank gets both at once. ``kwargs`` as in :func:`mark_step`.

    Compare-and-swap like :func:`mark_step`, so the last of several concurrent writers sees the others'
    steps and adds ``step``."""
    at = time.time()
    key = space.key("migrations", migration_key_suffix(epoch))
    for _ in range(16):
        try:
            entry = space.kv.get(key)
            if entry is None:
                return False
            plan = MigrationPlan.from_bytes(entry.value, key=key)
            plan.steps[f"{step}/{rank}"] = at
            if all(f"{step}/{r.rank}" in plan.steps for r in plan.replacement_list()):
                plan.steps[step] = at
            if kwargs.get("resume_iteration") is not None:
                plan.resume_iteration = int(kwargs["resume_iteration"])
            if space.commit([Guard.mod_revision(key, entry.mod_revision)], [Put(key, plan.to_bytes())]):
                return True
        except StoreError as exc:
            logger.warning("could not record step %s/%d of epoch %d: %s", step, rank, epoch, exc)
            return False
    return False
