"""Rendering of projections: a text table, a JSON document and a plot.

Contract: pure formatting; the only side effects are :func:`write_json` and
:func:`plot_sweep` writing the file they are given. matplotlib is imported lazily
with the Agg backend, so the table and JSON need no display and no matplotlib.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import HOUR_S, SimConfig
from trainmover_ext.simulate.engine import Projection, project
from trainmover_ext.simulate.sources import Input
from trainmover_ext.simulate.strategies import STRATEGY_NAMES

SWEEP_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

LABELS = {
    "stop_restart": "stop-restart (checkpoint)",
    "parcae": "shrink/rebuild (Parcae/Oobleck-like)",
    "nvrx": "NVRx in-process restart",
    "trainmover_no_standby": "TrainMover, no standby",
    "trainmover": "TrainMover, best standbys",
}


def projection_to_json(
    projection: Projection, *, downtime_sources: list[str] | None = None, inputs: list[Input] | None = None
) -> dict:
    """The ``--json`` document: ``gpus``, ``ettr`` (idle standbys charged), ``ettr_job`` (the job's progress over
    its wall time alone), ``waste_reduction_pct``, ``best_standbys``, ``downtime_per_event_s`` (each strategy's
    ``{n, mean, p50, p95, max}``) and details;
    ``inputs[]`` lists every input with its source (``{name, value, source, reference, fitted}``), and
    ``config`` is the configuration as simulated."""
    cfg = projection.cfg
    results = projection.results
    return {
        "gpus": cfg.gpus,
        "ettr": {name: res.ettr for name, res in results.items()},
        "ettr_job": {name: res.ettr_job for name, res in results.items()},
        "waste_reduction_pct": projection.waste_reduction_pct(),
        "best_standbys": projection.best_standbys,
        "wasted_gpu_hours_per_week": {name: res.wasted_gpu_hours_per_week for name, res in results.items()},
        "saved_gpu_hours_per_week": projection.saved_gpu_hours_per_week(),
        "standby_ettr_curve": {str(k): v for k, v in projection.standby_curve.items()},
        "job_mttf_hours": cfg.job_mttf_s / HOUR_S,
        "events": {name: dict(res.events) for name, res in results.items()},
        "downtime_per_event_s": {name: res.downtime_distribution() for name, res in results.items()},
        "standby_misses": results["trainmover"].standby_misses,
        "downtime_sources": downtime_sources or [],
        "inputs": [asdict(i) for i in inputs or []],
        "fitted_inputs": [i.name for i in inputs or [] if i.fitted],
        "config": asdict(cfg),
    }


def standby_choice(given: Projection, searched: Projection) -> dict:
    """The ``standby_choice`` JSON: TrainMover with the standby count given (``given``) and with the count that
    maximises goodput per GPU, idle standbys charged (``searched``: the same inputs, the count searched)."""

    def row(p: Projection) -> dict:
        res = p.results["trainmover"]
        return {
            "standbys": p.best_standbys,
            "ettr": res.ettr,
            "ettr_job": res.ettr_job,
            "wasted_gpu_hours_per_week": res.wasted_gpu_hours_per_week,
        }

    return {"given": row(given), "best": row(searched)}


def format_standby_choice(given: Projection, searched: Projection) -> str:
    """Two lines: TrainMover with the standbys given, and with the count that maximises goodput per GPU."""
    choice = standby_choice(given, searched)
    lines = ["standbys (idle standbys cost GPUs: goodput per GPU is the ETTR with them charged)"]
    for label, row in (("given", choice["given"]), ("best", choice["best"])):
        lines.append(
            f"  {label:5} {row['standbys']:>5} standby machine(s): ETTR {row['ettr']:.4f}, job ETTR "
            f"{row['ettr_job']:.4f}, {row['wasted_gpu_hours_per_week']:,.0f} GPU-h wasted per week"
        )
    return "\n".join(lines)


def paper_to_json(comparison: dict, rebalance: list[dict]) -> dict:
    """The paper comparison as JSON (projections themselves are summarised, not dumped)."""
    return {
        "rows": comparison["rows"],
        "abstract_64k": comparison["abstract_64k"],
        "best_standbys": {str(k): v for k, v in comparison["best_standbys"].items()},
        "rebalance": rebalance,
    }


def write_json(doc: dict, path: str | Path) -> None:
    """Write ``doc`` as indented JSON; ConfigError names ``--json`` when the path is unwritable."""
    try:
        Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    except OSError as exc:
        raise ConfigError(f"--json: cannot write {path}: {exc}") from exc


def format_projection(projection: Projection) -> str:
    """One row per strategy: ETTR, wasted GPU-hours/week and TrainMover's reduction against it."""
    cfg = projection.cfg
    reductions = projection.waste_reduction_pct()
    lines = [
        f"{cfg.gpus:,} GPUs ({cfg.nodes:,} nodes), job MTTF {cfg.job_mttf_s / HOUR_S:.2f} h, "
        f"{cfg.weeks:.2f} weeks x {cfg.replicas} runs, "
        + (
            f"standbys {cfg.standbys} (given)"
            if cfg.standbys is not None
            else f"best standbys {projection.best_standbys}"
        ),
        f"{'strategy':<38} {'ETTR':>7} {'job ETTR':>9} {'wasted GPU-h/week':>18} {'TM reduction':>13} "
        f"{'downtime/event p50 | p95':>25}",
    ]
    for name in STRATEGY_NAMES:
        if name not in projection.results:
            continue
        res = projection.results[name]
        red = f"{reductions[name]:.2f}%" if name in reductions else "-"
        dist = res.downtime_distribution()
        spread = f"{dist['p50']:.0f} | {dist['p95']:.0f} s"
        lines.append(
            f"{LABELS[name]:<38} {res.ettr:>7.4f} {res.ettr_job:>9.4f} {res.wasted_gpu_hours_per_week:>18,.0f} "
            f"{red:>13} {spread:>25}"
        )
    lines.append(
        "ETTR: useful GPU-time over all GPU-time, idle standbys and a shrunk job's idle GPUs charged; job ETTR: "
        "the job's progress over its wall time alone (what a run's log measures); downtime/event: each "
        "interruption's critical-path downtime (rebalances included; --downtime-cv spreads it)"
    )
    return "\n".join(lines)


