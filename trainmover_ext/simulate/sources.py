"""Where each input of a projection comes from: measured by us, published, or assumed.

Contract: :func:`inputs_of` lists every input of a :class:`~.config.SimConfig` (its downtime model's
too) as an :class:`Input` with its value and source. A default's source is :data:`DEFAULT_SOURCES`'s;
a value read from ``--downtimes-json`` is ``measured`` (the file and key); a value given by a flag is
``assumed`` (the user's). No default is fitted to the reference paper's outputs; the values that were
(:data:`~.config.PAPER_CALIBRATION`, used with ``--calibrate-to-paper``) are ``assumed`` with ``fitted``
set (:data:`CALIBRATED_SOURCES`): a projection resting on them cannot confirm that paper, and the report
says so. Pure functions; the report prints the list and ``--json`` carries it as ``inputs[]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from trainmover_ext.simulate.config import SimConfig

Kind = Literal["measured", "published", "assumed"]

PAPER = "TrainMover paper (arXiv 2412.12636)"
LLAMA3 = (
    "Llama 3 report (Dubey et al. 2024, section 3.3.4: 419 unexpected and 47 planned interruptions "
    "in 54 days on 16,384 GPUs)"
)


@dataclass(frozen=True)
class Source:
    """A default's origin: its kind, the reference (paper and figure, benchmark, or why assumed), and
    whether it was fitted to the reference paper's outputs."""

    kind: Kind
    reference: str
    fitted: bool = False


@dataclass(frozen=True)
class Input:
    """One input of a projection, as the report prints it and ``inputs[]`` carries it."""

    name: str
    value: float | int | None
    source: Kind
    reference: str
    fitted: bool = False


def _fitted(what: str) -> Source:
    return Source("assumed", f"fitted to the {PAPER}'s own projection: {what}", fitted=True)


DEFAULT_SOURCES: dict[str, Source] = {
    # the job and its failure model
    "gpus": Source("assumed", "the scale asked about (the paper's 8K operating point by default)"),
    "gpus_per_node": Source("assumed", "8 GPUs per machine (DGX/HGX H100)"),
    "gpu_mttf_hours": Source(
        "published", f"{PAPER}: 'MTTF about 3 h at 8K GPUs', i.e. Llama 3's job MTTF applied at 8,192 GPUs"
    ),
    "mttf_hours": Source("assumed", "unset: the job MTTF follows from --gpu-mttf-hours"),
    "unexpected_per_planned": Source("published", f"{LLAMA3}: 419 / 47 = 8.9"),
    "hang_fraction": Source("assumed", "a tenth of the failures are hangs (a process alive but stuck)"),
    "rebalance_minutes": Source("assumed", "no rebalancing unless asked"),
    "infra_cost_s": Source("published", f"{PAPER}: +2 min of infrastructure cost per interruption"),
    "checkpoint_interval_min": Source("assumed", "30 min"),
    "checkpoint_young_daly": Source("assumed", "off: a fixed --checkpoint-interval-min"),
    "checkpoint_save_s": Source("assumed", "0 s: asynchronous saves overlap training"),
    "job_loss_mttf_hours": Source(
        "assumed", "0: no job losses unless given (a whole-job loss rolls every strategy back)"
    ),
    "cascades": Source(
        "assumed", "on: a failure during a recovery (at the job's failure rate) restarts it, its time so far lost"
    ),
    "downtime_cv": Source("assumed", "0: every interruption of a kind costs the same (--downtime-cv draws a spread)"),
    "checkpoint_load_s": Source(
        "published", f"{PAPER}, Table 1: checkpoint loading is 35.1% of a restart; of its ~300 s at 1,024 GPUs"
    ),
    "iteration_s": Source("assumed", "6 s"),
    "standbys": Source("assumed", "unset: the count that maximises ETTR is searched"),
    "max_standbys": Source("assumed", "bound of the standby search"),
    "standby_replace_hours": Source("assumed", "24 h to repair or re-provision a machine: the paper gives none"),
    "weeks": Source("assumed", "4 weeks of fault-free progress"),
    "seed": Source("assumed", "seed of the interruption streams"),
    "replicas": Source("assumed", "seeded runs averaged per point"),
    # the downtime models
    "restart_ref_s": Source(
        "published", f"{PAPER}: Megatron restarts in 'nearly 300 seconds' at 1,024 GPUs, less the 35.1% of loading"
    ),
    "restart_ref_gpus": Source("published", f"{PAPER}: the scale of its 300 s restart"),
    "restart_scale_exp": Source(
        "assumed",
        f"0.1, between the {PAPER}'s ~100 s at 32 GPUs to ~300 s at 1,024 (0.32) and its 4.45 min production "
        "restart at 8,192 GPUs (no growth)",
    ),
    "parcae_reconfig_ref_s": Source(
        "published", f"{PAPER}, Fig. 1: Parcae removes a machine in 21 s and adds one in more than 200 s (32 GPUs)"
    ),
    "parcae_scale_exp": Source("published", f"{PAPER}: its projection holds the 32-GPU measurements fixed"),
    "parcae_shrink_gpus": Source("assumed", "one TP8 x PP8 model replica"),
    "parcae_regrow_hours": Source("assumed", "1 h before elastic capacity lets a shrunk job grow back"),
    "nvrx_inprocess_s": Source("assumed", "90 s: NVRx documents no latency figure"),
    "nvrx_scale_exp": Source("assumed", "0.1: every rank rebuilds its communicators"),
    "tm_unexpected_s": Source("published", f"{PAPER}, abstract: 'around 20 seconds' at 1,024 GPUs"),
    "tm_unexpected_scale_exp": Source("assumed", "0: only the leaver's groups change"),
    "tm_control_s_per_gpu": Source(
        "assumed",
        "about 2 keys read per rank by the controller and 1 watch event per rank per recovery (--scale-check's "
        "counts) at an assumed 2 us per key and 10 us per event",
    ),
    "tm_planned_s": Source("published", f"{PAPER}: 99% efficiency under 10-minute rebalancing (at most ~6-10 s)"),
    "tm_hang_detect_s": Source(
        "measured", "benchmarks/results/detection.json: a stalled main thread named in 2.53 s (median of 3, 2 cores)"
    ),
    "tm_promotion_penalty_iters": Source(
        "measured",
        "benchmarks/results/downtime.json: penalty_iters of TrainMover's unexpected recoveries, median -0.28 "
        "(-3.97 to 1.33, 3 runs, 2 cores): none measurable, so 0",
    ),
    "watchdog_timeout_s": Source(
        "published", "Megatron-LM's --distributed-timeout-minutes default (10): the NCCL watchdog aborts after it"
    ),
    "nvrx_hang_detect_s": Source("assumed", "60 s: NVRx's monitor timeouts are the user's to set"),
    "tm_cold_join_s": Source(
        "published", f"{PAPER}: a warm-up of about 150 s (GPT-10B) and about 50 s of NCCL setup (64 GPUs)"
    ),
}
"""The source of every default, by field name of :class:`SimConfig` and :class:`DowntimeModel`."""

