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
``benchmarks/downtime.py`` and overrides the matching defaults (TrainMover's recovery composed from its
measured phases, :mod:`.phases`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import DowntimeModel, SimConfig
from trainmover_ext.simulate.events import EventKind
from trainmover_ext.simulate.phases import measured_phases

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
            flat += model.tm_control_s_per_gpu * gpus  # the stated scale model (simulate/phases.py)
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


def _positive(doc: dict, key: str, path: Path) -> float | None:
    """``doc[key]`` as a float >= 0 (a negative one read as 0), None when absent; ConfigError when malformed."""
    if key not in doc or doc[key] is None:
        return None
    try:
        value = float(doc[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--downtimes-json: {path}: {key!r} is not a number: {doc[key]!r}") from exc
    if not math.isfinite(value):
        raise ConfigError(f"--downtimes-json: {path}: {key!r} must be a finite number, got {value}")
    # A lost time measured against a fault-free twin can come out below 0 (noise about nothing lost).
    return max(0.0, value)


def load_measured_downtimes(
    path: str | Path, base: DowntimeModel
) -> tuple[DowntimeModel, float | None, dict[str, str]]:
    """Override ``base`` with the measurements in a ``benchmarks/downtime.py`` JSON.

    Keys used, each optional: ``restart_s`` (stop-restart, at ``ranks`` GPUs when given, else at the
    model's reference scale), ``planned_s``, ``nvrx_inprocess_s``, ``iteration_s``, and TrainMover's
    unexpected recovery: composed from the ``events``' phases where the file has them
    (:mod:`.phases`: the recovery without the in-flight redo and the post-promotion penalty, which the
    engine charges, the latter as ``penalty_iters``), else ``unexpected_s``. Its growth with scale is the
    stated model's (``tm_control_s_per_gpu``), never fitted: ``scale`` rows are not read. Missing keys keep
    the defaults.

    Returns ``(model, iteration_s or None, {key applied: where its value came from})``.
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
    applied: dict[str, str] = {}
    phases = measured_phases(doc)
    keys = [("restart_s", "restart_ref_s"), ("planned_s", "tm_planned_s"), ("nvrx_inprocess_s", "nvrx_inprocess_s")]
    if phases is None:
        keys.append(("unexpected_s", "tm_unexpected_s"))
    else:
        # The phases at the measured size, less the control work the stated model adds back at any size.
        changes["tm_unexpected_s"] = max(0.0, phases.recovery_s - base.tm_control_s_per_gpu * phases.ranks)
        applied["phases"] = f"{path}: {phases.describe()}, less {phases.ranks} x tm_control_s_per_gpu"
        changes["tm_promotion_penalty_iters"] = max(0.0, phases.penalty_iters)
        applied["penalty_iters"] = (
            f"{path}: median penalty_iters of the same recoveries, {phases.penalty_iters:.3g} (below 0 read as 0)"
        )
    for key, field_name in keys:
        value = _positive(doc, key, path)
        if value is not None:
            changes[field_name] = value
            applied[key] = f"{path}:{key}"
    ranks = _positive(doc, "ranks", path)
    if "restart_s" in applied and ranks:
        changes["restart_ref_gpus"] = int(ranks)
        applied["ranks"] = f"{path}:ranks"
    iteration = _positive(doc, "iteration_s", path)
    if iteration is not None:
        applied["iteration_s"] = f"{path}:iteration_s"
    return replace(base, **changes), iteration, applied
