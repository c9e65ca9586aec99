"""GPU health on a node: what NVML says of each slot's GPU, and which answers make a GPU unfit to train on.

Contract:
- :func:`read_nvml` is the only code that talks to NVML (``nvidia-ml-py``, the ``pynvml`` module): for
  one device index it returns the raw answers as a plain dict (the form the unit tests record). A query
  the driver does not support is left out; a device NVML cannot open raises :class:`GpuHealthUnavailable`.
- :func:`parse` turns such a dict into a :class:`GpuReading`; :func:`problems` says, in words, what makes
  the GPU unfit: XID errors since the agent started watching, uncorrected ECC errors (volatile), a
  hardware slowdown, a hardware thermal or power-brake slowdown (the clocks are being held down by
  the board, not by the workload), or a software thermal slowdown. An idle GPU, an application clock
  setting or the software power cap are normal, as are correctable ECC errors (they are counted).
- :class:`GpuHealthWatch` (the agent, on a node where NVML starts) reads every slot's GPU at most every
  ``interval_s`` and publishes one :class:`~trainmover_ext.control.records.GpuHealthReport` per node
  (``health/<host>``) when a slot's problems change; the leading controller's straggler watch treats a
  slot with problems like a straggler in it (:mod:`trainmover_ext.control.straggler_watch`). Where NVML
  is missing (every CPU machine) :meth:`GpuHealthWatch.start` says so once and the watch does nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trainmover_ext.errors import TrainMoverError

logger = logging.getLogger(__name__)

# NVML's clock event (throttle) reason bits, from nvml.h (nvmlClocksEventReason*).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
UNFIT_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
"""Throttle reasons that mean the board holds the clocks down (heat, power delivery), not the workload."""


class GpuHealthUnavailable(TrainMoverError):
    """NVML is not installed, does not start, or cannot open the device."""


@dataclass(frozen=True)
class GpuReading:
    """One read of one GPU."""

    index: int
    xid_errors: list[int] = field(default_factory=list)
    """XID error codes seen since the watch began (NVML's critical-XID events)."""
    ecc_uncorrected: int | None = None
    """Volatile (since the driver loaded) uncorrected ECC errors; None where ECC is off or unsupported."""
    ecc_corrected: int | None = None
    throttle: tuple[str, ...] = ()
    """The active clock event reasons (:data:`THROTTLE_REASONS`), by name."""
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None


def parse(index: int, raw: dict[str, Any]) -> GpuReading:
    """The reading in ``raw`` (see :func:`read_nvml` for its keys; a missing key is a query not answered)."""
    mask = raw.get("throttle_mask")
    throttle = tuple(name for bit, name in sorted(THROTTLE_REASONS.items()) if mask is not None and mask & bit)
    unknown = (mask or 0) & ~sum(THROTTLE_REASONS)
    if unknown:
        throttle += (f"unknown_0x{unknown:x}",)
    power_mw = raw.get("power_mw")
    return GpuReading(
        index=index,
        xid_errors=[int(x) for x in raw.get("xid_errors", [])],
        ecc_uncorrected=raw.get("ecc_uncorrected"),
        ecc_corrected=raw.get("ecc_corrected"),
        throttle=throttle,
        sm_clock_mhz=raw.get("sm_clock_mhz"),
        max_sm_clock_mhz=raw.get("max_sm_clock_mhz"),
        temperature_c=raw.get("temperature_c"),
        power_w=None if power_mw is None else power_mw / 1000.0,
    )


def problems(reading: GpuReading) -> list[str]:
    """What makes the GPU unfit to train on, in words (empty: fit)."""
    out = []
    if reading.xid_errors:
        out.append(f"XID errors {sorted(set(reading.xid_errors))}")
    if reading.ecc_uncorrected:
        out.append(f"{reading.ecc_uncorrected} uncorrected ECC errors")
    slow = [r for r in reading.throttle if r in UNFIT_REASONS]
    if slow:
        clocks = ""
        if reading.sm_clock_mhz is not None and reading.max_sm_clock_mhz:
            clocks = f" (SM clock {reading.sm_clock_mhz} of {reading.max_sm_clock_mhz} MHz)"
        out.append(f"clocks held down: {', '.join(slow)}{clocks}")
    return out


def read_nvml(nvml: Any, handle: Any, events: Any | None) -> dict[str, Any]:
    """The raw answers of NVML (``nvml`` is the imported ``pynvml`` module) for one device ``handle``; the
    XID events waiting in ``events`` (an NVML event set the device was registered in) are drained."""
    raw: dict[str, Any] = {}

    def ask(key: str, call: Any, *args: Any) -> None:
        try:
            raw[key] = call(handle, *args)
        except nvml.NVMLError:
            pass  # not supported by this board or driver: left out

    # nvidia-ml-py renamed "throttle reasons" to "event reasons" (the old name is kept as an alias)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    ask("throttle_mask", reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    ask("sm_clock_mhz", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
    ask("max_sm_clock_mhz", nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM)
    ask("temperature_c", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    ask("power_mw", nvml.nvmlDeviceGetPowerUsage)
    ecc, volatile = nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_VOLATILE_ECC
    ask("ecc_uncorrected", ecc, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, volatile)
    ask("ecc_corrected", ecc, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, volatile)
    xids = []
    while events is not None:
        try:
            event = nvml.nvmlEventSetWait(events, 0)
        except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing waiting
            break
        xids.append(int(event.eventData))
    raw["xid_errors"] = xids
    return raw


class GpuHealthWatch:
    """See the module docstring; the agent writes what :meth:`poll` returns as its node's report."""

    def __init__(self, slots: int, *, interval_s: float = 5.0) -> None:
        self.slots, self.interval_s = slots, interval_s
        self.nvml: Any = None
        self._handles: list[Any] = []
        self._events: list[Any] = []
        self._xids: dict[int, list[int]] = {}
        self._last: dict[int, list[str]] = {}
        self.unfit: dict[int, list[str]] = {}
        """Each slot's problems at the last read."""
        self.reads = 0
        """Reads done so far."""
        self._read_at = 0.0
        self.readings: dict[int, GpuReading] = {}

    def start(self) -> bool:
        """Open NVML and the slots' devices; False (said once, at INFO) where there is none."""
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, a driver without devices
            logger.info("GPU health: not read on this node (%s)", exc)
            return False
        self.nvml = pynvml
        for index in range(min(self.slots, count)):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            events = None
            try:
                events = pynvml.nvmlEventSetCreate()
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
            except pynvml.NVMLError as exc:
                logger.info("GPU health: XID events of GPU %d not available (%s)", index, exc)
                events = None
            self._handles.append(handle)
            self._events.append(events)
        return True

    def poll(self, now: float | None = None) -> dict[int, list[str]] | None:
        """Read every slot's GPU when due; the slots' problems when they changed since the last read (None:
        not read, or nothing changed)."""
        now = time.monotonic() if now is None else now
        if self.nvml is None or now - self._read_at < self.interval_s:
            return None
        self._read_at = now
        self.reads += 1
        found: dict[int, list[str]] = {}
        for index, (handle, events) in enumerate(zip(self._handles, self._events, strict=True)):
            try:
                raw = read_nvml(self.nvml, handle, events)
            except self.nvml.NVMLError as exc:
                found[index] = [f"NVML cannot read the GPU ({exc})"]
                continue
            self._xids.setdefault(index, []).extend(raw["xid_errors"])
            raw["xid_errors"] = self._xids[index]
            self.readings[index] = parse(index, raw)
            found[index] = problems(self.readings[index])
        self.unfit = found
        if found == self._last:
            return None
        self._last = found
        return found

    def forget_last(self) -> None:
        """The last problems were not published: the next read returns them again."""
        self._last = {}

    def close(self) -> None:
        if self.nvml is None:
            return
        for events in self._events:
            if events is not None:
                try:
                    self.nvml.nvmlEventSetFree(events)
                except self.nvml.NVMLError:
                    pass
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass
        self.nvml = None
