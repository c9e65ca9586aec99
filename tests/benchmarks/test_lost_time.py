"""The one definition of lost time (``benchmarks/lost_time.py``) on runs whose answer is known."""

from __future__ import annotations

import math

import pytest
from lost_time import (
    Fault,
    Iteration,
    ettr_relative,
    event_record,
    iterations_from_records,
    lost_per_failure_s,
    resume_step_excess_s,
    spread,
    steady_iteration_s,
    wall_s,
    young_daly_interval_iters,
    young_daly_interval_s,
)


def run(durations: list[tuple[int, float]], start: float = 0.0, gaps: dict[int, float] | None = None):
    """Iterations back to back from ``start``; ``gaps[i]``: idle seconds before the record at index i."""
    its, t = [], start
    for i, (iteration, seconds) in enumerate(durations):
        t += (gaps or {}).get(i, 0.0)
        its.append(Iteration(iteration=iteration, start=t, end=t + seconds))
        t += seconds
    return its


TWIN = run([(i, 1.0) for i in range(1, 11)])
# SIGKILL 0.4 into iteration 5 (t 4.4), detected at 4.5, every rank resumed at 5.0; iteration 5 runs
# again, iteration 6 pays 0.5 s more (the post-promotion penalty).
FAULTED = run([(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1.5), (7, 1), (8, 1), (9, 1), (10, 1)], gaps={4: 1.0})
KILL = Fault(kind="kill", rank=3, t=4.4, iteration=5, detected_t=4.5, resume_t_by_rank={0: 4.9, 3: 5.0})


def test_lost_time_counts_the_killed_iterations_share_and_what_follows():
    assert wall_s(FAULTED, 1, 10) == pytest.approx(11.5)
    assert lost_per_failure_s(FAULTED, TWIN, 1, 1, 10) == pytest.approx(1.5)
    assert ettr_relative(FAULTED, TWIN, 1, 10) == pytest.approx(10 / 11.5)


