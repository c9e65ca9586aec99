"""The sandbox tests' tiny job: PP=3, recorded by real forked rank processes.

The job's ranks are real processes forked from the test process (which has
already imported torch and megatron), training real megatron-core on gloo
through the same ``build_session``/``train_step`` as ``pretrain``.
"""

from __future__ import annotations

from dataclasses import dataclass

ITERS = 3
RECORD_ITERS = 2


def pp3_argv(corpus: str, *extra: str) -> list[str]:
    """3 layers, hidden 64, seq 32, PP=3 (one layer per stage), 4 micro-batches."""
    from harness.jobs import model_args

    return model_args(layers=3, hidden=64, heads=4, seq=32, mbs=1, gbs=4, iters=10, lr=1e-3) + [
        "--pipeline-model-parallel-size",
        "3",
        "--data-path",
        corpus + "_text_document",
        *extra,
    ]


@dataclass
class RecordedJob:
    argv: list[str]
    record_dir: str
    ranks: dict
    """rank -> what ``harness.job_rank`` returned (steps with losses and digests, hooks, RSS)."""

    def recorder(self, role: str) -> dict:
        return next(r for r in self.ranks.values() if r["role"] == role)


def record_job(tmp_path, argv: list[str], timeout: float = 300, comm: str = "gloo") -> RecordedJob:
    from harness import sandbox as harness

    record_dir = str(tmp_path / "recordings")
    store = harness.host_store()
    kids = harness.fork_children(
        {r: (harness.job_rank, r, 3, store.port, argv, record_dir, RECORD_ITERS, ITERS, True, comm) for r in range(3)}
    )
    return RecordedJob(argv=argv, record_dir=record_dir, ranks=kids.results(timeout))


def warm_one_role(argv: list[str], record_dir: str, role: str) -> dict:
    """Child: warm ``role`` from ``record_dir``; returns the error it raised (type and message), if any."""
    from harness import sandbox as harness
    from trainmover_ext.errors import TrainMoverError
    from trainmover_ext.sandbox.recording import Recording
    from trainmover_ext.sandbox.shadow import warm_up

    try:
        result = warm_up(harness.parse_job_args(argv, 3), role, Recording(record_dir, role))
    except TrainMoverError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "result": result.to_dict()}


def copy_recording(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_index(record_dir: str, role: str, edit) -> None:
    """Rewrite ``<role>/index.json`` through ``edit(index)`` (the data file is left as is)."""
    import json
    import os

    path = os.path.join(record_dir, role, "index.json")
    with open(path) as f:
        index = json.load(f)
    edit(index)
    with open(path, "w") as f:
        json.dump(index, f)
