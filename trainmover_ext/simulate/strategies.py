"""Recovery strategies and their downtime models.

Contract: a :class:`Strategy` is pure. Given an interruption kind, the job size, the
config and whether a warm standby is free, :meth:`Strategy.recover` returns a
:class:`Recovery` describing the critical-path downtime, whether progress rolls
back to the last checkpoint, and any capacity lost while the job runs shrunk. The
engine applies it; nothing here keeps state.

Strategies (names are the keys of the JSON output):
    stop_restart           checkpoint-restart, relaunch time grows with scale
    parcae                 shrink/rebuild in place (Parcae/Oobleck kind), runs shrunk until
                           the node returns, reconfiguration grows with scale
    nvrx                   NVRx in-process restart from a local checkpoint
    trainmover             warm standby takes the failed rank's role; flat downtime
    trainmover_no_standby  no warm standby: the joiner is allocated and warmed on the
                           critical path of an unexpected failure ("overlapped path": a
                           planned leave still warms the joiner while training goes on)

Measured downtimes: :func:`load_measured_downtimes` reads the JSON written by
``benchmarks/downtime.py`` and overrides the matching paper defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import DowntimeModel, SimConfig
from trainmover_ext.simulate.events import EventKind

# Scale anchor of the models whose default was stated for a 1,024-GPU job.
REF_GPUS_1K = 1024


@dataclass(frozen=True)
class Recovery:
    """What one interruption costs a strategy."""

    downtime_s: float
    """Critical-path seconds the whole job does not compute (infra cost included)."""
    rollback_to_checkpoint: bool = False
    """True: progress since the last checkpoint is lost and redone."""
    abandon_inflight: bool = False
    """True: the partially computed in-flight iteration is lost (no checkpoint rollback)."""
    shrunk_gpu_s: float = 0.0
    """GPU-seconds that stop contributing while the job runs shrunk, after the downtime."""
    used_standby: bool = False
    """True: a warm standby took the failed rank's role (the engine refills its slot)."""


def scaled(ref_s: float, gpus: int, ref_gpus: int, exponent: float) -> float:
    """``ref_s * (gpus / ref_gpus) ** exponent``: the power-law scale model."""
    return ref_s * (gpus / ref_gpus) ** exponent


@dataclass(frozen=True)
class Strategy:
    """One recovery strategy; see the module docstring for the list."""

    name: str
    uses_checkpoint: bool
    """Rolls back to the last checkpoint after an unexpected failure (and pays save stalls). The others save
    only when job losses are modelled, which roll every strategy back."""
    standby_capable: bool
    """Can use warm standby machines."""

    def hang_detect_s(self, model: DowntimeModel) -> float:
        """Seconds before this strategy notices a hang: TrainMover's progress watch, NVRx's monitor, or else
        the collective watchdog's timeout."""
        if self.name.startswith("trainmover"):
            return model.tm_hang_detect_s
        return model.nvrx_hang_detect_s if self.name == "nvrx" else model.watchdog_timeout_s

    def recover(self, kind: EventKind, cfg: SimConfig, standby_free: bool, hang: bool = False) -> Recovery:
        """Cost of one interruption of ``kind`` for a job of ``cfg.gpus`` GPUs (``hang``: an unexpected one
        that is a hang, whose detection comes first)."""
        model = cfg.downtimes
        gpus = cfg.gpus
        # rebalances are started by the scheduler at a boundary it picked: no detection,
        # diagnosis or node hunt, hence no infrastructure cost
        infra = 0.0 if kind is EventKind.REBALANCE else cfg.infra_cost_s
        if hang and kind is EventKind.UNEXPECTED:
            infra += self.hang_detect_s(model)
        unexpected = kind is EventKind.UNEXPECTED
        if kind is EventKind.JOB_LOSS or self.name == "stop_restart":
            # A job loss relaunches every strategy's job from its last checkpoint, as a stop-restart does.
            restart = scaled(model.restart_ref_s, gpus, model.restart_ref_gpus, model.restart_scale_exp)
            # a planned stop saves first so nothing is redone; an unexpected one rolls back
            rollback = unexpected or kind is EventKind.JOB_LOSS
            save = 0.0 if rollback else cfg.checkpoint_save_s
            return Recovery(downtime_s=infra + save + restart + cfg.checkpoint_load_s, rollback_to_checkpoint=rollback)
        if self.name == "nvrx":
            restart = scaled(model.nvrx_inprocess_s, gpus, REF_GPUS_1K, model.nvrx_scale_exp)
            save = 0.0 if unexpected else cfg.checkpoint_save_s
            return Recovery(
                downtime_s=infra + save + restart + cfg.checkpoint_load_s,
                rollback_to_checkpoint=unexpected,
            )
        if self.name == "parcae":
            reconfig = scaled(model.parcae_reconfig_ref_s, gpus, REF_GPUS_1K, model.parcae_scale_exp)
            # a rebalance brings its replacement with it; otherwise the job runs one
            # model-parallel replica short until the machine is back
            shrink_gpus = min(model.parcae_shrink_gpus, gpus)
            shrunk = 0.0 if kind is EventKind.REBALANCE else shrink_gpus * model.parcae_regrow_hours * 3600.0
            return Recovery(downtime_s=infra + reconfig, abandon_inflight=unexpected, shrunk_gpu_s=shrunk)
        if self.name in ("trainmover", "trainmover_no_standby"):
            penalty = model.tm_promotion_penalty_iters * cfg.iteration_s  # the promoted rank's first steps
            if not unexpected:
                # planned and rebalance: the leaver is alive, the joiner warms in the background
                return Recovery(downtime_s=infra + model.tm_planned_s + penalty)
            flat = scaled(model.tm_unexpected_s, gpus, REF_GPUS_1K, model.tm_unexpected_scale_exp)
            with_standby = self.standby_capable and standby_free
            cold = 0.0 if with_standby else model.tm_cold_join_s
            return Recovery(downtime_s=infra + flat + cold + penalty, abandon_inflight=True, used_standby=with_standby)
        raise ConfigError(f"--strategies: unknown strategy {self.name!r}; choose from {', '.join(STRATEGY_NAMES)}")