def format_paper(comparison: dict, rebalance: list[dict]) -> str:
    """The paper's figures beside ours, the 64K reading, and the rebalance check."""
    lines = ["Paper projection vs ours (waste reduction of TrainMover with its best standby count)"]
    lines.append(f"{'GPUs':>8} {'MTTF h':>7} {'vs':<24} {'paper':>8} {'ours':>8} {'diff pp':>8}  ok")
    for row in comparison["rows"]:
        lines.append(
            f"{row['gpus']:>8,} {row['job_mttf_hours']:>7.2f} {row['baseline']:<24} {row['paper_pct']:>7.2f}% "
            f"{row['ours_pct']:>7.2f}% {row['diff_pp']:>+8.2f}  {'yes' if row['within_tolerance'] else 'NO'}"
        )
    at64 = comparison["abstract_64k"]
    paper = at64["paper"]
    lines.append(
        f"64K abstract: {paper['reduction_pct']:.0f}% less waste, "
        f"{paper['saved_gpu_hours_per_week'] / 1e6:.1f}M GPU-h/week saved. Our readings:"
    )
    for baseline, reading in at64["readings"].items():
        mark = "  <- matches" if baseline == at64["matches"] else ""
        lines.append(
            f"    vs {baseline:<24} {reading['reduction_pct']:6.2f}%  "
            f"{reading['saved_gpu_hours_per_week'] / 1e6:8.2f}M GPU-h/week{mark}"
        )
    lines.append("Rebalance every 10 min, no failures (ETTR)")
    lines.append(f"{'GPUs':>8} {'stop-restart':>13} {'paper':>6} {'TrainMover':>11} {'TM loss':>8}")
    for r in rebalance:
        paper_ettr = f"{r['paper_stop_restart_ettr']:.2f}" if r["paper_stop_restart_ettr"] is not None else "-"
        lines.append(
            f"{r['gpus']:>8,} {r['stop_restart_ettr']:>13.3f} {paper_ettr:>6} {r['trainmover_ettr']:>11.4f} "
            f"{r['trainmover_loss_pct']:>7.2f}%"
        )
    return "\n".join(lines)


