"""``trainmover events --plot timeline.png``: iteration time against wall clock, each migration's phases shaded.

Contract: the plot is drawn from two real sources and nothing else:
- the migration plans in the job's etcd space (``migrations/<e>``, with the
  per-step timestamps the controller and the migration layer record);
- the workers' ``--tm-metrics-file`` (one JSON line per iteration, written by
  the logging rank; ``--metrics-file``). Without it only the phases are drawn.

Phases are named by the step they end in (see
:func:`trainmover_ext.metrics.migration_phases`). matplotlib is imported
lazily with the Agg backend, so no display is needed; a missing matplotlib is a
:class:`ConfigError` saying what to install.

Example::

    trainmover events --tm-etcd-endpoints 127.0.0.1:2379 --tm-job demo --tm-job-token $T \\
        --plot timeline.png --metrics-file runs/demo/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

from trainmover_ext.errors import ConfigError, MalformedValue
from trainmover_ext.metrics import migration_phases

# One colour per phase, so the same step looks the same in every migration.
PHASE_COLOURS = {
    "decided": "#d62728",
    "joined": "#ff7f0e",
    "links_rebuilt": "#ff7f0e",
    "transferred": "#2ca02c",
    "checkpoint_loaded": "#8c564b",
    "first_iteration": "#1f77b4",
}
_OTHER_COLOUR = "#7f7f7f"


def read_plans(space) -> list:
    """Every migration plan of the job, oldest epoch first (unreadable ones skipped)."""
    from trainmover_ext.control.records import MigrationPlan

    plans = []
    for entry in space.kv.get_prefix(space.key("migrations/")).entries:
        try:
            plans.append(MigrationPlan.from_bytes(entry.value, key=entry.key))
        except MalformedValue:
            continue
    return sorted(plans, key=lambda p: p.epoch)


def read_iterations(path: str | None) -> list[dict]:
    """The ``iteration`` records of a ``--tm-metrics-file`` in file order (an iteration re-run after an abandon
    appears twice)."""
    if not path:
        return []
    if not os.path.exists(path):
        raise ConfigError(
            f"--metrics-file {path} does not exist: pass the file given to the workers as --tm-metrics-file"
        )
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if rec.get("event") == "iteration" and rec.get("t_end") is not None:
                    out.append(rec)
    return out


def describe_migration(plan) -> list[str]:
    """Text lines: what moved where, then each phase with its duration, then the total."""
    reps = ", ".join(
        f"rank {r.rank}: {r.leaver} -> {r.joiner} (state from {r.state_source.get('kind')})"
        for r in plan.replacement_list()
    )
    lines = [f"epoch {plan.epoch} ({plan.reason}, {plan.status}): {reps or 'no replacement'}"]
    phases = migration_phases(plan.steps)
    for name, t0, t1 in phases:
        lines.append(f"  {name:<18} {(t1 - t0) * 1000:9.1f} ms")
    if phases:
        lines.append(f"  {'total':<18} {(phases[-1][2] - phases[0][1]) * 1000:9.1f} ms")
    return lines


def plot_timeline(plans: list, iterations: list[dict], output: str, *, title: str = "") -> str:
    """Draw the PNG at ``output``; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (or trainmover[plot])") from exc

    times = [rec["t_end"] for rec in iterations] + [t for p in plans for t in p.steps.values()]
    if not times:
        raise ConfigError("nothing to plot: the job has no migrations and no --metrics-file was given")
    t0 = min(
        min(rec["t_end"] - rec.get("iteration_s", 0.0) for rec in iterations) if iterations else min(times), min(times)
    )
    fig, ax = plt.subplots(figsize=(11, 5), dpi=110)
    if iterations:
        xs = [rec["t_end"] - t0 for rec in iterations]
        ys = [rec.get("iteration_s", 0.0) for rec in iterations]
        # Break the line where a migration started between two records: no iteration ran there.
        starts = [min(p.steps.values()) - t0 for p in plans if p.steps]
        cuts = [i for i in range(1, len(xs)) if any(xs[i - 1] <= s < xs[i] for s in starts)]
        for n, (a, b) in enumerate(zip([0] + cuts, cuts + [len(xs)], strict=False)):
            ax.plot(
                xs[a:b],
                ys[a:b],
                "-o",
                color="black",
                markersize=3,
                linewidth=1,
                label="iteration time (end of iteration)" if n == 0 else None,
            )
        for x, y, rec in zip(xs, ys, iterations, strict=False):
            if rec["iteration"] % 5 == 0:
                ax.annotate(
                    str(rec["iteration"]),
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 5),
                    ha="center",
                    fontsize=7,
                    color="dimgray",
                )
    else:
        ax.text(
            0.5, 0.5, "no iteration records (pass --metrics-file)", transform=ax.transAxes, ha="center", color="dimgray"
        )
    used = {}
    for plan in plans:
        phases = migration_phases(plan.steps)
        for name, a, b in phases:
            colour = PHASE_COLOURS.get(name, _OTHER_COLOUR)
            # a phase of a few ms would be invisible: draw at least a hairline
            ax.axvspan(a - t0, max(b - t0, a - t0 + 0.002 * (max(times) - t0 or 1)), color=colour, alpha=0.3, lw=0)
            used.setdefault(name, colour)
        if phases:
            start, end = phases[0][1] - t0, phases[-1][2] - t0
            ax.annotate(
                f"epoch {plan.epoch} {plan.reason}\n{(end - start):.2f} s",
                ((start + end) / 2, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, -4),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=8,
            )
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=c, alpha=0.3, label=f"phase: {n}") for n, c in used.items()]
    if handles:
        ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_xlabel("wall clock (s since the first iteration started)")
    ax.set_ylabel("iteration time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "TrainMover timeline", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, format="png")
    plt.close(fig)
    return output


def extend_events_parser(events: argparse.ArgumentParser) -> None:
    """Add ``--plot`` and ``--metrics-file`` to ``trainmover events``; the event table is still printed."""
    events.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also draw iteration time against wall clock with each migration's phases shaded, "
        "as a PNG (needs matplotlib)",
    )
    events.add_argument(
        "--metrics-file",
        default=None,
        help="the workers' --tm-metrics-file (JSON lines), the source of the iteration times "
        "for --plot (without it only the migration phases are drawn)",
    )
    show_events = events.get_default("func")

    def run(args: argparse.Namespace) -> int:
        code = show_events(args)
        if args.plot:
            from trainmover_ext.control.cli import open_job

            space = open_job(args)
            try:
                plans = read_plans(space)
            finally:
                space.kv.close()
            for plan in plans:
                print("\n".join(describe_migration(plan)))
            path = plot_timeline(
                plans,
                read_iterations(args.metrics_file),
                args.plot,
                title=f"job {args.tm_job}: iteration time and migration phases",
            )
            print(f"wrote {path} ({len(plans)} migration(s))")
        return code

    events.set_defaults(func=run)
