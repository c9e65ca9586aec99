"""What the distributed optimizer's host-memory mirror costs: iteration time with it against without.

Each round runs the same job twice, side by side in time: ``--tm-optimizer-mirror on`` and ``off``
(both under ``--trainmover`` with ``--use-distributed-optimizer``, bf16, 8 ranks, no standby), the
order alternating between rounds so that machine noise hits both. A round's ratio is the median
steady iteration with the mirror over the median without; the figure is the median of the rounds'
ratios with their range. Layouts: TP2 x PP2 x DP2 (the worst case: the mirror's traffic equals a
data-parallel step's) and TP1 x PP2 x DP4.

Memory: ``host_bytes_per_rank`` is what a rank's mirror holds in host memory (its ward's shard twice
and its own staged copy), as the ranks print it; ``device_bytes_extra`` is the accelerator memory it
allocates, 0 by construction (every buffer is host memory; on this CPU machine there is no device).

    python benchmarks/mirror.py --json benchmarks/results/mirror.json [--rounds 3] [--iters 30]

Writes ``{"overhead": [{dp, layout, ratio, ratio_range, mirror_it_s, plain_it_s, rounds}],
"host_bytes_per_rank", "shard_bytes_sent_per_step", "device_bytes_extra", "command", "measured_at"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import measured_at, print_table, write_json  # noqa: E402

from harness.jobs import REPO_ROOT, ensure_corpus, launch_cmd, model_args  # noqa: E402

LAYOUTS = {2: ("2", "2"), 4: ("1", "2")}
"""Data-parallel size -> (tensor, pipeline) parallel sizes of an 8-rank job."""
WARMUP = 5
"""Iterations left out of the median (start-up, allocator, first exchange)."""
SAID = re.compile(r"mirror holds (\d+) bytes of host memory .*? sends (\d+) bytes")


def _run(dp: int, mirror: bool, args, workdir: str, tag: str) -> tuple[list[float], list[tuple[int, int]]]:
    """One job; returns its steady iterations' ``iteration_s`` and each rank's (host bytes, bytes sent)."""
    tp, pp = LAYOUTS[dp]
    corpus = ensure_corpus(os.path.join(workdir, "corpus"))
    metrics = os.path.join(workdir, f"{tag}.metrics.jsonl")
    script = model_args(iters=args.iters) + [
        "--tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
        "--data-path",
        corpus + "_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
        "--bf16",
        "--use-distributed-optimizer",
        "--trainmover",
        "--tm-standbys",
        "0",
        "--tm-optimizer-mirror",
        "on" if mirror else "off",
        "--tm-metrics-file",
        metrics,
    ]
    cmd = launch_cmd(8, script, "--run-dir", os.path.join(workdir, tag + ".run"))
    log = os.path.join(workdir, tag + ".log")
    with open(log, "w") as out:
        code = subprocess.run(
            cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout, env=os.environ
        ).returncode
    if code != 0:
        raise RuntimeError(f"job {tag} exited {code}; see {log}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = {r["iteration"]: r["iteration_s"] for r in records if r.get("event") == "iteration"}
    said = [(int(a), int(b)) for a, b in SAID.findall(Path(log).read_text())]
    if mirror and len(said) != 8:
        raise RuntimeError(f"job {tag}: {len(said)} of 8 ranks said what their mirror holds; see {log}")
    return [times[i] for i in sorted(times) if i > WARMUP], said


def measure(args) -> dict:
    workdir = tempfile.mkdtemp(prefix="mirror_bench_")
    rows, said_all = [], []
    for dp in args.dp:
        rounds = []
        for rnd in range(args.rounds):
            order = (True, False) if rnd % 2 == 0 else (False, True)
            got = {}
            for mirror in order:
                times, said = _run(dp, mirror, args, workdir, f"dp{dp}_{'on' if mirror else 'off'}_{rnd}")
                got[mirror] = statistics.median(times)
                said_all += [(dp, *s) for s in said]
            rounds.append(
                dict(
                    mirror_it_s=round(got[True], 4),
                    plain_it_s=round(got[False], 4),
                    ratio=round(got[True] / got[False], 4),
                )
            )
            print(f"  dp={dp} round {rnd}: {rounds[-1]}", flush=True)
        ratios = [r["ratio"] for r in rounds]
        tp, pp = LAYOUTS[dp]
        rows.append(
            dict(
                dp=dp,
                layout=f"TP{tp}.PP{pp}.DP{dp}, bf16, --use-distributed-optimizer",
                ratio=round(statistics.median(ratios), 4),
                ratio_range=[min(ratios), max(ratios)],
                mirror_it_s=round(statistics.median(r["mirror_it_s"] for r in rounds), 4),
                plain_it_s=round(statistics.median(r["plain_it_s"] for r in rounds), 4),
                runs=len(rounds),
                rounds=rounds,
            )
        )
    by_dp = {
        dp: dict(
            host_bytes_per_rank=max(h for d, h, _ in said_all if d == dp),
            shard_bytes_sent_per_step=max(s for d, _, s in said_all if d == dp),
        )
        for dp in args.dp
    }
    return dict(
        overhead=rows,
        host_bytes_per_rank={str(dp): v["host_bytes_per_rank"] for dp, v in by_dp.items()},
        shard_bytes_sent_per_step={str(dp): v["shard_bytes_sent_per_step"] for dp, v in by_dp.items()},
        device_bytes_extra=0,
        goal="ratio <= 1.03 at DP=4 on the demo model",
        command=" ".join(["python", "benchmarks/mirror.py", *sys.argv[1:]]),
        measured_at=measured_at(),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--rounds", type=int, default=3, help="rounds per layout (each runs both jobs); default 3")
    p.add_argument("--iters", type=int, default=30, help="iterations per job; default 30")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4], choices=sorted(LAYOUTS), help="data-parallel sizes")
    p.add_argument("--timeout", type=float, default=900, help="seconds one job may take; default 900")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    payload = measure(args)
    print_table(
        "Distributed-optimizer mirror: iteration time with it over without (median of rounds)",
        [(r["dp"], r["layout"], r["ratio"], r["ratio_range"], r["runs"]) for r in payload["overhead"]],
        ("dp", "layout", "ratio", "range", "runs"),
    )
    print(f"host bytes per rank: {payload['host_bytes_per_rank']}; accelerator bytes: {payload['device_bytes_extra']}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
