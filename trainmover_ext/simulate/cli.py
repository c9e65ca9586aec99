"""``trainmover simulate``: the command line of the projection simulator.

Contract: :func:`add_parser` registers the subcommand on the ``trainmover``
dispatcher; :func:`run` returns 0 on success and 1 when ``--check`` finds a
figure outside the paper tolerance. Invalid inputs (``--check`` without
``--paper`` too) raise :class:`~trainmover_ext.errors.ConfigError` naming the
flag (the dispatcher prints it and exits 2). Defaults are the paper's inputs;
the report lists every input with its source (:mod:`.sources`), and names the
ones fitted to the paper's own projection.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import replace

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import PAPER_CALIBRATION, DowntimeModel, SimConfig, calibrated_to_paper

# flag -> DowntimeModel field; defaults are None so that a flag given on the command
# line is told apart from one left alone (flags beat --downtimes-json, which beats defaults)
_DOWNTIME_FLAGS = {
    "restart_s": ("restart_ref_s", float, "stop-restart relaunch+init seconds at --restart-ref-gpus"),
    "restart_ref_gpus": ("restart_ref_gpus", int, "GPU count at which --restart-s holds"),
    "restart_scale_exp": ("restart_scale_exp", float, "stop-restart growth exponent with GPUs"),
    "parcae_reconfig_s": ("parcae_reconfig_ref_s", float, "shrink/rebuild downtime per interruption at 1,024 GPUs"),
    "parcae_scale_exp": ("parcae_scale_exp", float, "shrink/rebuild growth exponent"),
    "parcae_shrink_gpus": ("parcae_shrink_gpus", int, "GPUs idle while a shrunk job waits to regrow"),
    "parcae_regrow_hours": ("parcae_regrow_hours", float, "hours a shrunk job runs short"),
    "nvrx_s": ("nvrx_inprocess_s", float, "NVRx in-process restart seconds at 1,024 GPUs"),
    "nvrx_scale_exp": ("nvrx_scale_exp", float, "NVRx growth exponent with GPUs"),
    "tm_unexpected_s": ("tm_unexpected_s", float, "TrainMover unexpected downtime with a standby"),
    "tm_planned_s": ("tm_planned_s", float, "TrainMover planned/rebalance downtime"),
    "tm_cold_join_s": ("tm_cold_join_s", float, "extra seconds when no warm standby is free"),
    "tm_hang_detect_s": ("tm_hang_detect_s", float, "seconds before TrainMover names a hung rank"),
    "tm_control_s_per_gpu": (
        "tm_control_s_per_gpu",
        float,
        "seconds TrainMover's recovery grows per GPU of the job (the controller's reads, etcd's plan notices)",
    ),
    "tm_promotion_penalty_iters": (
        "tm_promotion_penalty_iters",
        float,
        "iterations of TrainMover's job lost to a promoted rank's slower first steps (--downtimes-json sets "
        "it from its recoveries' penalty_iters)",
    ),
    "watchdog_timeout_s": ("watchdog_timeout_s", float, "seconds before a hang is noticed by the collective watchdog"),
    "nvrx_hang_detect_s": ("nvrx_hang_detect_s", float, "seconds before NVRx notices a hang"),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate`` on the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="project ETTR and wasted GPU-hours at 1K-128K GPUs (event-driven simulator)",
        description="Event-driven projection of a long training job under failures, planned "
        "interruptions and rebalancing, for stop-restart, shrink/rebuild (Parcae-like), NVRx "
        "in-process restart and TrainMover with and without standbys. Defaults are the paper's inputs.",
    )
    job = p.add_argument_group("job and failure model")
    job.add_argument("--gpus", type=int, default=8192, help="GPUs in the job (default 8192)")
    job.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per machine (default 8)")
    job.add_argument(
        "--gpu-mttf-hours",
        type=float,
        default=SimConfig.gpu_mttf_hours,
        help="per-GPU MTTF in GPU-hours (default 24576: 3 h at 8K GPUs, the paper's "
        "operating point; 50676 is the raw Llama 3 count)",
    )
    job.add_argument(
        "--mttf-hours", type=float, default=None, help="job-level MTTF in hours; overrides --gpu-mttf-hours"
    )
    job.add_argument(
        "--mttf-node-hours",
        type=float,
        default=None,
        metavar="H",
        help="mean hours between failures of one machine (what an operator's fleet records show); sets "
        "--gpu-mttf-hours to H x --gpus-per-node",
    )
    job.add_argument(
        "--unexpected-per-planned",
        type=float,
        default=SimConfig.unexpected_per_planned,
        help="unexpected interruptions per planned one (default 8.9, Llama 3's 419:47; 0 = none planned)",
    )
    job.add_argument(
        "--hang-fraction",
        type=float,
        default=SimConfig.hang_fraction,
        help=f"share of the failures that are hangs, detected first (default {SimConfig.hang_fraction:g})",
    )
    job.add_argument(
        "--job-loss-mttf-hours",
        type=float,
        default=0.0,
        metavar="H",
        help="mean running hours between losses of the whole job (scheduler kill, power or fabric event), "
        "which every strategy survives only from its last checkpoint, so TrainMover and shrink/rebuild save "
        "checkpoints too (default 0: none)",
    )
    job.add_argument(
        "--no-cascades",
        dest="cascades",
        action="store_false",
        help="let every recovery complete untouched (default: failures go on at the job's rate while it "
        "recovers; one that strikes a recovery costs its time so far and a recovery of its own)",
    )
    job.add_argument(
        "--rebalance-minutes",
        type=float,
        default=0.0,
        help="rebalance every M minutes of running time (default 0 = never)",
    )
    job.add_argument(
        "--infra-cost-min",
        type=float,
        default=2.0,
        help="infrastructure minutes added to each unexpected/planned interruption (default 2)",
    )
    job.add_argument("--iteration-s", type=float, default=None, help="steady iteration seconds (default 6)")
    job.add_argument(
        "--downtime-cv",
        type=float,
        default=0.0,
        help="spread of each interruption's downtime: its strategy's figure times a lognormal factor of mean 1 "
        "and this coefficient of variation, drawn per event (default 0: fixed); the report gives each "
        "strategy's downtime per event as a distribution either way",
    )
    ckpt = p.add_argument_group("checkpointing")
    ckpt.add_argument("--checkpoint-interval-min", type=float, default=30.0, help="checkpoint interval (default 30)")
    ckpt.add_argument(
        "--checkpoint-young-daly",
        action="store_true",
        help="checkpoint at Daly's optimum interval (the higher-order form of Young's sqrt(2 x save x MTTF)) "
        "for --checkpoint-save-s and the job MTTF, instead of --checkpoint-interval-min; needs "
        "--checkpoint-save-s > 0",
    )
    ckpt.add_argument("--checkpoint-save-s", type=float, default=0.0, help="stall per save (default 0: async)")
    ckpt.add_argument(
        "--checkpoint-load-s",
        type=float,
        default=SimConfig.checkpoint_load_s,
        help=f"load seconds per restart (default {SimConfig.checkpoint_load_s:g})",
    )
    sb = p.add_argument_group("standbys")
    sb.add_argument("--standbys", type=int, default=None, help="fixed standby machines (default: search the best)")
    sb.add_argument("--max-standbys", type=int, default=512, help="upper bound of the search (default 512)")
    sb.add_argument(
        "--standby-replace-hours",
        type=float,
        default=SimConfig.standby_replace_hours,
        help=f"hours before a consumed standby slot is warm again (default {SimConfig.standby_replace_hours:g})",
    )
    dt = p.add_argument_group("downtime models (override the paper defaults)")
    dt.add_argument(
        "--downtimes-json",
        default=None,
        help="JSON from benchmarks/downtime.py (restart_s, unexpected_s, planned_s, "
        "nvrx_inprocess_s, iteration_s, scale); missing keys keep the defaults",
    )
    for flag, (name, kind, text) in _DOWNTIME_FLAGS.items():
        default = getattr(DowntimeModel, name)
        dt.add_argument("--" + flag.replace("_", "-"), type=kind, default=None, help=f"{text} (default {default:g})")
    dt.add_argument(
        "--calibrate-to-paper",
        action="store_true",
        help="replace the sourced defaults of "
        + ", ".join(sorted(PAPER_CALIBRATION))
        + " with the values fitted to the paper's own projection (stop-restart 540 s at 128 GPUs, exponent "
        "0.17; shrink/rebuild 880 s, exponent 0.06; cold join 190 s; refill 48 h): the projection then "
        "reproduces the paper by construction, which confirms the fit, not the paper. Flags and "
        "--downtimes-json still win",
    )
    run_group = p.add_argument_group("run and output")
    horizon = run_group.add_mutually_exclusive_group()
    horizon.add_argument("--weeks", type=float, default=None, help="weeks of progress to simulate (default 4)")
    horizon.add_argument("--days", type=float, default=None, help="days of progress to simulate")
    run_group.add_argument("--seed", type=int, default=0, help="seed of the interruption streams (default 0)")
    run_group.add_argument("--replicas", type=int, default=2, help="seeded runs averaged per point (default 2)")
    run_group.add_argument("--json", default=None, metavar="OUT", help="write the projection as JSON to OUT")
    run_group.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="sweep 1K-128K GPUs and plot to FILE (PNG/PDF/SVG); with --band or --sweep each strategy's ETTR "
        "band over those ranges is shaded (a minute or more)",
    )
    run_group.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=LO:HI",
        help="sensitivity: also project with input NAME (as the report's input list names it, e.g. "
        "restart_ref_s=80:300) at LO and at HI, the others unchanged, and report TrainMover's saving against "
        "each strategy as a range over them (repeatable, one input at a time); JSON key sweep",
    )
    run_group.add_argument(
        "--band",
        action="store_true",
        help="sensitivity over the default ranges of every assumed or doubly read input (restart growth, "
        "Parcae's reconfiguration and regrow time, refill time, NVRx, cold join, checkpoint interval, iteration "
        "time; docs/simulate.md lists them and why), as --sweep does for one; with --paper, the paper's figures "
        "against that band, and --check passes when each lies inside it (a minute or two: 21 projections "
        "per scale)",
    )
    run_group.add_argument(
        "--paper",
        action="store_true",
        help="also print the paper's figures beside ours (8K/64K/128K, 10-min rebalance)",
    )
    run_group.add_argument(
        "--check",
        action="store_true",
        help="with --paper (required): exit 1 if a figure is off by > 5 pp, naming the inputs that drive each; "
        "with --band or --sweep, exit 1 if a figure lies outside the band, naming the input that comes closest",
    )
    run_group.add_argument(
        "--replay",
        default=None,
        metavar="CHAOS_JSON",
        help="instead of projecting, predict the wall time and ETTR of each TrainMover and fork-restart run of "
        "a benchmarks/chaos.py result from its schedule, with every failure's loss composed from "
        "--downtimes-json and --detection-json (both required; nothing is fitted to the run); exit 1 when "
        "either strategy's prediction is off by more than 2 percent of wall time or 0.01 of ETTR; JSON key replay",
    )
    run_group.add_argument(
        "--detection-json",
        default=None,
        metavar="FILE",
        help="JSON from benchmarks/detection.py (SIGKILL and SIGSTOP detection medians), for --replay",
    )
    run_group.add_argument(
        "--scale-check",
        type=int,
        default=None,
        metavar="RANKS",
        help="also run the membership-scale check with RANKS logical ranks (e.g. 1024), and count "
        "one recovery's etcd work per rank at each --recovery-ranks size",
    )
    run_group.add_argument(
        "--recovery-ranks",
        default="100,1000,4000",
        metavar="N,N,...",
        help="job sizes of the per-rank recovery count that --scale-check runs (multiples of 20: "
        "TP4 x PP5); JSON key recovery[]",
    )
    p.set_defaults(func=run)
    return p


# --downtimes-json key -> the field it sets
_MEASURED_FIELDS = {
    "restart_s": "restart_ref_s",
    "ranks": "restart_ref_gpus",
    "unexpected_s": "tm_unexpected_s",
    "phases": "tm_unexpected_s",
    "penalty_iters": "tm_promotion_penalty_iters",
    "planned_s": "tm_planned_s",
    "nvrx_inprocess_s": "nvrx_inprocess_s",
    "iteration_s": "iteration_s",
}
# SimConfig flags -> field, for the inputs' sources (a value that differs from the default was given)
_JOB_FLAGS = {
    "gpus": "gpus",
    "gpus_per_node": "gpus_per_node",
    "gpu_mttf_hours": "gpu_mttf_hours",
    "mttf_hours": "mttf_hours",
    "unexpected_per_planned": "unexpected_per_planned",
    "rebalance_minutes": "rebalance_minutes",
    "hang_fraction": "hang_fraction",
    "checkpoint_interval_min": "checkpoint_interval_min",
    "checkpoint_young_daly": "checkpoint_young_daly",
    "downtime_cv": "downtime_cv",
    "cascades": "cascades",
    "job_loss_mttf_hours": "job_loss_mttf_hours",
    "checkpoint_save_s": "checkpoint_save_s",
    "checkpoint_load_s": "checkpoint_load_s",
    "standbys": "standbys",
    "max_standbys": "max_standbys",
    "standby_replace_hours": "standby_replace_hours",
    "seed": "seed",
    "replicas": "replicas",
}


@dataclasses.dataclass
class InputOrigins:
    """Which inputs did not come from the defaults: read from ``--downtimes-json`` (field -> file:key)
    or given by a flag (field names)."""

    measured: dict[str, str] = dataclasses.field(default_factory=dict)
    given: set[str] = dataclasses.field(default_factory=set)

    def summary(self) -> list[str]:
        """The old one-line list: ``file:key`` and ``--flag`` entries of the downtime models."""
        return sorted(set(self.measured.values())) + sorted(
            f"--{flag.replace('_', '-')}" for flag, (name, _, _) in _DOWNTIME_FLAGS.items() if name in self.given
        )


def config_from_args(args: argparse.Namespace) -> tuple[SimConfig, InputOrigins]:
    """Build the SimConfig (defaults, then ``--downtimes-json``, then explicit flags) and where its
    inputs came from."""
    from trainmover_ext.simulate.strategies import load_measured_downtimes

    model = DowntimeModel()
    origins = InputOrigins()
    iteration_s = None
    if args.downtimes_json:
        model, iteration_s, applied = load_measured_downtimes(args.downtimes_json, model)
        for key, where in applied.items():
            origins.measured[_MEASURED_FIELDS[key]] = where
    explicit = {
        field: getattr(args, flag) for flag, (field, _, _) in _DOWNTIME_FLAGS.items() if getattr(args, flag) is not None
    }
    if explicit:
        model = replace(model, **explicit)
        origins.given.update(explicit)
        for name in explicit:
            origins.measured.pop(name, None)
    if args.iteration_s is not None:
        iteration_s = args.iteration_s
        origins.given.add("iteration_s")
        origins.measured.pop("iteration_s", None)
    defaults = SimConfig()
    origins.given.update(
        name for flag, name in _JOB_FLAGS.items() if getattr(args, flag, None) != getattr(defaults, name)
    )
    if args.infra_cost_min * 60.0 != defaults.infra_cost_s:
        origins.given.add("infra_cost_s")
    if args.weeks is not None or args.days is not None:
        origins.given.add("weeks")
    gpu_mttf_hours = args.gpu_mttf_hours
    if args.mttf_node_hours is not None:
        if args.mttf_hours is not None or args.gpu_mttf_hours != SimConfig.gpu_mttf_hours:
            raise ConfigError("--mttf-node-hours: give one of --mttf-node-hours, --gpu-mttf-hours and --mttf-hours")
        if not (math.isfinite(args.mttf_node_hours) and args.mttf_node_hours > 0):
            raise ConfigError(f"--mttf-node-hours {args.mttf_node_hours}: must be > 0")
        gpu_mttf_hours = args.mttf_node_hours * args.gpus_per_node
        origins.given.add("gpu_mttf_hours")
    if args.days is not None and not (math.isfinite(args.days) and args.days > 0):
        raise ConfigError(f"--days {args.days}: must be > 0 (or use --weeks)")
    weeks = args.weeks if args.weeks is not None else (args.days / 7.0 if args.days is not None else 4.0)
    cfg = SimConfig(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_mttf_hours=gpu_mttf_hours,
        mttf_hours=args.mttf_hours,
        unexpected_per_planned=args.unexpected_per_planned,
        rebalance_minutes=args.rebalance_minutes,
        hang_fraction=args.hang_fraction,
        infra_cost_s=args.infra_cost_min * 60.0,
        checkpoint_interval_min=args.checkpoint_interval_min,
        checkpoint_young_daly=args.checkpoint_young_daly,
        downtime_cv=args.downtime_cv,
        cascades=args.cascades,
        job_loss_mttf_hours=args.job_loss_mttf_hours,
        checkpoint_save_s=args.checkpoint_save_s,
        checkpoint_load_s=args.checkpoint_load_s,
        iteration_s=iteration_s if iteration_s is not None else SimConfig.iteration_s,
        standbys=args.standbys,
        max_standbys=args.max_standbys,
        standby_replace_hours=args.standby_replace_hours,
        weeks=weeks,
        seed=args.seed,
        replicas=args.replicas,
        downtimes=model,
    )
    if args.calibrate_to_paper:
        cfg = calibrated_to_paper(cfg, keep=origins.given | set(origins.measured))
    return cfg, origins


def run(args: argparse.Namespace) -> int:
    """Simulate, print the table, and write the requested JSON and plot."""
    from trainmover_ext.simulate import paper, report, sensitivity
    from trainmover_ext.simulate.engine import project
    from trainmover_ext.simulate.sources import format_inputs, inputs_of

    if args.replay:
        return _replay(args)
    if args.check and not args.paper:
        raise ConfigError("--check compares with the paper's figures: give --paper too")
    ranges = [sensitivity.parse_sweep(text) for text in args.sweep]
    if args.checkpoint_young_daly and any(r.name == "checkpoint_interval_min" for r in ranges):
        raise ConfigError(
            "--sweep checkpoint_interval_min: with --checkpoint-young-daly the interval follows from "
            "--checkpoint-save-s and the job MTTF; sweep checkpoint_save_s instead"
        )
    if args.band:
        ranges += [
            r
            for r, _ in sensitivity.DEFAULT_BAND
            if r.name not in {s.name for s in ranges}
            and not (args.checkpoint_young_daly and r.name == "checkpoint_interval_min")  # Daly's, not a range
        ]
    cfg, origins = config_from_args(args)
    inputs = inputs_of(cfg, measured=origins.measured, given=origins.given, calibrated=args.calibrate_to_paper)
    projection = project(cfg)
    print(report.format_projection(projection))
    if cfg.standbys is not None:  # the operator's question: is that the count to keep?
        best = project(replace(cfg, standbys=None), strategies=())
        print(report.format_standby_choice(projection, best))
    print(format_inputs(inputs))
    doc = report.projection_to_json(projection, downtime_sources=origins.summary(), inputs=inputs)
    if cfg.standbys is not None:
        doc["standby_choice"] = report.standby_choice(projection, best)
    if ranges:
        swept = sensitivity.sweep(cfg, ranges, base=projection)
        print()
        print(sensitivity.format_sweep(swept, report.LABELS))
        doc["sweep"] = swept.to_json()
    status = 0
    if args.paper:
        comparison = paper.compare_with_paper(cfg)
        rebalance = paper.rebalance_check(cfg)
        print()
        print(report.format_paper(comparison, rebalance))
        doc["paper"] = report.paper_to_json(comparison, rebalance)
        if ranges:
            print()
            band = paper.paper_band(
                cfg,
                ranges,
                progress=lambda n, total: print(f"band: {n}/{total} projections", flush=True),
                base=(comparison, rebalance),
            )
            print(paper.format_band(band))
            doc["paper"]["band"] = band
            outside = [row["figure"] for row in band if not row["inside"]]
            if args.check:
                print(
                    f"check: FAILED, {len(outside)} figure(s) outside the band"
                    if outside
                    else "check: every figure of the paper's lies inside the band"
                )
                status = 1 if outside else 0
        elif args.check and not paper.all_within_tolerance(comparison, rebalance):
            print(f"check: FAILED, figures outside the {paper.TOLERANCE_PP:g} pp tolerance of the paper's:")
            for line in paper.off_figures(comparison, rebalance):
                print(f"  {line}")
            status = 1
        elif args.check:
            print(
                "check: every figure within the tolerance"
                + (" (with inputs fitted to the paper: this confirms the fit)" if args.calibrate_to_paper else "")
            )
    if args.scale_check is not None:
        from trainmover_ext.simulate import scale_check

        result = scale_check.run_scale_check(ranks=args.scale_check)
        print()
        print(scale_check.format_result(result))
        doc["scale_check"] = result.to_json()
        try:
            sizes = [int(n) for n in args.recovery_ranks.split(",") if n.strip()]
        except ValueError as exc:
            raise ConfigError(
                f"--recovery-ranks {args.recovery_ranks!r}: give job sizes such as 100,1000,4000"
            ) from exc
        counts = [scale_check.run_recovery_check(n) for n in sizes]
        print()
        print(scale_check.format_recovery(counts))
        doc["recovery"] = [dataclasses.asdict(c) for c in counts]
    if args.json:
        report.write_json(doc, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bands = None
        if ranges:
            bands = report.ettr_bands(
                cfg, ranges, progress=lambda n, total: print(f"plot band: {n}/{total} projections", flush=True)
            )
        report.plot_sweep(report.sweep(cfg), args.plot, bands)
        print(f"wrote {args.plot}")
    return status


def _replay(args: argparse.Namespace) -> int:
    """``--replay``: predict a measured chaos run (see :mod:`.replay`)."""
    import json

    from trainmover_ext.simulate.replay import STRATEGIES, format_replay, replay

    if not args.downtimes_json or not args.detection_json:
        raise ConfigError(
            "--replay composes each failure's loss from measured results: give --downtimes-json "
            "(benchmarks/results/downtime.json) and --detection-json (benchmarks/results/detection.json)"
        )
    docs = []
    for flag, path in (
        ("--replay", args.replay),
        ("--downtimes-json", args.downtimes_json),
        ("--detection-json", args.detection_json),
    ):
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{flag} {path}: cannot read it as JSON ({exc})") from exc
    doc = replay(*docs)
    print(format_replay(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replay": doc}, f, indent=1)
    return 0 if all(doc[k]["within_tolerance"] for k in STRATEGIES) else 1
