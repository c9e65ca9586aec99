#!/usr/bin/env python3
"""``make demo``: train the demo GPT on 8 CPU ranks (TP2 x PP2 x DP2) on the bundled corpus.

Builds the corpus on first use (Python stdlib docstrings, offline), then runs
``trainmover launch --nproc-per-node 8 pretrain_gpt.py ...``. Each iteration
prints its loss, ms/iter and tokens/s; a summary closes the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover_ext.jobs import DEFAULT_CORPUS_PREFIX, PRETRAIN, demo_args, ensure_corpus  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40, help="Training iterations.")
    parser.add_argument("--data-prefix", default=DEFAULT_CORPUS_PREFIX, help="Corpus prefix (built if missing).")
    parser.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "demo"), help="Checkpoints and metrics.")
    args = parser.parse_args(argv)
    ensure_corpus(args.data_prefix)
    os.makedirs(args.run_dir, exist_ok=True)
    metrics = os.path.join(args.run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "trainmover_ext.cli", "launch", "--nproc-per-node", "8", PRETRAIN,
           *demo_args(args.data_prefix, args.iters), "--tm-metrics-file", metrics]
    print("demo: 8 CPU ranks, TP2 x PP2 x DP2, GPT 4 layers / hidden 128 / seq 128 on the stdlib-docstring corpus")
    print("$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
