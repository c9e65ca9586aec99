"""Sensitivity instead of a fit: how TrainMover's saving moves when one uncertain input moves over its range.

Contract (pure apart from the projections it runs; the CLI prints and writes what it returns):
- :func:`parse_sweep` reads ``NAME=LO:HI``: NAME is an input of the projection as the report lists it (a
  field of :class:`~.config.SimConfig` or of its downtime model, ``-`` or ``_`` alike), LO < HI, both
  finite numbers; anything else is a :class:`~trainmover_ext.errors.ConfigError` that names the inputs.
- :func:`sweep` projects the configuration once per end of each range, every other input at its value
  (one input at a time), and returns each strategy's waste reduction at both ends, and the **band**: per
  strategy, the lowest and highest reduction over the base projection and every end. A projection
  resting on inputs that are uncertain is a range, not a number.
- :data:`DEFAULT_BAND` (``--band``) is the range of every input that is an assumption, or a published
  figure read more than one way, each with why it spans what it spans.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, replace

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import SimConfig
from trainmover_ext.simulate.engine import Projection, project


@dataclass(frozen=True)
class Sweep:
    """One input's range."""

    name: str
    lo: float
    hi: float


@dataclass
class SweepResult:
    """Each strategy's waste reduction (percent) at each end of each range, and the band over them."""

    base: dict[str, float]
    ends: list[tuple[Sweep, dict[str, float], dict[str, float]]] = field(default_factory=list)
    """(the range, the reductions at LO, at HI)."""

    @property
    def band(self) -> dict[str, tuple[float, float]]:
        out = {}
        for name, value in self.base.items():
            seen = [value] + [at[name] for _, lo, hi in self.ends for at in (lo, hi) if name in at]
            out[name] = (min(seen), max(seen))
        return out

    def to_json(self) -> dict:
        return {
            "params": [
                {"name": s.name, "lo": s.lo, "hi": s.hi, "waste_reduction_pct": {"lo": lo, "hi": hi}}
                for s, lo, hi in self.ends
            ],
            "band": {name: {"min": lo, "max": hi} for name, (lo, hi) in self.band.items()},
        }


DEFAULT_BAND: tuple[tuple[Sweep, str], ...] = (
    (
        Sweep("restart_scale_exp", 0.0, 0.32),
        "stop-restart's growth: the paper's 8,192-GPU restart (none) to its 32-1,024 GPUs (0.32)",
    ),
    (
        Sweep("parcae_reconfig_ref_s", 21.0, 221.0),
        "Parcae's shrink alone (its grow-back overlapped) to shrink and grow (Fig. 1)",
    ),
    (Sweep("parcae_regrow_hours", 0.25, 4.0), "assumed: hours a shrunk job runs short"),
    (Sweep("standby_replace_hours", 4.0, 72.0), "assumed: hours to repair or re-provision a standby"),
    (Sweep("nvrx_inprocess_s", 30.0, 180.0), "assumed: NVRx publishes no latency figure"),
    (Sweep("tm_cold_join_s", 150.0, 390.0), "the paper's warm-up alone to its 6.47 min production restart delay"),
    (Sweep("checkpoint_interval_min", 10.0, 60.0), "assumed: minutes between checkpoints"),
    (Sweep("hang_fraction", 0.0, 0.3), "assumed: share of the failures that are hangs"),
    (Sweep("nvrx_hang_detect_s", 10.0, 600.0), "assumed: NVRx's monitor, from tight to the watchdog's"),
    (Sweep("iteration_s", 2.0, 10.0), "assumed: seconds per iteration"),
)
"""The default ranges (``--band``): (the range, why it spans that)."""


def sweepable() -> list[str]:
    """The inputs a range may be given for."""
    names = [f.name for f in fields(SimConfig) if f.name != "downtimes" and f.type not in ("bool", bool)]
    return names + [f.name for f in fields(SimConfig().downtimes)]


def parse_sweep(text: str) -> Sweep:
    """``NAME=LO:HI`` (see the module docstring)."""
    name, _, span = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    lo_text, _, hi_text = span.partition(":")
    try:
        lo, hi = float(lo_text), float(hi_text)
    except ValueError:
        raise ConfigError(f"--sweep {text!r}: expected NAME=LO:HI, e.g. restart_ref_s=80:300") from None
    if name not in sweepable():
        raise ConfigError(f"--sweep {text!r}: no input {name!r}; the inputs are {', '.join(sweepable())}")
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"--sweep {text!r}: LO and HI must be finite numbers with LO < HI")
    return Sweep(name, lo, hi)


def with_value(cfg: SimConfig, name: str, value: float) -> SimConfig:
    """``cfg`` with input ``name`` set to ``value``."""
    owner = cfg.downtimes if name in {f.name for f in fields(cfg.downtimes)} else cfg
    hint = typing.get_type_hints(type(owner))[name]
    typed = int(round(value)) if int in (hint, *typing.get_args(hint)) else value
    if owner is cfg:
        return replace(cfg, **{name: typed})
    return replace(cfg, downtimes=replace(cfg.downtimes, **{name: typed}))


def sweep(cfg: SimConfig, ranges: list[Sweep], base: Projection | None = None) -> SweepResult:
    """Project ``cfg`` at both ends of each range (see the module docstring)."""
    result = SweepResult(base=(base or project(cfg)).waste_reduction_pct())
    for s in ranges:
        at_lo = project(with_value(cfg, s.name, s.lo)).waste_reduction_pct()
        at_hi = project(with_value(cfg, s.name, s.hi)).waste_reduction_pct()
        result.ends.append((s, at_lo, at_hi))
    return result


def format_sweep(result: SweepResult, labels: dict[str, str]) -> str:
    """The report's sensitivity table: per range, each strategy's reduction at LO and at HI; then the band."""
    names = list(result.base)
    lines = ["sensitivity: TrainMover's waste reduction against each strategy, one input at a time"]
    for s, lo, hi in result.ends:
        lines.append(f"  {s.name} = {s.lo:g} .. {s.hi:g}")
        for name in names:
            lines.append(
                f"    {labels.get(name, name):38} {lo.get(name, math.nan):7.2f}% .. {hi.get(name, math.nan):.2f}%"
            )
    lines.append("  band (base and every end):")
    for name, (lo_pct, hi_pct) in result.band.items():
        lines.append(f"    {labels.get(name, name):38} {lo_pct:7.2f}% .. {hi_pct:.2f}%")
    return "\n".join(lines)
