"""What ``benchmarks/downtime.py`` (and the nvrx baseline) derive from a run: the time a fault cost, the
migration's phases, and the plot."""

from __future__ import annotations

import time

from common import median, read_events


def iterations(metrics: str) -> list[dict]:
    """The ``iteration`` records of a metrics file."""
    return [e for e in read_events(metrics) if e.get("event") == "iteration"]


def trajectory(metrics: str) -> dict[int, float]:
    """iteration -> loss; a re-run iteration keeps the value logged last."""
    return {e["iteration"]: e["loss"] for e in iterations(metrics)}


def sleep_into_iteration(metrics: str, inside: float) -> None:
    """Sleep ``inside`` (0..1) of a steady iteration (the median logged, the first two left out): called
    right after an iteration was logged, it returns at that point inside the next one."""
    its = iterations(metrics)
    time.sleep(inside * median([e["iteration_s"] for e in its[2:]] or [its[-1]["iteration_s"]]))


def resume_event(metrics: str, t0: float, *, reason: str | None = None) -> dict | None:
    """The logging rank's first ``recovered`` event after ``t0`` (of ``reason`` when given, e.g. ``planned``);
    when the logging rank itself was replaced, its joiner's ``promoted`` event, timed at ``state_ready``.
    None when neither was logged."""
    events = read_events(metrics)
    resumed = [e for e in events if e.get("event") == "recovered" and e["t"] > t0]
    if not resumed:
        resumed = [
            dict(e, t=e["state_ready"], reason=e.get("reason", "failure"))
            for e in events
            if e.get("event") == "promoted" and e.get("state_ready", 0) > t0
        ]
    resumed = [e for e in resumed if reason is None or e.get("reason") == reason]
    return resumed[0] if resumed else None


def lost_time(
    metrics: str, t0: float, after_event: dict, *, planned: bool = False, steady_after: float | None = None
) -> dict:
    """Downtime from ``t0`` to the end of the first iteration after ``after_event`` (see the module doc):
    minus one steady iteration after a failure, minus every newly completed iteration for a planned move.
    The steady iteration is the median before ``t0`` (from ``steady_after`` when given, e.g. once a
    standby that competed for the cores is warm)."""
    its = iterations(metrics)
    before = [e for e in its if e["t_end"] <= t0]
    calm = [e["iteration_s"] for e in before if steady_after is not None and e["t_end"] > steady_after]
    steady = median(calm or [e["iteration_s"] for e in before[2:]] or [e["iteration_s"] for e in before])
    first = next(e for e in its if e["t_end"] > after_event["t"])
    last_before = before[-1]["iteration"] if before else 0
    completed = {e["iteration"] for e in its if t0 < e["t_end"] <= first["t_end"] and e["iteration"] > last_before}
    credited = len(completed) if planned else 1
    return {
        "downtime_s": first["t_end"] - t0 - credited * steady,
        "wall_s": first["t_end"] - t0,
        "iterations_in_window": len(completed),
        "iteration_s": steady,
        "resumed_iteration": after_event.get("resumed_iteration"),
        "to_resume_s": after_event["t"] - t0,
        "first_iteration_s": first["t_end"] - after_event["t"],
        # Where the time went: each iteration ending in the window, as (iteration, seconds).
        "window": [
            (e["iteration"], round(e["iteration_s"], 3))
            for e in its
            if t0 < e["t_end"] <= first["t_end"] and e["iteration"] > last_before
        ],
    }


def phases_of(steps: dict, t0: float) -> dict:
    """Durations between consecutive timeline steps, starting at ``t0`` (the kill, or the start of the
    command that requested a planned move: ``requested`` is when it wrote the request)."""
    order = [
        "requested",
        "detected",
        "decided",
        "joined",
        "links_rebuilt",
        "ready",
        "leaver_waits",
        "handed_over",
        "transferred",
        "checkpoint_loaded",
        "first_iteration",
    ]
    out, prev = {}, t0
    for name in order:
        if name in steps:
            out[f"{name}_s"] = round(steps[name] - prev, 4)
            prev = steps[name]
    return out


def plot(path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels, values = (
        ["stop-restart", "TrainMover\nunexpected", "TrainMover\nplanned"],
        [result["restart_s"], result["unexpected_s"], result["planned_s"]],
    )
    bars = ax.bar(labels, values, color=["#b0b0b0", "#d62728", "#1f77b4"])
    for bar, v in zip(bars, values, strict=False):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom")
    ax.set_ylabel("downtime (s)")
    ax.set_title(f"{result['job']}\nsteady iteration {result['iteration_s']:.2f} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