STRATEGIES: dict[str, Strategy] = {
    "stop_restart": Strategy(name="stop_restart", uses_checkpoint=True, standby_capable=False),
    "parcae": Strategy(name="parcae", uses_checkpoint=False, standby_capable=False),
    "nvrx": Strategy(name="nvrx", uses_checkpoint=True, standby_capable=False),
    "trainmover_no_standby": Strategy(name="trainmover_no_standby", uses_checkpoint=False, standby_capable=False),
    "trainmover": Strategy(name="trainmover", uses_checkpoint=False, standby_capable=True),
}
STRATEGY_NAMES = tuple(STRATEGIES)
BASELINES = ("stop_restart", "parcae", "nvrx", "trainmover_no_standby")


def fit_scale_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(downtime) against log(ranks); 0 for fewer than 2 scales."""
    usable = [(r, s) for r, s in points if r > 0 and s > 0]
    if len({r for r, _ in usable}) < 2:
        return 0.0
    xs = [math.log(r) for r, _ in usable]
    ys = [math.log(s) for _, s in usable]
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=False)) / var


def _positive(doc: dict, key: str, path: Path) -> float | None:
    """``doc[key]`` as a positive float, None when absent; ConfigError when malformed."""
    if key not in doc or doc[key] is None:
        return None
    try:
        value = float(doc[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--downtimes-json: {path}: {key!r} is not a number: {doc[key]!r}") from exc
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--downtimes-json: {path}: {key!r} must be a finite number >= 0, got {value}")
    return value


def load_measured_downtimes(path: str | Path, base: DowntimeModel) -> tuple[DowntimeModel, float | None, list[str]]:
    """Override ``base`` with the measurements in a ``benchmarks/downtime.py`` JSON.

    Keys used, each optional: ``restart_s`` (stop-restart, at ``ranks`` GPUs when given,
    else at the model's reference scale), ``unexpected_s``, ``planned_s``,
    ``nvrx_inprocess_s``, ``iteration_s`` and ``scale: [{ranks, unexpected_s}]`` (fits the
    TrainMover scale exponent). Missing keys keep the paper defaults.

    Returns ``(model, iteration_s or None, names of the keys applied)``.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--downtimes-json: cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--downtimes-json: {path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"--downtimes-json: {path} must hold a JSON object, got {type(doc).__name__}")
    changes: dict[str, float | int] = {}
    applied: list[str] = []
    for key, field_name in (
        ("restart_s", "restart_ref_s"),
        ("unexpected_s", "tm_unexpected_s"),
        ("planned_s", "tm_planned_s"),
        ("nvrx_inprocess_s", "nvrx_inprocess_s"),
    ):
        value = _positive(doc, key, path)
        if value is not None:
            changes[field_name] = value
            applied.append(key)
    ranks = _positive(doc, "ranks", path)
    if "restart_s" in applied and ranks:
        changes["restart_ref_gpus"] = int(ranks)
        applied.append("ranks")
    points: list[tuple[int, float]] = []
    for entry in doc.get("scale") or []:
        if isinstance(entry, dict):
            r, s = _positive(entry, "ranks", path), _positive(entry, "unexpected_s", path)
            if r and s:
                points.append((int(r), s))
    if points:
        changes["tm_unexpected_scale_exp"] = fit_scale_exponent(points)
        applied.append("scale")
        if "unexpected_s" not in applied:
            # anchor the fitted curve on the measured point closest to the 1K reference
            ref_ranks, ref_s = min(points, key=lambda p: abs(math.log(p[0] / REF_GPUS_1K)))
            changes["tm_unexpected_s"] = ref_s * (REF_GPUS_1K / ref_ranks) ** changes["tm_unexpected_scale_exp"]
    iteration = _positive(doc, "iteration_s", path)
    if iteration is not None:
        applied.append("iteration_s")
    return replace(base, **changes), iteration, applied
