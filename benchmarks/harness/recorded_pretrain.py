"""``pretrain_gpt.py`` with the benchmark's per-process records (:mod:`harness.recorder`).

The benchmarks give the launcher this script in place of ``pretrain_gpt.py``, with the same flags: it
installs the records when ``TM_BENCH_RECORDS`` is set (a refill standby waits under the deferred-refill
drill), then runs ``pretrain_gpt.py`` as ``__main__``. Forked, spawned and pre-forked processes all
run it, ranks and standbys alike.
"""

from __future__ import annotations

import os
import runpy
import sys

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(os.path.dirname(BENCHMARKS), "pretrain_gpt.py")

if __name__ == "__main__":
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    from harness import recorder

    recorder.defer_refill(sys.argv[1:])
    recorder.install_from_env()
    sys.argv[0] = PRETRAIN
    runpy.run_path(PRETRAIN, run_name="__main__")
