"""Detection latency of the control plane: SIGKILL (fast path) and SIGSTOP (lease expiry).

For each trial a fresh job runs on one real etcd: two worker processes and one
warm standby (real processes holding leases), a controller in this process, and
this process acting as the agent that reports child exits. One worker is then
SIGKILLed (or SIGSTOPped); the latency is from the signal to the controller's
committed migration plan (``decided_at``, same host clock).

Prints one table and writes ``{"sigkill_s": {...}, "sigstop_s": {...}, "ttl_s": ...}``.

    python benchmarks/detection.py --json detection.json [--trials 10] [--ttl 1]
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


def one_trial(etcd: EmbeddedEtcd, kv: EtcdKV, job: str, sig: int, ttl: int) -> float:
    space = JobSpace.create(kv, job)
    workers = [spawn_member(etcd.endpoints, job, space.token, f"w{r}", ttl=ttl, host=f"h{r}") for r in range(2)]
    standby = spawn_member(etcd.endpoints, job, space.token, "s0", kind="standby", ttl=ttl, host="h9")
    init_job(space, [RankRecord(rank=r, member_id=f"w{r}", host=f"h{r}", role="middle") for r in range(2)])
    ctl = Controller(space, ControllerConfig(controller_id="bench", ttl_s=2)).start()
    try:
        reporter = ExitWatch(space, workers[1], rank=1, member_id="w1", reporter="agent")
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
        ctl.close()
        reap(*workers, standby)


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "max": max(xs), "min": min(xs), "n": len(xs), "trials": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description="Control-plane detection latency (SIGKILL and SIGSTOP).")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--trials", type=int, default=10, help="trials per signal (default 10)")
    ap.add_argument("--ttl", type=int, default=1, help="member lease TTL in seconds (default 1)")
    args = ap.parse_args()
    out: dict = {"ttl_s": args.ttl}
    with tempfile.TemporaryDirectory() as tmp:
        with EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=Path(tmp) / "etcd")) as etcd:
            kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints))
            for name, sig in (("sigkill_s", signal.SIGKILL), ("sigstop_s", signal.SIGSTOP)):
                out[name] = summary(
                    [one_trial(etcd, kv, f"bench-{name[:7]}-{i}", sig, args.ttl) for i in range(args.trials)]
                )
            kv.close()
    Path(args.json).write_text(json.dumps(out, indent=2))
    goal = {"sigkill_s": "< 0.5 s", "sigstop_s": f"< {2 * args.ttl} s (2x TTL)"}
    print(f"{'signal':<10}{'median s':>10}{'max s':>10}{'trials':>8}  goal")
    for name in ("sigkill_s", "sigstop_s"):
        s = out[name]
        print(f"{name[:-2].upper():<10}{s['median']:>10.3f}{s['max']:>10.3f}{s['n']:>8}  {goal[name]}")
    print(f"lease TTL {args.ttl} s; results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
