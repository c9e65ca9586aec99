"""The checkpoint interval that minimises expected lost time: Young's and Daly's optimum.

Contract: pure arithmetic. :func:`young_daly_interval_s` is Daly's higher-order form (J. T. Daly, "A
higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 2006) of Young's
``sqrt(2 delta M)``: ``delta`` the time one save costs the job, ``M`` the mean time between the failures
that roll it back. Used by ``trainmover simulate --checkpoint-young-daly`` and by the chaos benchmark,
which checkpoints its stop-restart baseline at the same optimum.
"""

from __future__ import annotations

import math


def young_daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Seconds of progress between saves that minimise expected lost time, for saves that cost
    ``checkpoint_s`` each and a failure every ``mtbf_s`` on average; ``mtbf_s`` itself once a save costs
    twice the MTBF or more (Daly's bound). Raises ``ValueError`` unless both are positive."""
    if not (checkpoint_s > 0 and mtbf_s > 0 and math.isfinite(checkpoint_s) and math.isfinite(mtbf_s)):
        raise ValueError(f"checkpoint cost {checkpoint_s} and MTBF {mtbf_s} must be positive")
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s
