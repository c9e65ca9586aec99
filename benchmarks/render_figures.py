#!/usr/bin/env python3
"""Render the README's and docs/benchmarks.md's figure tables from the committed ``benchmarks/results/*.json``.

Contract: the only writer of the text between ``<!-- figures:begin`` (the whole marker line is kept) and
``<!-- figures:end -->`` in ``README.md`` and ``docs/benchmarks.md``; nothing outside the markers is
read or changed. Every figure shown is a median with its range and the number of runs it comes from,
and every table names the date and commit its JSON was measured at. A figure whose key is missing, or a
JSON from before the current definitions (no ``measured_at``), is rendered as "not yet measured under
the new definitions", never filled in. The cells every figure is made of are in ``render_cells.py``, the
steady-state lines (communicator, detection, stragglers, rebalancing, control plane, mirror) in
``render_steady.py``; the downtime and chaos tables and the two blocks are here.

    python benchmarks/render_figures.py           # rewrite both blocks
    python benchmarks/render_figures.py --check   # exit 1, with a diff, when either differs
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos_goals import GOALS, trainmover_summary  # noqa: E402
from render_cells import COMMANDS, MIN_RUNS, NOT_YET, load, num, spread_cell, stamp, yes  # noqa: E402
from render_steady import (  # noqa: E402
    comm_table,
    control_lines,
    detection_line,
    detection_table,
    mirror_lines,
    rebalance_lines,
    straggler_lines,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- figures:begin", "<!-- figures:end -->"


# ---------------------------------------------------------------------------- downtime


DOWNTIME_ROWS = (
    ("unexpected", "TrainMover, SIGKILL, a standby takes the rank", "unexpected_lost_s"),
    ("restart", "stop-restart from the checkpoint, fresh interpreters", "restart_lost_s"),
    ("restart_fork", "stop-restart from the checkpoint, forked ranks", "restart_fork_lost_s"),
    ("nvrx", "NVIDIA resiliency-ext in-process restart", "nvrx_lost_s"),
    ("planned", "TrainMover, `trainmover migrate` (planned)", "planned_lost_s"),
)


def warm_joiners(data: dict, scenario: str) -> str:
    """How many of ``scenario``'s TrainMover events had a warm joiner (``events[].joiner_warm``), as the
    row's label says it: a standby still warming when the fault landed is another path."""
    joined = [e for e in data.get("events", []) if e.get("scenario") == scenario and e.get("plan")]
    if not joined:
        return ""
    warm = sum(1 for e in joined if e.get("joiner_warm") == "warm")
    return f" (warm in {warm} of {len(joined)})"


def downtime_table(data: dict | None) -> list[str]:
    head = [
        "| what (JSON key) | lost per failure: median (range, runs) | TrainMover's / this | loss / state identical |",
        "|---|---|---|---|",
    ]
    if data is None:
        rows = [f"| {what} (`{key}`) | {NOT_YET} | - | - |" for _, what, key in DOWNTIME_ROWS]
        return head + rows + ["", f"Regenerate with `{COMMANDS['downtime']}`."]
    scen = data.get("scenarios", {})
    rows = []
    for name, what, key in DOWNTIME_ROWS:
        s = scen.get(name)
        ratio = data.get(f"unexpected_over_{name}")
        cell = (
            spread_cell(s["lost_s"])
            if s
            else (f"skipped: {data['skipped'][name]}" if name in data.get("skipped", {}) else NOT_YET)
        )
        ident = f"{yes(s['bit_identical'])} / {yes(s['state_identical'])}" if s else "-"
        what += warm_joiners(data, name)
        rows.append(f"| {what} (`{key}`) | {cell} | {num(ratio) if ratio is not None else '-'} | {ident} |")
    for s in data.get("scale", []):
        rows.append(
            f"| scale: {s['ranks']} ranks, the same model (`scale[].lost_s`) | {spread_cell(s['lost_s'])} | - | "
            f"{yes(s['bit_identical'])} / {yes(s['state_identical'])} |"
        )
    steady = data.get("iteration_s")
    switch = data.get("planned_switch_range_s")
    switch_line = (
        f" A planned move's switch alone (phase 2: the stall at the agreed boundary and the joiner's first "
        f"iteration, `planned_switch_s`) costs {num(data['planned_switch_s'], ' s')} ({num(switch[0])} to "
        f"{num(switch[1])}), {num(data['planned_switch_iters'])} iterations (goal ≤ 0.5); the rest of its lost "
        "time is phase 1 beside the training on the same cores."
        if switch and data.get("planned_switch_s") is not None
        else ""
    )
    tail = [
        "",
        f"Steady iteration {num(steady, ' s')}; the same fault for every strategy of a trial "
        f"(checkpoint every {data.get('config', {}).get('save_interval')} iterations).{switch_line} {stamp(data)}",
    ]
    return head + rows + tail


