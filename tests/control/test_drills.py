"""The straggler and slow-link drills' specs: parsed, refused with the flag named, and a link delay added
only to the waits of its two ends on each other, inside the wait (so it counts as waiting, not compute)."""

from __future__ import annotations

import contextlib
import time

import pytest

from trainmover_ext.errors import ConfigError
from trainmover_ext.launch import progress
from trainmover_ext.runtime.slowdown import LinkDelay, Slowdown, SlowdownClock, spin


def test_specs_parse_and_bad_ones_are_refused_with_the_flag_named():
    assert Slowdown.parse("3:1.5:20") == Slowdown(3, 1.5, 20)
    assert LinkDelay.parse("0:2:0.005:20") == LinkDelay((0, 2), 0.005, 20)
    assert LinkDelay.parse("4:1:0.5").start == 1
    for bad in ("0:2", "0:0:0.1", "0:2:0", "0:2:x", "-1:2:0.1", "0:2:0.1:0", "0:2:11"):
        with pytest.raises(ConfigError, match="--tm-inject-link-delay"):
            LinkDelay.parse(bad)
    with pytest.raises(ConfigError, match="--tm-inject-slowdown"):
        Slowdown.parse("1:0.5")


def test_a_link_delay_lengthens_only_the_waits_of_its_ends_on_each_other():
    seen: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def observer(group, op, peer=None):
        began = time.monotonic()
        yield
        seen.append((f"{group}/{peer}", time.monotonic() - began))

    iteration = [5]
    delay = LinkDelay((0, 2), 0.05, start=6)
    assert delay.peer_of(0) == 2 and delay.peer_of(2) == 0 and delay.peer_of(1) is None
    wrapped = delay.wrap(observer, 2, lambda: iteration[0])
    with wrapped("pp", 1, 0):  # before FROM: not delayed
        pass
    iteration[0] = 6
    with wrapped("pp", 2, 0):
        pass
    with wrapped("pp", 3, 3), wrapped("dp", 4, None):  # another peer, a collective: not delayed
        pass
    waits = dict(seen)
    assert waits["pp/0"] >= 0.05 and [k for k, _ in seen] == ["pp/0", "pp/0", "dp/None", "pp/3"]
    assert seen[0][1] < 0.04 and waits["dp/None"] < 0.04 and waits["pp/3"] < 0.04


def test_a_slowdown_adds_compute_time_in_proportion_and_a_sleep_would_not(tmp_path, monkeypatch):
    """The drill's extra work is CPU time (what compute time counts off the device), FACTOR - 1 times the
    iteration's own, and only from FROM on."""
    path = tmp_path / "beat"
    path.write_bytes(b"\0" * 8)
    monkeypatch.setattr(progress, "_writer", None)
    progress.start(str(path))
    clock = SlowdownClock(Slowdown(0, 1.5, start=2))
    for iteration in (1, 2):
        progress.mark("iteration")
        clock.began()
        spin(0.06)
        time.sleep(0.05)
        clock.ended(iteration)
        progress.iteration_done(iteration)
    monkeypatch.setattr(progress, "_writer", None)
    first, second = (s.compute_s for s in progress.read_compute(str(path)))
    assert 0.055 <= first < 0.08, first
    assert 1.4 <= second / first <= 1.6, (first, second)
