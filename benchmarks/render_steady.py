"""The README's and docs' steady-state figures, rendered for ``render_figures.py``: the communicator's
training ratio and replacements, detection, stragglers, rebalancing, the control plane's load and the
distributed optimizer's mirror (pure functions of the committed JSON)."""

from __future__ import annotations

import statistics

from render_cells import COMMANDS, MIN_RUNS, NOT_YET, num, spread_cell, stamp, unmeasured_table, values_cell, yes


def comm_table(data: dict | None, *, full: bool = True) -> list[str]:
    """Steady-state speed with --trainmover over the same job without it, and what a replacement rebuilds."""
    head = [
        "| job | s/iteration with / without TrainMover | ratio: median (range, runs) | ratio with TrainMover on "
        "torch's own groups (`--tm-comm native`) |",
        "|---|---|---|---|",
    ]
    training = (data or {}).get("training") or []
    if not training:
        return unmeasured_table(head, "comm")
    rows = []
    for r in training:
        lo, hi = r["ratio_range"]
        note = "" if r["runs"] >= MIN_RUNS else f"; a figure needs {MIN_RUNS}"
        native = "-"
        if r.get("ratio_native_comm") is not None:
            nlo, nhi = r["ratio_native_comm_range"]
            native = f"{num(r['ratio_native_comm'])} ({num(nlo)}-{num(nhi)})"
        rows.append(
            f"| {r['ranks']} ranks, {r['model']} model, {r['layout']} | {num(r['trainmover_it_s'])} / "
            f"{num(r['plain_it_s'])} | **{num(r['ratio'])}** ({num(lo)}-{num(hi)}, {r['runs']} runs{note}) | "
            f"{native} |"
        )
    out = head + rows
    replacement = data.get("replacement") or []
    if replacement and full:
        out += [
            "",
            "| ranks | groups a replacement of one rank rebuilds | their members | WORLD rebuilt |",
            "|---|---|---|---|",
        ]
        for r in replacement:
            how = "simulated (megatron's groups, the real rule)" if r.get("simulated") else "measured"
            world = "yes" if r["world_rebuilt"] else "no"
            out.append(f"| {r['ranks']} ({how}) | {r['groups_rebuilt']} | {r['members_rebuilt']} | {world} |")
    return out + ["", stamp(data)]


DETECTION_LABELS = {
    "sigkill": "SIGKILL",
    "sigstop": "SIGSTOP (frozen process)",
    "hang_compute": "main thread blocked in forward",
    "hang_collective": "main thread blocked after issuing its all-reduce (peers wait in a collective)",
    "etcd_pause": "etcd stopped for 3 lease TTLs",
    "load": "two CPU spinners beside the job for `--load-iters` iterations",
}


def detection_table(data: dict | None) -> list[str]:
    """Per fault type: fault to committed plan, whether the culprit alone was named, who else was replaced."""
    head = [
        "| fault | fault to plan: median (range, trials) | culprit named | ranks replaced that nobody failed "
        "| trained to the end | goal |",
        "|---|---|---|---|---|---|",
    ]
    faults = (data or {}).get("faults") or []
    if not faults:
        return unmeasured_table(head, "detection")
    rows = []
    for f in faults:
        lat = values_cell(f["latencies_s"], " s") if f["latencies_s"] else "-"
        rows.append(
            f"| {DETECTION_LABELS.get(f['kind'], f['kind'])} | {lat} | {yes(f['right_rank'])} | "
            f"{f['false_replacements']} ({f['trials']} trial{'s' if f['trials'] != 1 else ''}) | "
            f"{yes(f['trained_on'])} | {f['goal']} |"
        )
    return head + rows + ["", stamp(data)]