NODES_ROWS = (
    (
        "node_loss",
        "a node of 4 ranks lost (agent and ranks SIGKILLed), one plan to a standby machine",
        "node_loss_lost_s",
    ),
    ("drain", "`trainmover drain --node n1`: its 4 ranks to a standby machine, one planned epoch", "drain_lost_s"),
)


def nodes_table(data: dict | None) -> list[str]:
    head = ["| what (JSON key) | lost: median (range, runs) | loss / state identical |", "|---|---|---|"]
    if data is None:
        rows = [f"| {what} (`{key}`) | {NOT_YET} | - |" for _, what, key in NODES_ROWS]
        return head + rows + ["", f"Regenerate with `{COMMANDS['downtime_nodes']}`."]
    rows = []
    for name, what, key in NODES_ROWS:
        s = data.get("scenarios", {}).get(name)
        ident = f"{yes(s['bit_identical'])} / {yes(s['state_identical'])}" if s else "-"
        rows.append(f"| {what} (`{key}`) | {spread_cell(s['lost_s']) if s else NOT_YET} | {ident} |")
    return head + rows + ["", stamp(data)]


# ---------------------------------------------------------------------------- chaos


CHAOS_ROWS = (
    ("controllable_loss_iters_mean", "controllable loss per scheduled failure, mean (iterations)"),
    ("controllable_loss_iters_max", "controllable loss, worst failure without a cascade (iterations)"),
    ("controllable_loss_iters_cascade_max", "controllable loss, worst cascade as one event (iterations)"),
    ("recovery_iters_median", "recovery with a warm joiner, detection to every rank's resume, median (iterations)"),
    ("recovery_iters_max", "recovery with a warm joiner, worst (iterations)"),
    ("penalty_iters_median", "post-promotion penalty over 20 iterations, median (iteration-equivalents)"),
    ("penalty_iters_max", "post-promotion penalty, worst (iteration-equivalents)"),
    ("ettr_rel_g25", "ETTR relative to the twin, a failure every ~25 iterations"),
    ("ettr_rel_g100", "ETTR relative to the twin, a failure every ~100 iterations"),
    ("lost_over_fork_restart", "TrainMover's lost time per failure over stop-restart's with forked ranks"),
)


def _chaos_values(data: dict, key: str) -> list[float]:
    """The figure ``key`` of each TrainMover run (one per seed and rate), for the range of the pooled one."""
    runs = [r for r in data.get("runs", []) if r["strategy"] == "trainmover"]
    if key == "lost_over_fork_restart":
        return [x["ratio"] for x in data["trainmover"].get("lost_over_fork_restart_by_run", [])]
    events = data.get("events", [])
    values = []
    for r in runs:
        mine = [
            e for e in events if (e.get("strategy"), e.get("gap"), e.get("seed")) == ("trainmover", r["gap"], r["seed"])
        ]
        v = trainmover_summary([dict(r, events=mine)]).get(key)
        if v is not None:
            values.append(v)
    return values


