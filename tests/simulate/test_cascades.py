"""Cascades: the machines go on failing while the job recovers. A failure that strikes a recovery costs
the time spent in it so far and a recovery of its own (which may be struck in turn); the interruptions
and the progress they destroy stay where they were. ``--no-cascades`` and ``--calibrate-to-paper`` (the
paper's projection has none) turn them off."""

from __future__ import annotations

import json
import math

import pytest

from trainmover_ext.cli import main
from trainmover_ext.simulate.config import SimConfig, calibrated_to_paper
from trainmover_ext.simulate.engine import simulate
from trainmover_ext.simulate.events import EventKind
from trainmover_ext.simulate.sources import inputs_of
from trainmover_ext.simulate.strategies import STRATEGIES

MTTF_S = 1800.0
"""A job failing every half hour: a stop-restart (about 466 s at 8K GPUs) is struck about a fifth of the time."""


def _cfg(**kw) -> SimConfig:
    base = dict(gpus=8192, mttf_hours=MTTF_S / 3600.0, unexpected_per_planned=0, hang_fraction=0.0, weeks=2)
    return SimConfig(**(base | kw))


def _expected_per_event(recovery_s: float) -> tuple[float, float]:
    """(cascades per interruption, mean downtime per interruption) when each recovery of ``recovery_s`` is
    struck by an exponential failure of mean ``MTTF_S``: attempts are geometric, a struck one costs the
    failure's time, which is exponential truncated at ``recovery_s``."""
    p = 1.0 - math.exp(-recovery_s / MTTF_S)
    struck_s = MTTF_S - recovery_s * math.exp(-recovery_s / MTTF_S) / p
    per_event = p / (1.0 - p)
    return per_event, recovery_s + per_event * struck_s


@pytest.mark.parametrize("name,extra", [("stop_restart", {}), ("trainmover", {"standby_replace_hours": 0.0})])
def test_a_recovery_is_struck_at_the_machines_failure_rate_and_pays_its_time_so_far(name, extra):
    cfg = _cfg(**extra)
    calm = simulate(_cfg(cascades=False, **extra), STRATEGIES[name], standbys=1, seed=5)
    stormy = simulate(cfg, STRATEGIES[name], standbys=1, seed=5)
    recovery_s = STRATEGIES[name].recover(EventKind.UNEXPECTED, cfg, standby_free=True).downtime_s
    assert calm.downtimes == pytest.approx([recovery_s] * len(calm.downtimes))  # one figure: the premise
    events = stormy.events["unexpected"]
    assert events == calm.events["unexpected"] > 500  # the same interruptions
    assert stormy.redone_s == pytest.approx(calm.redone_s)  # and the same progress lost to them
    per_event, mean_s = _expected_per_event(recovery_s)
    assert stormy.events["cascade"] / events == pytest.approx(per_event, rel=0.2)
    assert sum(stormy.downtimes) / events == pytest.approx(mean_s, rel=0.05)
    assert stormy.wall_s - calm.wall_s == pytest.approx(sum(stormy.downtimes) - sum(calm.downtimes))


def test_a_strategy_that_recovers_faster_is_struck_less():
    cfg = _cfg(standby_replace_hours=0.0)
    slow = simulate(cfg, STRATEGIES["stop_restart"], seed=2)
    fast = simulate(cfg, STRATEGIES["trainmover"], standbys=1, seed=2)
    assert fast.events["cascade"] / fast.events["unexpected"] < 0.5 * slow.events["cascade"] / slow.events["unexpected"]


def test_no_cascades_and_the_papers_calibration_turn_them_off(tmp_path):
    out = tmp_path / "p.json"
    argv = ["simulate", "--gpus", "1024", "--mttf-hours", "0.5", "--weeks", "1", "--replicas", "1", "--json"]
    assert main([*argv, str(out), "--no-cascades"]) == 0
    doc = json.loads(out.read_text())
    assert all("cascade" not in events for events in doc["events"].values())
    entry = next(i for i in doc["inputs"] if i["name"] == "cascades")
    assert (entry["value"], entry["source"]) == (False, "assumed")
    assert main([*argv, str(out)]) == 0
    assert json.loads(out.read_text())["events"]["stop_restart"]["cascade"] > 0  # on by default
    paper = calibrated_to_paper(SimConfig())
    assert paper.cascades is False
    entry = next(i for i in inputs_of(paper, calibrated=True) if i.name == "cascades")
    assert entry.source == "published" and not entry.fitted