def detection_line(data: dict | None) -> list[str]:
    """The README's one paragraph of :func:`detection_table` (medians; the table is in docs/benchmarks.md)."""
    faults = {f["kind"]: f for f in (data or {}).get("faults") or []}
    if not faults:
        return [f"**Detection**: {NOT_YET} (`{COMMANDS['detection']}`)."]

    def med(kind: str) -> str:
        f = faults.get(kind)
        return num(f["median_s"], " s") if f and f["median_s"] is not None else "-"

    named = all(f["right_rank"] for f in faults.values() if f["right_rank"] is not None)
    false = sum(f["false_replacements"] for f in faults.values())
    return [
        f"**Detection** (4-rank jobs at every default, fault to committed plan, medians): SIGKILL {med('sigkill')},",
        f"SIGSTOP {med('sigstop')}, a main thread blocked in forward {med('hang_compute')}, or after issuing an",
        f"all-reduce its peers then wait in {med('hang_collective')}; the culprit named in "
        f"{'every' if named else '**not every**'} trial; {false} ranks replaced that nobody failed,",
        "etcd stopped for 3 TTLs and two CPU spinners included ([table](docs/benchmarks.md)).",
    ]


def straggler_lines(data: dict | None) -> list[str]:
    """A straggler: the throughput it costs with no action and with TrainMover moving it (docs/benchmarks.md)."""
    if data is None:
        return [f"**A straggler**: {NOT_YET} (`{COMMANDS['straggler']}`)."]
    job = data.get("config", {})
    trials, named = len(data.get("trials", [])), data["detected_after_iterations"].get("n", 0)
    missed = f" (not named in {trials - named} of {trials} runs)" if named < trials else ""
    return [
        f"**A straggler** (rank 1 of a 4-rank job computing {job.get('factor')}x slower from iteration "
        f"{job.get('start')} of {job.get('iters')}; throughput over that span against the run without it): no action "
        f"loses {spread_cell(data['no_action']['loss_pct'], ' %')}, TrainMover moving it "
        f"{spread_cell(data['trainmover']['loss_pct'], ' %')} (goal <= 5 %); named "
        f"{spread_cell(data['detected_after_iterations'], '')} iterations after the slowdown began{missed}; "
        f"{data['false_positives']} ranks named that were not slow; losses bit-identical: "
        f"{yes(data['bit_identical'])}. {stamp(data)}",
    ]


def rebalance_lines(data: dict | None) -> list[str]:
    """Scheduled rebalancing: the throughput its planned moves cost (docs/benchmarks.md)."""
    if data is None:
        return [f"**Rebalancing**: {NOT_YET} (`{COMMANDS['rebalance']}`)."]
    job = data.get("config", {})
    return [
        f"**Rebalancing** (the same 4-rank job, {job.get('iters')} iterations, a planned move every "
        f"{job.get('interval_s')} s rotating the ranks through the standby pool, against the run without): "
        f"{spread_cell(data['loss_pct'], ' %')} of throughput (goal < 3 %) for "
        f"{spread_cell(data['rebalances'], '')} moves a run, {spread_cell(data.get('lost_per_move_s'))} lost per "
        f"move; losses bit-identical: {yes(data['bit_identical'])}. "
        + (
            f"Inside the rebalanced run alone (each move's pause and the 20 iterations after it against the run's "
            f"median iteration; no drift between two runs): {spread_cell(in_run['loss_pct'], ' %')}, "
            f"{spread_cell(in_run['lost_per_move_s'])} per move, of which the pause "
            f"{spread_cell(in_run['pause_s'])}. "
            if (in_run := data.get("in_run"))
            else ""
        )
        + stamp(data),
    ]


