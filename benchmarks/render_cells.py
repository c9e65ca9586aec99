"""What every figure of ``render_figures.py`` is made of: the JSON loader, the number and range cells, the
measurement stamp, the commands that regenerate each result (pure: no file is written)."""

from __future__ import annotations

import json
import os

NOT_YET = "not yet measured under the new definitions"
COMMANDS = {
    "downtime": "python benchmarks/downtime.py --json benchmarks/results/downtime.json",
    "chaos": "python benchmarks/chaos.py --json benchmarks/results/chaos.json",
    "downtime_nodes": "python benchmarks/downtime_nodes.py --json benchmarks/results/downtime_nodes.json",
    "comm": "python benchmarks/comm.py --json benchmarks/results/comm.json",
    "detection": "python benchmarks/detection.py --json benchmarks/results/detection.json",
    "mirror": "python benchmarks/mirror.py --json benchmarks/results/mirror.json",
    "straggler": "python benchmarks/straggler.py --json benchmarks/results/straggler.json",
    "rebalance": "python benchmarks/rebalance.py --json benchmarks/results/rebalance.json",
    "control_load": "python benchmarks/control_load.py --json benchmarks/results/control_load.json",
}
MIN_RUNS = 3


def load(results_dir: str, name: str) -> dict | None:
    """The JSON ``name`` if it is there and under the current definitions (``measured_at``), else None."""
    path = os.path.join(results_dir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) and "measured_at" in data else None


def num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    text = f"{v:.3f}" if abs(v) < 1 else (f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}")
    return text + unit


def spread_cell(s: dict | None, unit: str = " s") -> str:
    """``median (min-max, n runs)``; fewer than :data:`MIN_RUNS` runs say so."""
    if not s or not s.get("n"):
        return NOT_YET
    runs = f"{s['n']} run{'s' if s['n'] != 1 else ''}"
    note = "" if s["n"] >= MIN_RUNS else f"; a figure needs {MIN_RUNS}"
    return f"**{num(s['median'], unit)}** ({num(s['min'])}-{num(s['max'])}, {runs}{note})"


def values_cell(values: list[float], unit: str = "") -> str:
    if not values:
        return NOT_YET
    vals = sorted(values)
    n = len(vals)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return spread_cell({"median": median, "min": vals[0], "max": vals[-1], "n": n}, unit)


def stamp(data: dict) -> str:
    m = data["measured_at"]
    dirty = " plus uncommitted changes" if m.get("dirty") else ""
    return f"Measured {m.get('date')} at commit `{m.get('commit')}`{dirty}: `{data.get('command')}`."


def unmeasured_table(head: list[str], command: str) -> list[str]:
    """A table's header with one row saying it is not measured yet (a cell per column), and the command
    that measures it (a key of :data:`COMMANDS`)."""
    columns = head[0].count("|") - 1
    return head + ["| - | " + NOT_YET + " |" + " - |" * (columns - 2), "", f"Regenerate with `{COMMANDS[command]}`."]


def yes(v) -> str:
    return "-" if v is None else ("yes" if v else "**no**")
