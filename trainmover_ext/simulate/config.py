"""Typed configuration of the simulator: the failure model and the downtime models.

Contract: every field's default is a published figure (the TrainMover paper, OSDI'26,
arXiv 2412.12636, and the Llama 3 report) or a stated assumption, never a value fitted to
the paper's own projection; the source of each is in :mod:`.sources` and
``docs/simulate.md``. The values that were fitted to that projection are kept apart in
:data:`PAPER_CALIBRATION`, used only when asked (``--calibrate-to-paper``). ``__post_init__``
validates eagerly and raises :class:`~trainmover_ext.errors.ConfigError` naming
the ``trainmover simulate`` flag that fixes the value.

Time units: seconds unless the field name says otherwise (``_hours``, ``_min``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.checkpointing import young_daly_interval_s
from trainmover_ext.simulate.phases import CONTROL_S_PER_GPU

HOUR_S = 3600.0
WEEK_S = 7 * 24 * HOUR_S

# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected and 47 planned
# interruptions in a 54-day snapshot on 16,384 H100 GPUs.
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_UNEXPECTED = 419
LLAMA3_PLANNED = 47
# Per-GPU MTTF of unexpected interruptions implied by the raw Llama 3 count:
# 16,384 GPUs x 1,296 h / 419 = 50,676 GPU-hours (one failure every 3.09 h at 16K).
LLAMA3_GPU_MTTF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_UNEXPECTED
# The paper's projection states "8K GPUs (MTTF about 3 h)", i.e. it applies Llama 3's
# job-level 3 h at 8K rather than at 16K: 8,192 x 3 h = 24,576 GPU-hours per GPU.
# That operating point is the default, so that plain `trainmover simulate` uses the
# paper's inputs; `--gpu-mttf-hours 50676` gives the raw Llama 3 reading instead.
PAPER_GPU_MTTF_HOURS = 8192 * 3.0
# Unexpected : planned = 419 : 47 = 8.9 : 1.
LLAMA3_UNEXPECTED_PER_PLANNED = LLAMA3_UNEXPECTED / LLAMA3_PLANNED


PAPER_CALIBRATION: dict[str, float | bool] = {
    "restart_ref_s": 540.0,
    "restart_ref_gpus": 128,
    "restart_scale_exp": 0.17,
    "checkpoint_load_s": 60.0,
    "parcae_reconfig_ref_s": 880.0,
    "parcae_scale_exp": 0.06,
    "tm_cold_join_s": 190.0,
    "standby_replace_hours": 48.0,
    "hang_fraction": 0.0,
    "cascades": False,
}
"""Values fitted to the paper's own outputs (``--calibrate-to-paper``), by field of :class:`SimConfig` or
:class:`DowntimeModel`: stop-restart 540 s at 128 GPUs growing with exponent 0.17 (with a 60 s load: its
ETTR of 0.50 at 128 GPUs and 0.42 at 1,024 under 10-minute rebalancing); shrink/rebuild 880 s with exponent
0.06 (the 82.77% and 88% savings against Parcae); a 190 s cold join with a 48 h standby refill (the 35.91%
and 55% savings against TrainMover without standbys); and no hangs or cascades, as the paper's projection
has none. A
projection on them agrees with the paper by construction: it confirms the fit, not the paper."""


def calibrated_to_paper(cfg: SimConfig, keep: set[str] = frozenset()) -> SimConfig:
    """``cfg`` with :data:`PAPER_CALIBRATION`'s values, except for the fields named in ``keep`` (set
    otherwise, e.g. by a flag or a measurement)."""
    chosen = {k: v for k, v in PAPER_CALIBRATION.items() if k not in keep}
    downtimes = {k: v for k, v in chosen.items() if hasattr(cfg.downtimes, k)}
    job = {k: v for k, v in chosen.items() if k not in downtimes}
    return replace(cfg, downtimes=replace(cfg.downtimes, **downtimes), **job)


def _require(ok: bool, flag: str, message: str) -> None:
    """Raise ConfigError naming ``flag`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{flag}: {message}")


def _finite_nonneg(value: float, flag: str) -> None:
    _require(math.isfinite(value) and value >= 0, flag, f"must be a finite number >= 0, got {value!r}")


@dataclass(kw_only=True)
class DowntimeModel:
    """Critical-path downtime of each recovery strategy, excluding the infrastructure cost.

    Scale-dependent terms follow ``ref_s * (gpus / ref_gpus) ** exp``. Lost progress
    (redo since the last checkpoint, or the abandoned in-flight iteration) is added
    by the engine, not here.
    """

    restart_ref_s: float = 195.0
    """Stop-restart relaunch + re-init at ``restart_ref_gpus`` (checkpoint load is separate):
    the paper's Megatron restart of nearly 300 s at 1,024 GPUs less the 35.1% its Table 1
    gives to checkpoint loading (flag --restart-s)."""

    restart_ref_gpus: int = 1024
    """GPU count at which ``restart_ref_s`` holds (flag --restart-ref-gpus)."""

    restart_scale_exp: float = 0.1
    """Growth exponent of stop-restart with scale. An assumption between the paper's two
    readings: about 100 s at 32 GPUs and 300 s at 1,024 (0.32), and a 4.45 min production
    restart at 8,192 GPUs, no longer than at 1,024 (0) (flag --restart-scale-exp)."""

    parcae_reconfig_ref_s: float = 221.0
    """Shrink/rebuild (Parcae/Oobleck-like) reconfiguration downtime per interruption: the
    paper's Parcae measurements at 32 GPUs, 21 s to remove a machine plus more than 200 s to
    add one back (flag --parcae-reconfig-s)."""

    parcae_scale_exp: float = 0.0
    """Growth exponent of the shrink/rebuild downtime with scale: 0, as the paper's projection
    holds its 32-GPU measurements fixed (flag --parcae-scale-exp)."""

    parcae_shrink_gpus: int = 64
    """GPUs that stop contributing while a shrunk job waits to grow back: one model-parallel
    replica (TP8 x PP8) (flag --parcae-shrink-gpus)."""

    parcae_regrow_hours: float = 1.0
    """Time a shrunk job runs short before elastic capacity lets it grow back (our
    assumption) (flag --parcae-regrow-hours)."""

    nvrx_inprocess_s: float = 90.0
    """NVRx in-process restart at 1,024 GPUs: abort, re-init NCCL, reload the local checkpoint.
    Our assumption (NVRx documents no latency figure) (flag --nvrx-s)."""

    nvrx_scale_exp: float = 0.1
    """Growth of the in-process restart with scale: every rank rebuilds its communicators
    (flag --nvrx-scale-exp)."""

    tm_unexpected_s: float = 20.0
    """TrainMover unexpected-failure downtime with a warm standby: the abstract's "around
    20 seconds ... at the 1024-GPU scale" (flag --tm-unexpected-s)."""

    tm_unexpected_scale_exp: float = 0.0
    """Power-law growth of TrainMover's downtime with scale: 0, as a replacement rebuilds only the groups
    of the leaver (a constant number at any size); what does grow is ``tm_control_s_per_gpu``'s."""

    tm_control_s_per_gpu: float = CONTROL_S_PER_GPU
    """Seconds TrainMover's recovery grows per GPU of the job: the controller reads about two keys per rank
    per decision and etcd notifies every rank of the plan (``--scale-check``'s counts), at an assumed 2 us
    per key and 10 us per watch event (:mod:`.phases`; flag --tm-control-s-per-gpu)."""

    tm_planned_s: float = 10.0
    """TrainMover planned-migration downtime (joiner prepared while training continues). The
    paper reports 99% efficiency under 10-minute rebalancing, i.e. <= ~6-10 s
    (flag --tm-planned-s)."""

    tm_hang_detect_s: float = 2.5
    """Seconds before TrainMover names a hung rank: ``benchmarks/detection.py``'s median for a main thread
    stalled in compute or in a collective (2.53 s at the default ``--tm-progress-timeout``)
    (flag --tm-hang-detect-s)."""

    tm_promotion_penalty_iters: float = 0.0
    """Iterations lost after a TrainMover recovery to the promoted rank's slower first steps (cold allocator
    and caches), charged at ``iteration_s`` on top of its downtime. ``benchmarks/downtime.py`` measures it
    (``penalty_iters``: the 20 iterations after the fault against the fault-free twin's): within noise of 0
    on 2 CPU cores. ``--downtimes-json`` sets it from its recoveries' median (flag
    --tm-promotion-penalty-iters)."""

    watchdog_timeout_s: float = 600.0
    """Seconds before a hang is noticed without TrainMover (stop-restart, shrink/rebuild): the collective
    timeout after which torch's NCCL watchdog aborts, Megatron-LM's ``--distributed-timeout-minutes``
    default of 10 (flag --watchdog-timeout-s)."""

    nvrx_hang_detect_s: float = 60.0
    """Seconds before NVRx's in-process restart notices a hang: an assumption (its monitors' timeouts are
    the user's to set) (flag --nvrx-hang-detect-s)."""

    tm_cold_join_s: float = 200.0
    """Extra downtime of an unexpected failure when no warm standby is free: start a machine
    and warm it up on the critical path. The paper's figures: a warm-up of about 150 s
    (GPT-10B, communicators aside) and about 50 s to set up NCCL on 64 GPUs
    (flag --tm-cold-join-s)."""

    def __post_init__(self) -> None:
        for name, flag in (
            ("restart_ref_s", "--restart-s"),
            ("restart_scale_exp", "--restart-scale-exp"),
            ("parcae_reconfig_ref_s", "--parcae-reconfig-s"),
            ("parcae_scale_exp", "--parcae-scale-exp"),
            ("parcae_regrow_hours", "--parcae-regrow-hours"),
            ("nvrx_inprocess_s", "--nvrx-s"),
            ("nvrx_scale_exp", "--nvrx-scale-exp"),
            ("tm_unexpected_s", "--tm-unexpected-s"),
            ("tm_planned_s", "--tm-planned-s"),
            ("tm_cold_join_s", "--tm-cold-join-s"),
            ("tm_hang_detect_s", "--tm-hang-detect-s"),
            ("tm_promotion_penalty_iters", "--tm-promotion-penalty-iters"),
            ("tm_control_s_per_gpu", "--tm-control-s-per-gpu"),
            ("watchdog_timeout_s", "--watchdog-timeout-s"),
            ("nvrx_hang_detect_s", "--nvrx-hang-detect-s"),
        ):
            _finite_nonneg(float(getattr(self, name)), flag)
        _require(self.restart_ref_gpus >= 1, "--restart-ref-gpus", "must be >= 1")
        _require(self.parcae_shrink_gpus >= 0, "--parcae-shrink-gpus", "must be >= 0")
        # no flag sets it (only --sweep, which may go below 0): finite is all it must be
        _require(math.isfinite(self.tm_unexpected_scale_exp), "tm_unexpected_scale_exp", "is not finite")


@dataclass(kw_only=True)
class SimConfig:
    """Inputs of one simulation: the job, its failure model, checkpointing and standbys."""

    gpus: int = 8192
    """GPUs in the training job (flag --gpus)."""

    gpus_per_node: int = 8
    """GPUs per machine; a failure takes one machine out and a standby is one machine
    (flag --gpus-per-node)."""

    gpu_mttf_hours: float = PAPER_GPU_MTTF_HOURS
    """Per-GPU mean time to an unexpected interruption, in GPU-hours. Default 24,576: the
    paper's "MTTF about 3 h at 8K GPUs" (Llama 3's 3 h job MTTF). The raw Llama 3 count
    gives 50,676 (flag --gpu-mttf-hours)."""

    mttf_hours: float | None = None
    """Job-level MTTF in hours; overrides ``gpu_mttf_hours`` when set (flag --mttf-hours)."""

    unexpected_per_planned: float = LLAMA3_UNEXPECTED_PER_PLANNED
    """Unexpected interruptions per planned one: Llama 3's 419 : 47 = 8.9 : 1. 0 disables
    planned interruptions (flag --unexpected-per-planned)."""

    hang_fraction: float = 0.1
    """Share of the unexpected interruptions that are hangs (a process alive but stuck) rather than exits:
    a hang costs its detection time first. An assumption (flag --hang-fraction)."""

    rebalance_minutes: float = 0.0
    """Planned rebalance every M minutes of running time after each resume; 0 = never
    (flag --rebalance-minutes)."""

    infra_cost_s: float = 120.0
    """Fixed infrastructure cost per unexpected or planned interruption (detection,
    diagnosis, scheduling): the paper's +2 min. Not charged to rebalances, which the
    scheduler itself starts at a chosen boundary (flag --infra-cost-min)."""

    checkpoint_interval_min: float = 30.0
    """Checkpoint every this many minutes of progress; checkpoint-based strategies redo the
    progress since the last one (flag --checkpoint-interval-min). Unused with ``checkpoint_young_daly``."""

    checkpoint_young_daly: bool = False
    """Checkpoint at Daly's optimum for ``checkpoint_save_s`` and the job MTTF instead
    (:attr:`checkpoint_interval_s`; flag --checkpoint-young-daly)."""

    job_loss_mttf_hours: float = 0.0
    """Mean running hours between job losses: interruptions no strategy survives in place (the whole job
    killed by the scheduler, a power or fabric event, a bug that crashes every rank). Every strategy then
    restarts from its last checkpoint, so the strategies that recover without one (TrainMover,
    shrink/rebuild) save checkpoints too, at the same interval or, with ``checkpoint_young_daly``, at Daly's
    optimum for this MTTF. 0: none (flag --job-loss-mttf-hours)."""

    cascades: bool = True
    """Failures go on during a recovery: the machines fail at the job's rate while it is down, and a failure
    that strikes a recovery costs the time spent in it so far and a recovery of its own, which may be struck
    in turn (flag --no-cascades). Off, every recovery completes untouched, as in the paper's projection."""

    downtime_cv: float = 0.0
    """Spread of each interruption's downtime: every downtime is its strategy's figure times a lognormal
    factor of mean 1 and this coefficient of variation, drawn per event (flag --downtime-cv). 0: every
    interruption of a kind costs the same."""

    checkpoint_save_s: float = 0.0
    """Training stall per checkpoint save of checkpoint-based strategies. 0: async saves
    (Megatron-core --async-save) overlap training (flag --checkpoint-save-s)."""

    checkpoint_load_s: float = 105.0
    """Checkpoint load time on every checkpoint-based recovery: 35.1% (the paper's Table 1
    share) of its 300 s restart at 1,024 GPUs (flag --checkpoint-load-s)."""

    iteration_s: float = 6.0
    """Steady iteration time; a failure abandons a uniform fraction of the in-flight
    iteration (flag --iteration-s)."""

    standbys: int | None = None
    """Fixed number of warm standby machines for TrainMover; None = search for the count
    that maximises ETTR (flag --standbys)."""

    max_standbys: int = 512
    """Upper bound of the standby search (flag --max-standbys)."""

    standby_replace_hours: float = 24.0
    """Time before a consumed standby's slot holds a warm machine again (repair or
    re-provision, then warm-up). An assumption: the paper gives none
    (flag --standby-replace-hours)."""

    weeks: float = 4.0
    """Training progress to simulate, in weeks of fault-free work (flags --weeks/--days)."""

    seed: int = 0
    """Seed of the interruption streams; the same seed gives the same result (flag --seed)."""

    replicas: int = 2
    """Independent seeded runs averaged per point (flag --replicas)."""

    downtimes: DowntimeModel = field(default_factory=DowntimeModel)
    """Downtime models of the strategies (flags --downtimes-json and the per-model flags)."""

    def __post_init__(self) -> None:
        _require(self.gpus >= 1, "--gpus", f"must be >= 1, got {self.gpus}")
        _require(self.gpus_per_node >= 1, "--gpus-per-node", f"must be >= 1, got {self.gpus_per_node}")
        _require(
            self.gpus % self.gpus_per_node == 0,
            "--gpus",
            f"{self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}",
        )
        _require(
            math.isfinite(self.gpu_mttf_hours) and self.gpu_mttf_hours > 0,
            "--gpu-mttf-hours",
            f"must be > 0, got {self.gpu_mttf_hours!r}",
        )
        if self.mttf_hours is not None:
            _require(
                math.isfinite(self.mttf_hours) and self.mttf_hours > 0,
                "--mttf-hours",
                f"must be > 0, got {self.mttf_hours!r}",
            )
        _finite_nonneg(self.unexpected_per_planned, "--unexpected-per-planned")
        _finite_nonneg(self.rebalance_minutes, "--rebalance-minutes")
        _require(0.0 <= self.hang_fraction <= 1.0, "--hang-fraction", f"must be in [0, 1], got {self.hang_fraction!r}")
        _finite_nonneg(self.infra_cost_s, "--infra-cost-min")
        _require(
            math.isfinite(self.checkpoint_interval_min) and self.checkpoint_interval_min > 0,
            "--checkpoint-interval-min",
            "must be > 0",
        )
        _finite_nonneg(self.checkpoint_save_s, "--checkpoint-save-s")
        _finite_nonneg(self.job_loss_mttf_hours, "--job-loss-mttf-hours")
        _require(
            math.isfinite(self.downtime_cv) and 0.0 <= self.downtime_cv <= 3.0,
            "--downtime-cv",
            f"must be in [0, 3], got {self.downtime_cv!r}",
        )
        _require(
            not self.checkpoint_young_daly or self.checkpoint_save_s > 0,
            "--checkpoint-young-daly",
            "needs what one save costs the job: give --checkpoint-save-s S (> 0), e.g. the stall of a synchronous save",
        )
        _finite_nonneg(self.checkpoint_load_s, "--checkpoint-load-s")
        _finite_nonneg(self.iteration_s, "--iteration-s")
        if self.standbys is not None:
            _require(self.standbys >= 0, "--standbys", f"must be >= 0, got {self.standbys}")
        _require(self.max_standbys >= 0, "--max-standbys", "must be >= 0")
        _finite_nonneg(self.standby_replace_hours, "--standby-replace-hours")
        _require(math.isfinite(self.weeks) and self.weeks > 0, "--weeks", "must be > 0 (or use --days)")
        _require(self.replicas >= 1, "--replicas", "must be >= 1")

    @property
    def job_mttf_s(self) -> float:
        """Mean running time between unexpected interruptions of the whole job, in seconds."""
        hours = self.mttf_hours if self.mttf_hours is not None else self.gpu_mttf_hours / self.gpus
        return hours * HOUR_S

    @property
    def job_loss_mttf_s(self) -> float:
        """Mean running seconds between job losses (``inf``: none)."""
        return self.job_loss_mttf_hours * HOUR_S if self.job_loss_mttf_hours > 0 else math.inf

    def checkpoint_interval_s(self, *, rolls_back_on_failure: bool = True) -> float:
        """Seconds of progress between checkpoints of a strategy that rolls back on every failure (the
        default) or only on a job loss: ``checkpoint_interval_min``, or with ``checkpoint_young_daly`` Daly's
        optimum for ``checkpoint_save_s`` and the mean time between the interruptions that roll it back
        (``inf`` for one that never rolls back)."""
        losses = 1.0 / self.job_loss_mttf_s
        rate = 1.0 / self.job_mttf_s + losses if rolls_back_on_failure else losses
        if rate == 0:
            return math.inf
        if self.checkpoint_young_daly:
            return young_daly_interval_s(self.checkpoint_save_s, 1.0 / rate)
        return self.checkpoint_interval_min * 60.0

    @property
    def nodes(self) -> int:
        """Machines in the job."""
        return self.gpus // self.gpus_per_node

    @property
    def work_s(self) -> float:
        """Fault-free training progress the simulated job must complete, in seconds."""
        return self.weeks * WEEK_S