def sweep(cfg: SimConfig, scales=SWEEP_GPUS) -> dict[int, Projection]:
    """Projections of ``cfg`` at each GPU count (``mttf_hours`` cleared so MTTF scales)."""
    out = {}
    for gpus in scales:
        if gpus % cfg.gpus_per_node:
            continue
        out[gpus] = project(replace(cfg, gpus=gpus, mttf_hours=None))
    return out


def ettr_bands(
    cfg: SimConfig, ranges: list, scales=SWEEP_GPUS, progress=None
) -> dict[int, dict[str, tuple[float, float]]]:
    """Per GPU count and strategy, the lowest and highest ETTR over the projections at both ends of each
    range (``sensitivity.Sweep``, one input at a time; ``mttf_hours`` cleared as in :func:`sweep`).
    ``progress(done, total)`` is called after each projection."""
    from trainmover_ext.simulate.sensitivity import with_value

    ends = [(r.name, v) for r in ranges for v in (r.lo, r.hi)]
    usable = [g for g in scales if g % cfg.gpus_per_node == 0]
    bands: dict[int, dict[str, tuple[float, float]]] = {}
    done = 0
    for gpus in usable:
        at = bands.setdefault(gpus, {})
        for name, value in ends:
            p = project(with_value(replace(cfg, gpus=gpus, mttf_hours=None), name, value))
            for strategy, res in p.results.items():
                lo, hi = at.get(strategy, (res.ettr, res.ettr))
                at[strategy] = (min(lo, res.ettr), max(hi, res.ettr))
            done += 1
            if progress is not None:
                progress(done, len(usable) * len(ends))
    return bands


def plot_sweep(
    projections: dict[int, Projection],
    path: str | Path,
    bands: dict[int, dict[str, tuple[float, float]]] | None = None,
) -> None:
    """ETTR and wasted GPU-hours/week against GPU count, one line per strategy; ``bands`` (from
    :func:`ettr_bands`) shades each strategy's ETTR range around its line."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    scales = sorted(projections)
    fig, (ax_ettr, ax_waste) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in STRATEGY_NAMES:
        if not all(name in projections[g].results for g in scales):
            continue
        ettr = [projections[g].results[name].ettr for g in scales]
        waste = [max(projections[g].results[name].wasted_gpu_hours_per_week, 1e-9) for g in scales]
        (line,) = ax_ettr.plot(scales, ettr, marker="o", label=LABELS[name])
        if bands:
            lo = [min(bands[g][name][0], e) for g, e in zip(scales, ettr, strict=True)]
            hi = [max(bands[g][name][1], e) for g, e in zip(scales, ettr, strict=True)]
            ax_ettr.fill_between(scales, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax_waste.plot(scales, waste, marker="o", label=LABELS[name])
    for ax in (ax_ettr, ax_waste):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(True, which="both", alpha=0.3)
    ax_ettr.set_ylabel("ETTR")
    ax_ettr.set_ylim(0, 1.02)
    ax_waste.set_yscale("log")
    ax_waste.set_ylabel("wasted GPU-hours per week of progress")
    ax_ettr.legend(fontsize=8)
    best = ", ".join(f"{g // 1024}K:{projections[g].best_standbys}" for g in scales)
    shaded = "; shaded: the ETTR band over the swept inputs" if bands else ""
    fig.suptitle(f"trainmover simulate (best standbys {best}{shaded})", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path}: {exc}") from exc
    finally:
        plt.close(fig)