def test_lost_time_is_per_scheduled_failure():
    assert lost_per_failure_s(FAULTED, TWIN, 3, 1, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lost_per_failure_s(FAULTED, TWIN, 0, 1, 10)


def test_the_old_definition_missed_the_killed_iterations_share():
    """Companion: from the kill to the end of the first iteration after the resume, less one steady
    iteration (the old ``downtime_report.lost_time``), is 0.4 s short: the part computed before the kill."""
    old = next(it.end for it in FAULTED if it.end > 5.0) - KILL.t - 1.0
    assert old == pytest.approx(0.6)
    assert lost_per_failure_s(FAULTED, TWIN, 1, 1, 10) - old == pytest.approx(0.4 + 0.5)


def test_event_record_splits_the_loss():
    e = event_record(KILL, FAULTED, TWIN, None, steady_s=1.0)
    assert e["fraction_inside"] == pytest.approx(0.4)
    assert e["detect_s"] == pytest.approx(0.1)
    assert e["resume_s_by_rank"] == {"0": pytest.approx(0.5), "3": pytest.approx(0.6)}
    assert e["first_iteration_s"] == pytest.approx(1.6)
    assert e["recovery_s"] == pytest.approx(0.5) and e["recovery_iters"] == pytest.approx(0.5)
    assert e["lost_s"] == pytest.approx(1.5)
    assert e["controllable_loss_iters"] == pytest.approx(1.5 - 0.4 - 0.1)
    # 4 iterations before the kill, against the first 4 after the resume (1 + 1.5 + 1 + 1)
    assert (e["penalty_n"], e["penalty_s"], e["penalty_window"]) == (4, pytest.approx(0.5), [5, 8])


def test_the_resume_step_s_excess_is_the_switch_of_a_planned_move():
    """A planned move: the ranks stall 0.2 s at boundary 6 (the hand-over), the joiner resumes at 6.15
    and its first iteration (7) takes 1.1 s: the step's excess over the twin is 0.3 s. The iterations of
    phase 1 (4 and 5, 0.25 s slower beside the joiner's set-up) are not in it."""
    faulted = run([(1, 1), (2, 1), (3, 1), (4, 1.25), (5, 1.25), (6, 1), (7, 1.1), (8, 1)], gaps={6: 0.2})
    twin = run([(i, 1.0) for i in range(1, 9)])
    move = Fault(kind="migrate", rank=5, t=3.5, iteration=4, resume_t_by_rank={0: 6.7, 5: 6.7 + 0.05})
    assert resume_step_excess_s(faulted, twin, 6.75) == pytest.approx(0.3)
    e = event_record(move, faulted, twin, None, steady_s=1.0)
    assert e["resume_step_excess_s"] == pytest.approx(0.3)
    assert e["lost_s"] == pytest.approx(0.8)  # phase 1's 0.5 s and the switch's 0.3 s
    # An unexpected kill: the step from the boundary before the killed iteration to the end of its
    # re-run holds its computed share, detection, recovery and the re-run (2 s against 1).
    assert event_record(KILL, FAULTED, TWIN, None, 1.0)["resume_step_excess_s"] == pytest.approx(1.0)


def test_a_rollback_has_no_resume_step_to_compare():
    """After a rollback the record before the first one after the resume is a later iteration: the two
    boundaries are not one step apart, so there is no figure rather than a wrong one."""
    faulted = run([(i, 1.0) for i in range(1, 7)] + [(i, 1.0) for i in range(6, 11)], gaps={6: 2.5})
    assert resume_step_excess_s(faulted, TWIN, 8.5) is None
    assert resume_step_excess_s(FAULTED, TWIN, 0.5) is None  # the run's first record: no boundary before it


def test_an_unrecorded_detection_is_none_and_stays_in_the_controllable_loss():
    e = event_record(Fault(kind="kill", rank=3, t=4.4, iteration=5), FAULTED, TWIN, None, steady_s=1.0)
    assert e["detect_s"] is None and e["recovery_s"] is None and e["penalty_s"] is None
    assert e["controllable_loss_s"] == pytest.approx(1.5 - 0.4)


def test_a_rollback_is_counted_in_the_failure_that_caused_it():
    """Stop-restart: killed 0.5 into iteration 7, resumed from the checkpoint of iteration 5, so
    iteration 6 runs twice and 7 once more: 1.5 s of rework, 2 s of restart."""
    faulted = run([(i, 1.0) for i in range(1, 7)] + [(i, 1.0) for i in range(6, 11)], gaps={6: 2.5})
    fault = Fault(kind="kill", rank=3, t=6.5, iteration=7, detected_t=6.6, resume_t_by_rank={r: 8.5 for r in range(8)})
    assert lost_per_failure_s(faulted, TWIN, 1, 1, 10) == pytest.approx(3.5)
    e = event_record(fault, faulted, TWIN, None, steady_s=1.0)
    assert e["lost_s"] == pytest.approx(3.5) and e["fraction_inside"] == pytest.approx(0.5)


def test_events_share_the_run_and_add_up():
    twin = run([(i, 1.0) for i in range(1, 21)])
    faulted = run([(i, 1.0) for i in range(1, 21)], gaps={4: 0.7, 12: 1.1})
    a = Fault(kind="kill", rank=0, t=4.2, iteration=5)
    b = Fault(kind="hang", rank=1, t=13.9, iteration=13)
    ea, eb = event_record(a, faulted, twin, 13, 1.0), event_record(b, faulted, twin, None, 1.0)
    assert ea["lost_s"] == pytest.approx(0.7) and eb["lost_s"] == pytest.approx(1.1)
    assert ea["lost_s"] + eb["lost_s"] == pytest.approx(lost_per_failure_s(faulted, twin, 1, 1, 20))


def test_runs_of_different_iterations_cannot_be_compared():
    with pytest.raises(ValueError):
        lost_per_failure_s(FAULTED, run([(i, 1.0) for i in range(1, 8)]), 1, 1, 10)


def test_records_and_steady_time():
    its = iterations_from_records(
        [{"event": "startup"}, {"event": "iteration", "iteration": 1, "t_end": 3.0, "iteration_s": 2.0}]
    )
    assert its == [Iteration(iteration=1, start=1.0, end=3.0)]
    assert steady_iteration_s(run([(1, 9.0), (2, 9.0), (3, 1.0), (4, 2.0), (5, 1.0)])) == 1.0


def test_young_daly():
    assert young_daly_interval_s(1.0, 100.0) == pytest.approx(
        math.sqrt(200) * (1 + math.sqrt(0.005) / 3 + 0.005 / 9) - 1
    )
    assert young_daly_interval_s(5.0, 2.0) == 2.0  # a save longer than twice the MTBF: checkpoint every MTBF
    assert young_daly_interval_iters(0.2, 0.4, 25) == round(young_daly_interval_s(0.2, 10.0) / 0.4)
    assert young_daly_interval_iters(0.2, 0.4, 100) > young_daly_interval_iters(0.2, 0.4, 25)
    with pytest.raises(ValueError):
        young_daly_interval_s(0.0, 10.0)


def test_spread():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "values": [3.0, 1.0, 2.0]}
    assert spread([None])["median"] is None


def test_excess_by_phase_splits_the_lost_time_and_adds_up():
    """A failure in iteration 5 (a 1 s pause, iteration 6 0.5 s slower), and iteration 9 0.25 s slower while
    a refill warms beside the job: 0.5 s in the recovery, 0.25 s beside the refill, the pause between."""
    from lost_time import excess_by_phase

    faulted = run([(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1.5), (7, 1), (8, 1), (9, 1.25), (10, 1)], gaps={4: 1.0})
    out = excess_by_phase(faulted, TWIN, [5], [(9.6, 9.8)], 1, 10)
    assert out["recovery_s"] == pytest.approx(0.5) and out["refill_s"] == pytest.approx(0.25)
    assert out["other_iterations_s"] == pytest.approx(0.0) and out["between_iterations_s"] == pytest.approx(1.0)
    assert out["total_s"] == pytest.approx(1.75)
    # without the refill interval its 0.25 s counts among the other iterations
    assert excess_by_phase(faulted, TWIN, [5], [], 1, 10)["other_iterations_s"] == pytest.approx(0.25)