def control_lines(data: dict | None) -> list[str]:
    """The control plane's cost in a steady job: etcd's load and the CPU beside the training (docs/benchmarks.md)."""
    if data is None:
        return [f"**The control plane in a steady job**: {NOT_YET} (`{COMMANDS['control_load']}`)."]
    job, s = data.get("config", {}), data["summary"]
    tm = s["trainmover"]
    requests = ", ".join(f"{method} {num(v['median'])}" for method, v in tm["etcd_per_s"].items())
    streams = num(tm["etcd_streams_per_s"].get("LeaseKeepAlive", {}).get("median", 0.0))
    return [
        f"**The control plane in a steady job** ({job.get('ranks')} ranks, {job.get('model')} model, TP2·PP2, "
        f"`--trainmover --tm-comm {job.get('comm')}` and the plain job alternating, {job.get('window')} s of each): "
        f"etcd receives {requests} requests a second, and opens {streams} keep-alive streams a second; "
        f"TrainMover's control work (etcd, the agent and the ranks' side threads, less the plain job's) costs "
        f"{spread_cell(s['control_cpu_per_iteration_s'], ' core-s')} per iteration of "
        f"{spread_cell(s['plain']['iteration_s'])}; iteration time ratio {spread_cell(s['ratio'], '')}. {stamp(data)}",
    ]


def mirror_lines(mirror: dict | None, distopt: dict | None) -> list[str]:
    """The distributed optimizer's mirror: its steady-state cost and the lost time it buys."""
    rows = {r["dp"]: r for r in (mirror or {}).get("overhead") or []}
    if not rows:
        cost = f"cost {NOT_YET} (`{COMMANDS['mirror']}`)"
    else:
        parts = [
            f"{num(r['ratio'])}× ({num(r['ratio_range'][0])}-{num(r['ratio_range'][1])}, {r['runs']} rounds) at DP={dp}"
            for dp, r in sorted(rows.items())
        ]
        host = max((mirror or {}).get("host_bytes_per_rank", {}).values() or [0])
        cost = (
            f"iteration time with it over without {', '.join(parts)}; at most {host / 2**20:.1f} MiB of host memory "
            f"per rank, {mirror['device_bytes_extra']} bytes on the accelerator ({stamp(mirror).rstrip('.')})"
        )
    d = distopt or {}
    if d.get("distopt_lost_s") is None or d.get("unexpected_lost_s") is None:
        lost = f"lost time {NOT_YET} (`{COMMANDS['downtime']}`)"
    else:
        pace = [
            t["pre_fault_ratio"]
            for key in ("unexpected", "distopt")
            for t in d.get("scenarios", {}).get(key, {}).get("trials", [])
        ]
        noise = (
            f"; before the fault the faulted runs ran at {num(min(pace))}-{num(max(pace))}× their twins' pace, so "
            "noise of that size is in these figures"
            if pace
            else ""
        )
        first = {
            key: [
                e["first_iteration_s"]
                for e in d.get("events", [])
                if e.get("scenario") == key and e.get("first_iteration_s") is not None
            ]
            for key in ("unexpected", "distopt")
        }
        mid = {key: statistics.median(v) if v else None for key, v in first.items()}
        phase = (
            f"; the recovery itself, from the kill to the end of the first iteration after it (no twin in it), "
            f"{num(mid['distopt'], ' s')} against {num(mid['unexpected'], ' s')} "
            f"({num(mid['distopt'] / mid['unexpected'])}×)"
            if mid["distopt"] and mid["unexpected"]
            else ""
        )
        trials = d.get("config", {}).get("trials")
        lost = (
            f"one SIGKILL loses {num(d['distopt_lost_s'], ' s')} ({num(d['distopt_lost_range_s'][0])} to "
            f"{num(d['distopt_lost_range_s'][1])}) against {num(d['unexpected_lost_s'], ' s')} "
            f"({num(d['unexpected_lost_range_s'][0])} to {num(d['unexpected_lost_range_s'][1])}) replicated, "
            f"{trials} trials of each alternating in one run ({num(d['distopt_over_unexpected'])}×, goal ≤ 1.5{noise})"
            f"{phase}. {stamp(d).rstrip('.')}"
        )
    return [
        "**Distributed optimizer** (each optimizer shard mirrored in a peer's host memory after every step,",
        f"8 ranks, bf16): {cost}; {lost}.",
    ]