CALIBRATED_SOURCES: dict[str, Source] = {
    "restart_ref_s": _fitted("540 s at 128 GPUs, to the stop-restart ETTR 0.50 under 10-minute rebalancing"),
    "restart_ref_gpus": _fitted("128 GPUs, the scale of the paper's rebalancing figure"),
    "restart_scale_exp": _fitted("0.17, to the stop-restart ETTR 0.42 at 1,024 GPUs"),
    "checkpoint_load_s": _fitted("60 s, with restart_ref_s"),
    "parcae_reconfig_ref_s": _fitted("880 s, to the 82.77% (8K) and 88% (128K) savings against Parcae"),
    "parcae_scale_exp": _fitted("0.06, with parcae_reconfig_ref_s"),
    "tm_cold_join_s": _fitted("190 s, together with standby_replace_hours, to the 35.91% and 55% savings"),
    "standby_replace_hours": _fitted("48 h, together with tm_cold_join_s, to the 35.91% (8K) and 55% (128K) savings"),
    "hang_fraction": Source("published", f"{PAPER}: its projection models no hangs"),
    "cascades": Source("published", f"{PAPER}: its projection models no failure during a recovery"),
}
"""The sources of :data:`~.config.PAPER_CALIBRATION`'s values (``--calibrate-to-paper``)."""


def inputs_of(
    cfg: SimConfig,
    *,
    measured: dict[str, str] | None = None,
    given: set[str] | None = None,
    calibrated: bool = False,
) -> list[Input]:
    """Every input of ``cfg`` with its source. ``measured`` maps field -> where the value was read
    (``--downtimes-json`` file and key); ``given`` names the fields set by a flag; ``calibrated``: the
    fields neither measured nor given hold :data:`~.config.PAPER_CALIBRATION`'s values."""
    measured, given = measured or {}, given or set()
    defaults = DEFAULT_SOURCES | (CALIBRATED_SOURCES if calibrated else {})
    out = []
    for owner in (cfg, cfg.downtimes):
        for f in fields(owner):
            if f.name == "downtimes":
                continue
            value = getattr(owner, f.name)
            if f.name == "checkpoint_interval_min" and cfg.checkpoint_young_daly:
                out.append(
                    Input(
                        f.name,
                        round(cfg.checkpoint_interval_s() / 60.0, 3),
                        "assumed",
                        f"Daly's optimum (FGCS 2006) for checkpoint_save_s {cfg.checkpoint_save_s:g} s and the job "
                        f"MTTF {cfg.job_mttf_s / 3600.0:.3g} h (--checkpoint-young-daly)" + _resilient_interval(cfg),
                    )
                )
            elif f.name in measured:
                out.append(Input(f.name, value, "measured", measured[f.name]))
            elif f.name in given:
                out.append(Input(f.name, value, "assumed", "given on the command line"))
            else:
                src = defaults[f.name]
                out.append(Input(f.name, value, src.kind, src.reference, src.fitted))
    return out


def _resilient_interval(cfg: SimConfig) -> str:
    """How often the strategies that roll back only on a job loss save, when they do (Daly's optimum)."""
    if cfg.job_loss_mttf_hours <= 0:
        return ""
    minutes = cfg.checkpoint_interval_s(rolls_back_on_failure=False) / 60.0
    return (
        f", job losses included; {minutes:.4g} min for the strategies a job loss alone rolls back (for its "
        f"MTTF {cfg.job_loss_mttf_hours:g} h)"
    )


def fitted_names(inputs: list[Input]) -> list[str]:
    """The inputs whose values were fitted to the reference paper's outputs."""
    return [i.name for i in inputs if i.fitted]


def format_inputs(inputs: list[Input]) -> str:
    """The report's table of inputs and a warning naming the fitted ones."""
    lines = ["inputs (name = value: source, reference)"]
    for i in inputs:
        mark = " [FITTED]" if i.fitted else ""
        value = float(f"{i.value:.6g}") if isinstance(i.value, float) else i.value
        lines.append(f"  {i.name} = {value}: {i.source}{mark}, {i.reference}")
    fitted = fitted_names(inputs)
    if fitted:
        lines.append(
            f"  {len(fitted)} input(s) were fitted to the paper's own projection ({', '.join(fitted)}): "
            "agreement with the paper's figures then confirms the fit, not the paper"
        )
    return "\n".join(lines)
