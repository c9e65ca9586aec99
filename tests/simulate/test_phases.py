"""TrainMover's recovery composed from the phases ``benchmarks/downtime.py`` measured (detection,
decision, communicators and joiner, state, first iteration), and its growth with scale from a stated
model, not a fitted exponent."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from trainmover_ext.simulate.config import DowntimeModel, SimConfig
from trainmover_ext.simulate.events import EventKind
from trainmover_ext.simulate.phases import CONTROL_S_PER_GPU, STEPS, measured_phases
from trainmover_ext.simulate.strategies import STRATEGIES, load_measured_downtimes

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "downtime.json"


def _unexpected(doc):
    return [e for e in doc["events"] if e.get("scenario") == "unexpected"]


def test_each_phase_is_the_median_of_the_recoveries_steps():
    doc = json.loads(COMMITTED.read_text())
    phases = measured_phases(doc)
    events = _unexpected(doc)
    assert phases is not None and phases.events == len(events) >= 3 and phases.ranks == 8
    at = [[e["plan"]["steps_s"][s] for s in STEPS] for e in events]
    deltas = [[row[0]] + [b - a for a, b in zip(row, row[1:], strict=False)] for row in at]
    for d in deltas:  # the first iteration's own work is the engine's: only its excess is recovery
        d[-1] -= doc["iteration_s"]
    got = [phases.detect_s, phases.decide_s, phases.join_s, phases.transfer_s, phases.first_iteration_s]
    assert got == pytest.approx([statistics.median(max(0.0, d[i]) for d in deltas) for i in range(len(STEPS))])
    assert phases.recovery_s == pytest.approx(sum(got))


def test_the_composed_recovery_replaces_the_lost_time_and_leaves_the_redo_to_the_engine():
    """A lost time (``unexpected_s``) holds the killed iteration's redo, which the engine charges again
    from the in-flight fraction: the phases do not."""
    model, _, applied = load_measured_downtimes(COMMITTED, DowntimeModel())
    phases = measured_phases(json.loads(COMMITTED.read_text()))
    assert phases is not None and "phases" in applied and "unexpected_s" not in applied
    assert model.tm_unexpected_s == pytest.approx(phases.recovery_s - 8 * CONTROL_S_PER_GPU)
    assert model.tm_promotion_penalty_iters == max(0.0, phases.penalty_iters)
    assert phases.penalty_iters == statistics.median(
        e["penalty_iters"] for e in _unexpected(json.loads(COMMITTED.read_text()))
    )
    cfg = SimConfig(gpus=8, gpus_per_node=8, downtimes=model, infra_cost_s=0.0)
    recovery = STRATEGIES["trainmover"].recover(EventKind.UNEXPECTED, cfg, standby_free=True)
    penalty_s = max(0.0, phases.penalty_iters) * cfg.iteration_s  # the promoted rank's first steps
    assert recovery.downtime_s == pytest.approx(phases.recovery_s + penalty_s) and recovery.abandon_inflight


def test_the_recovery_grows_by_the_stated_control_work_per_gpu_and_nothing_is_fitted(tmp_path):
    model = DowntimeModel()
    small, big = SimConfig(gpus=1024, downtimes=model), SimConfig(gpus=131072, downtimes=model)
    grow = (
        STRATEGIES["trainmover"].recover(EventKind.UNEXPECTED, big, standby_free=True).downtime_s
        - STRATEGIES["trainmover"].recover(EventKind.UNEXPECTED, small, standby_free=True).downtime_s
    )
    assert grow == pytest.approx(CONTROL_S_PER_GPU * (131072 - 1024))
    doc = json.loads(COMMITTED.read_text())
    doc["scale"] = [{"ranks": 8, "unexpected_s": 2.0}, {"ranks": 64, "unexpected_s": 16.0}]  # grows as N
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    fitted, _, _ = load_measured_downtimes(path, model)
    assert fitted.tm_unexpected_scale_exp == 0.0


def test_a_file_without_phases_uses_its_lost_time(tmp_path):
    doc = json.loads(COMMITTED.read_text())
    del doc["events"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    model, _, applied = load_measured_downtimes(path, DowntimeModel())
    assert "phases" not in applied and "unexpected_s" in applied
    assert model.tm_unexpected_s == doc["unexpected_s"]
    assert model.tm_planned_s == max(0.0, doc["planned_s"])
    doc["planned_s"] = -0.59
    path.write_text(json.dumps(doc))
    model, _, _ = load_measured_downtimes(path, DowntimeModel())
    assert model.tm_planned_s == 0.0  # a lost time measured below 0 (noise) reads as nothing lost


def test_the_first_iteration_counts_only_beyond_a_steady_one():
    """The engine runs the first iteration after a recovery itself (the killed iteration, from its start):
    a recovery that held that iteration's whole length charged it twice, one steady iteration per failure."""
    steps = {"detected": 0.1, "decided": 0.2, "joined": 0.5, "transferred": 0.6, "first_iteration": 1.6}
    doc = {"iteration_s": 0.9, "events": [{"scenario": "unexpected", "plan": {"steps_s": steps}, "penalty_iters": 0}]}
    phases = measured_phases(doc)
    assert phases is not None
    assert phases.first_iteration_s == pytest.approx(0.1)
    assert phases.recovery_s == pytest.approx(0.7)  # fault to the first iteration's end, less a steady one
