"""The baselines ``benchmarks/downtime.py`` measures TrainMover against, side by side in one run:
stop-restart from the latest checkpoint, and NVIDIA resiliency-ext's in-process restart."""

from __future__ import annotations

import os
import shutil
import tempfile


def restart_baseline(data_prefix: str, iters: int, method: str, job_args: list[str]) -> dict:
    """One stop-restart trial of the job (``benchmarks/restart_baseline.py``): ranks restart with ``method``
    (spawn: fresh interpreters; fork: from the warm agent) and resume from the latest checkpoint."""
    from restart_baseline import one_trial

    workdir = tempfile.mkdtemp(prefix="tm_restart_")
    try:
        return one_trial(
            workdir,
            data_prefix,
            iters,
            save_interval=5,
            kill_after=2,
            job_args=job_args,
            restart_start_method=method,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def nvrx_baseline(args, workdir: str, ref: dict[int, float]) -> tuple[dict | None, str | None]:
    """``(result, None)`` from ``benchmarks/nvrx_inprocess.py`` (the same job, victim and iteration), or
    ``(None, reason)`` when skipped. A failed nvrx run raises, and its logs stay under ``workdir/nvrx``."""
    if args.skip_nvrx:
        reason = "--skip-nvrx"
    else:
        from nvrx_inprocess import measure, unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            print(
                f"NVIDIA resiliency-ext in-process restart, SIGKILL of rank {args.victim} after iteration "
                f"{args.at_iteration} ...",
                flush=True,
            )
            nvrx_dir = os.path.join(workdir, "nvrx")
            os.makedirs(nvrx_dir)
            return measure(
                args.data_prefix, args.iters, args.victim, args.at_iteration, reference=ref, workdir=nvrx_dir
            ), None
    print(f"nvrx_inprocess_s skipped: {reason}", flush=True)
    return None, reason