def chaos_cell(pooled: float | None, values: list[float]) -> str:
    """The pooled figure (what the goal is judged on), and its median and range over the runs."""
    if pooled is None:
        return NOT_YET
    if not values:
        return f"**{num(pooled)}**"
    vals, n = sorted(values), len(values)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    note = "" if n >= MIN_RUNS else f"; a figure needs {MIN_RUNS}"
    runs = f"{n} run{'s' if n != 1 else ''}"
    return f"**{num(pooled)}** (runs: median {num(median)}, {num(vals[0])}-{num(vals[-1])}, {runs}{note})"


def chaos_table(data: dict | None) -> list[str]:
    head = ["| measure (`trainmover.` key) | measured | goal | met |", "|---|---|---|---|"]
    if data is None:
        rows = [f"| {what} (`{key}`) | {NOT_YET} | {' '.join(map(str, GOALS[key]))} | - |" for key, what in CHAOS_ROWS]
        return head + rows + ["", f"Regenerate with `{COMMANDS['chaos']}`."]
    tm, goals, met = data["trainmover"], data.get("goals", {}), data.get("goals_met", {})
    rows = []
    for key, what in CHAOS_ROWS:
        cell = chaos_cell(tm.get(key), _chaos_values(data, key))
        rows.append(f"| {what} (`{key}`) | {cell} | {goals.get(key, '-')} | {yes(met.get(key))} |")
    ff = data.get("fault_free", {})
    rows.append(
        f"| state and loss bit-identical to the twin, every rank (`state_identical`) | "
        f"{yes(tm.get('state_identical'))} / {yes(tm.get('bit_identical'))} | yes | "
        f"{yes(tm.get('state_identical') and tm.get('bit_identical'))} |"
    )
    rows.append(
        f"| the fault-free twins: plans / fenced processes (`fault_free`) | {ff.get('plans')} / {ff.get('fenced')} | "
        f"0 / 0 | {yes(ff.get('plans') == 0 and ff.get('fenced') == 0)} |"
    )
    seeds, gaps = data.get("seeds", []), data.get("gaps", [])
    base = data.get("restart_fork") or {}
    tail = [
        "",
        f"Seeds {seeds}, a failure about every {' and '.join(str(g) for g in gaps)} iterations; "
        f"{tm.get('scheduled_failures')} scheduled failures ({tm.get('kills_with_cascades')} kills with the "
        f"cascades), {tm.get('warm_joiners')} with a warm joiner, {tm.get('restarts')} fallbacks to stop-restart. "
        f"TrainMover lost {num(tm.get('lost_s_per_failure'), ' s')} per failure (median of runs), stop-restart "
        f"with forked ranks {num(base.get('lost_s_per_failure'), ' s')}. {stamp(data)}",
    ]
    return head + rows + tail


# ---------------------------------------------------------------------------- blocks


def readme_block(results_dir: str, *, full: bool = False) -> list[str]:
    downtime, chaos = load(results_dir, "downtime"), load(results_dir, "chaos")
    return [
        "Every figure comes from `benchmarks/results/*.json` (rendered by `python benchmarks/render_figures.py`)",
        "and is the median of its runs with the range. Lost time is the faulted run's wall time minus its",
        "fault-free twin's over the same iterations, per scheduled failure, with the same faults for every",
        "strategy ([docs/benchmarks.md](docs/benchmarks.md) has the method and the commands). 2-core shared",
        "CPU machine: ratios come from runs side by side in one invocation; absolute seconds only mean",
        "something on a GPU.",
        "",
        "**One failure** (the demo job: 8 ranks TP2·PP2·DP2, bf16, dropout 0.1; one SIGKILL at the same",
        "random point inside the same iteration for every strategy):",
        "",
        *downtime_table(downtime),
        "",
        "**A machine** (two loopback nodes of 4 ranks with `--use-tp-pp-dp-mapping` and a standby machine of 4",
        "slots; the same job):",
        "",
        *nodes_table(load(results_dir, "downtime_nodes")),
        "",
        "**Chaos** (seeded schedules of kills, hangs and cascades; goals in the fault-free twin's steady",
        "iterations):",
        "",
        *chaos_table(chaos),
        "",
        "**Steady state** (the native data plane: every group but WORLD on torch's own gloo here, NCCL on a",
        "GPU; TrainMover's job and the plain job alternate, so machine noise hits both):",
        "",
        *comm_table(load(results_dir, "comm"), full=full),
        "",
        *(
            [
                "**Detection** (4-rank jobs at every default; from the drill's own timestamp to the committed plan):",
                "",
                *detection_table(load(results_dir, "detection")),
            ]
            if full
            else detection_line(load(results_dir, "detection"))
        ),
        "",
        *mirror_lines(
            load(results_dir, "mirror"), load(results_dir, "downtime_distopt") or load(results_dir, "downtime")
        ),
    ]


