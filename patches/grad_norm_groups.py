"""Keep a joiner's first optimizer step in step with the stayers' (megatron-core 0.19 and later).

megatron-core 0.19 added separate gradient-norm groups (MTP). Whether a group has
parameters anywhere is found by an all-reduce over the grad-stats group, run in
an optimizer's first clipped ``step()`` and then cached on the optimizer. A
joiner builds a fresh optimizer, so its first step runs that all-reduce while
the stayers, whose answer is cached, run their gradient-norm all-reduce: the
two pair up and the job hangs (or sums a flag into a norm). The state transfer
does not carry the cache. With this patch the answer is asked for on every
clipped step, on every rank, so each rank issues the same collectives: one
all-reduce of one int per separate group per step.

Installed on every device (the mismatch is not CPU-only), where
``MegatronOptimizer.has_grad_norm_group`` exists: megatron-core 0.16 has none
and is left alone. A newer source without the snippet fails at install time.
"""

from __future__ import annotations

from ._rewrite import rewrite

# The cache lookup; replaced by an always-true test, so the all-reduce below it runs on every call.
_CACHED = [("if grad_norm_group not in cache:", "if True:  # trainmover: asked every step, see patches/")]

TARGETS = ["MegatronOptimizer.has_grad_norm_group", "ChainedOptimizer.has_grad_norm_group"]


def install() -> list[str]:
    """Make ``has_grad_norm_group`` ask its group on every call; returns what was patched."""
    from megatron.core.optimizer import optimizer

    if not hasattr(optimizer.MegatronOptimizer, "has_grad_norm_group"):
        return []
    for qualname in TARGETS:
        rewrite(optimizer.__name__, qualname, _CACHED)
    return [f"{optimizer.__name__}.{qualname}" for qualname in TARGETS]
