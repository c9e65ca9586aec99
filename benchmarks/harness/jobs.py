"""Ready-made job definitions shared by ``make demo``, the tests and the benchmarks.

Keeping the demo job in one place means the README's figures, the benchmarks
and the demo all describe the same training run.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")
RECORDED_PRETRAIN = os.path.join(REPO_ROOT, "benchmarks", "harness", "recorded_pretrain.py")
"""``pretrain_gpt.py`` with the benchmarks' per-process records (``harness.recorder``)."""
DEFAULT_CORPUS_PREFIX = os.path.join(REPO_ROOT, "data", "corpus")
MOE_ARGS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-aux-loss-coeff",
    "1e-2",
]
"""A mixture of experts for the tests and benchmarks: 4 experts per layer, top-2, the all-to-all
dispatcher, expert parallelism 2."""


def model_args(
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    seq: int = 128,
    mbs: int = 2,
    gbs: int = 16,
    iters: int = 30,
    lr: float = 3e-4,
    dropout: float = 0.1,
) -> list[str]:
    """Megatron flags for a small GPT.

    ``dropout`` defaults to Megatron's own 0.1: recovery must be exact with the settings people
    train with. Only comparisons across layouts (TP1 against TP2 draw different masks) turn it off."""
    return [
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        str(heads),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
        "--hidden-dropout",
        str(dropout),
        "--attention-dropout",
        str(dropout),
    ]


def demo_args(data_prefix: str, iters: int = 30) -> list[str]:
    """The demo job: 8 ranks, TP2 x PP2 x DP2, on the bundled corpus."""
    return model_args(iters=iters) + [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--data-path",
        data_prefix + "_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]


def ensure_corpus(prefix: str = DEFAULT_CORPUS_PREFIX) -> str:
    """Build the stdlib-docstring corpus at ``prefix`` unless it exists; returns the prefix."""
    if not os.path.isfile(prefix + "_text_document.idx"):
        subprocess.run(
            [
                sys.executable,
                os.path.join(REPO_ROOT, "scripts", "prepare_data.py"),
                "--stdlib-corpus",
                "--output-prefix",
                prefix,
            ],
            check=True,
        )
    return prefix


def launch_cmd(nproc: int, script_args: list[str], *launch_flags: str, script: str = PRETRAIN) -> list[str]:
    """``trainmover launch`` of ``script`` (``pretrain_gpt.py``) with ``nproc`` ranks on this machine."""
    return [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "launch",
        "--nproc-per-node",
        str(nproc),
        *launch_flags,
        script,
        *script_args,
    ]
