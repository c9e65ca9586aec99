"""Detection latency of the control plane: SIGKILL (exit), SIGSTOP (heartbeat) and SIGSTOP (lease expiry).

For each trial a fresh job runs on one real etcd: two worker processes and one
warm standby (real processes holding leases), a controller in this process, and
this process acting as the agent that reports child exits and, for ``sigstop_hang_s``,
fences a frozen child (``launch.heartbeat``: the workers beat, and a worker silent for
``--hang-timeout`` that used no CPU meanwhile is killed and reported). One worker is then
SIGKILLed (or SIGSTOPped); the latency is from the signal to the controller's
committed migration plan (``decided_at``, same host clock). ``sigstop_s`` runs without
the heartbeat (as ``--tm-hang-timeout 0``): only the lease tells.

Prints one table and writes ``{"sigkill_s": {...}, "sigstop_hang_s": {...}, "sigstop_s": {...},
"ttl_s": ..., "hang_timeout_s": ...}``.

    python benchmarks/detection.py --json detection.json [--trials 10] [--ttl 1] [--hang-timeout 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.member import (  # noqa: E402
    ExitWatch,  # noqa: E402
    HangFence,
    reap,
    spawn_member,
)
from trainmover_ext.control.controller import Controller, ControllerConfig  # noqa: E402
from trainmover_ext.control.membership import init_job  # noqa: E402
from trainmover_ext.control.records import RankRecord  # noqa: E402
from trainmover_ext.control.view import read_view  # noqa: E402
from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig  # noqa: E402
from trainmover_ext.kv import EtcdClientConfig, EtcdKV  # noqa: E402
from trainmover_ext.kv.job import JobSpace  # noqa: E402
from trainmover_ext.launch.heartbeat import DEFAULT_HANG_TIMEOUT_S, HangWatch  # noqa: E402


def one_trial(etcd: EmbeddedEtcd, kv: EtcdKV, job: str, sig: int, ttl: int, watch: HangWatch) -> float:
    space = JobSpace.create(kv, job)
    workers = [
        spawn_member(etcd.endpoints, job, space.token, f"w{r}", ttl=ttl, host=f"h{r}", env=watch.env_for(f"{job}-w{r}"))
        for r in range(2)
    ]
    standby = spawn_member(etcd.endpoints, job, space.token, "s0", kind="standby", ttl=ttl, host="h9")
    init_job(space, [RankRecord(rank=r, member_id=f"w{r}", host=f"h{r}", role="middle") for r in range(2)])
    ctl = Controller(space, ControllerConfig(controller_id="bench", ttl_s=2)).start()
    fence = None
    try:
        reporter = ExitWatch(space, workers[1], rank=1, member_id="w1", reporter="agent")
        if watch.enabled:
            fence = HangFence(space, watch, workers[1], f"{job}-w1", rank=1, member_id="w1", reporter="agent")
        time.sleep(0.2)  # let the controller win its election and settle
        t0 = time.time()
        os.kill(workers[1].pid, sig)
        deadline = time.monotonic() + 6 * ttl + 5
        while time.monotonic() < deadline:
            view = read_view(space)
            if view.last_plan is not None:
                return view.last_plan.decided_at - t0
            time.sleep(0.005)
        raise RuntimeError(f"no decision within {6 * ttl + 5}s after signal {sig}")
    finally:
        reporter.expected_exit()  # the clean-up kill below is not a failure to report
        if fence is not None:
            fence.close()
        ctl.close()
        reap(*workers, standby)


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "max": max(xs), "min": min(xs), "n": len(xs), "trials": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description="Control-plane detection latency (SIGKILL and SIGSTOP).")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--trials", type=int, default=10, help="trials per signal (default 10)")
    ap.add_argument("--ttl", type=int, default=1, help="member lease TTL in seconds (default 1)")
    ap.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT_S,
        help=f"the agent's hang timeout for sigstop_hang_s, as --tm-hang-timeout (default {DEFAULT_HANG_TIMEOUT_S:g})",
    )
    args = ap.parse_args()
    if args.hang_timeout <= 0:
        ap.error("--hang-timeout must be positive (sigstop_s already measures the lease alone)")
    out: dict = {"ttl_s": args.ttl, "hang_timeout_s": args.hang_timeout}
    series = (
        ("sigkill_s", signal.SIGKILL, 0.0),
        ("sigstop_hang_s", signal.SIGSTOP, args.hang_timeout),
        ("sigstop_s", signal.SIGSTOP, 0.0),
    )
    with tempfile.TemporaryDirectory() as tmp:
        with EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=Path(tmp) / "etcd")) as etcd:
            kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints))
            for name, sig, hang_timeout in series:
                watch = HangWatch(hang_timeout)
                try:
                    out[name] = summary(
                        [
                            one_trial(etcd, kv, f"bench-{name.replace('_', '-')}-{i}", sig, args.ttl, watch)
                            for i in range(args.trials)
                        ]
                    )
                finally:
                    watch.close()
            kv.close()
    Path(args.json).write_text(json.dumps(out, indent=2))
    goal = {
        "sigkill_s": "< 0.5 s",
        "sigstop_hang_s": f"< {args.hang_timeout + 0.25:g} s (hang timeout + 0.25 s)",
        "sigstop_s": f"< {2 * args.ttl} s (2x TTL)",
    }
    labels = {"sigkill_s": "SIGKILL", "sigstop_hang_s": "SIGSTOP (heartbeat)", "sigstop_s": "SIGSTOP (lease)"}
    print(f"{'signal':<20}{'median s':>10}{'max s':>10}{'trials':>8}  goal")
    for name, _, _ in series:
        s = out[name]
        print(f"{labels[name]:<20}{s['median']:>10.3f}{s['max']:>10.3f}{s['n']:>8}  {goal[name]}")
    print(f"lease TTL {args.ttl} s, hang timeout {args.hang_timeout:g} s; results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
