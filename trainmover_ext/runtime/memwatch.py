"""How much memory a piece of work took beyond what the process already held.

:class:`PeakWindow` resets the kernel's resident-set high-water mark of this
process (``/proc/self/clear_refs``, Linux 4.0 and later) when the window opens,
and reads it back when it closes: the peak *during* the window, to the page,
whatever the process did before. Used around a state transfer, whose "no
extra memory" promise is: peak during the send <= resident size at its start
+ a small fraction of the state, and peak during the receive <= resident size
after it (everything received is kept) + the same fraction.

Caveat: the high-water mark is process-wide, so a later reader of the peak
(``VmHWM``, ``getrusage``) sees the peak since the last window, not since start.
Where ``/proc`` is missing the window reports zeros and ``measured`` is False.
"""

from __future__ import annotations

from dataclasses import dataclass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``); 0 where /proc is not available."""
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (``VmHWM``; see the module caveat); 0 without /proc."""
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:
        return 0


@dataclass
class PeakWindow:
    """Context manager: resident size at entry, peak inside, resident size at exit (bytes)."""

    start_rss: int = 0
    peak: int = 0
    end_rss: int = 0
    measured: bool = False

    def __enter__(self) -> PeakWindow:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak RSS to the current RSS
            self.measured = True
        except OSError:
            self.measured = False
        self.start_rss = rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_rss = rss_bytes()
        self.peak = peak_rss_bytes() if self.measured else 0