def docs_block(results_dir: str) -> list[str]:
    lines = readme_block(results_dir, full=True)
    lines += [
        "",
        *straggler_lines(load(results_dir, "straggler")),
        "",
        *rebalance_lines(load(results_dir, "rebalance")),
        "",
        *control_lines(load(results_dir, "control_load")),
    ]
    comm = load(results_dir, "comm")
    if comm and comm.get("allreduce"):
        lines += [
            "",
            "All-reduce of a group of every rank on nccl_delta (`delta_s`), a plain torch group (`gloo_s`) and",
            "WORLD's ring (`world_ring_s`), in seconds, median over iterations of the slowest rank:",
            "",
            "| ranks | MB | `delta_s` | `gloo_s` | ratio | `world_ring_s` |",
            "|---|---|---|---|---|---|",
        ]
        for r in comm["allreduce"]:
            lines.append(
                f"| {r['ranks']} | {r['bytes'] // (1 << 20)} | {num(r['delta_s'])} | {num(r['gloo_s'])} | "
                f"{num(r['ratio'])} | {num(r.get('world_ring_s'))} |"
            )
    downtime = load(results_dir, "downtime")
    if downtime:
        lines += ["", "Per scenario, median (range) over the trials' events, in seconds after the fault:", ""]
        lines += event_table(downtime.get("events", []))
    return lines


def event_table(events: list[dict]) -> list[str]:
    keys = ("fraction_inside", "detect_s", "recovery_s", "first_iteration_s", "penalty_s", "lost_s")
    out = ["| scenario | events | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for name in dict.fromkeys(e["scenario"] for e in events):
        evs = [e for e in events if e["scenario"] == name]
        cells = [compact_cell([e[k] for e in evs if e.get(k) is not None]) for k in keys]
        out.append(f"| {name} | {len(evs)} | " + " | ".join(cells) + " |")
    return out


def compact_cell(values: list[float]) -> str:
    """``median (min-max)`` of an event field, ``-`` when no event recorded it."""
    if not values:
        return "-"
    vals, n = sorted(values), len(values)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return f"{num(median)} ({num(vals[0])}-{num(vals[-1])})"


def splice(text: str, block: list[str], path: str) -> str:
    """``text`` with the lines between its figure markers replaced by ``block``."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith(BEGIN)]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise SystemExit(f"{path}: expected one '{BEGIN} ...' line and one '{END}' line after it")
    return "\n".join(lines[: starts[0] + 1] + block + lines[ends[0] :])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 when a file differs from the rendering.")
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    args = parser.parse_args(argv)
    stale = []
    for path, block in ((args.readme, readme_block(args.results)), (args.docs, docs_block(args.results))):
        with open(path) as f:
            text = f.read()
        rendered = splice(text, block, path)
        if rendered == text:
            continue
        if args.check:
            stale.append(path)
            diff = difflib.unified_diff(text.split("\n"), rendered.split("\n"), path, "rendered", lineterm="", n=1)
            print("\n".join(list(diff)[:60]), file=sys.stderr)
        else:
            with open(path, "w") as f:
                f.write(rendered)
            print(f"rendered the figures of {path}")
    if stale:
        print(
            f"{', '.join(stale)}: the figures differ from benchmarks/results/: run "
            "`python benchmarks/render_figures.py` (never edit between the figure markers by hand)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
