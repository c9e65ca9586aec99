"""The chaos goals (``benchmarks/chaos_goals.py``) on comparisons whose answer is known, and failing where
one event breaks a goal."""

from __future__ import annotations

import copy

from chaos_goals import GOALS, goals_met, trainmover_summary


def event(controllable: float, recovery: float, penalty: float, *, cascade=None, warm="warm") -> dict:
    return {
        "controllable_loss_iters": controllable,
        "recovery_iters": recovery,
        "penalty_iters": penalty,
        "cascade": cascade,
        "joiner_warm": warm,
    }


def run(strategy: str, gap: int, seed: int, lost: float, ettr: float, events: list[dict]) -> dict:
    return {
        "strategy": strategy,
        "gap": gap,
        "seed": seed,
        "lost_per_failure_s": lost,
        "ettr_rel": ettr,
        "events": events,
        "state_identical": True,
        "bit_identical": True,
        "restarts": 0,
        "scheduled_failures": len(events),
        "kills_with_cascades": len(events),
    }


def good_events() -> list[dict]:
    return [event(1.0, 0.6, 0.2), event(1.1, 0.9, 0.4), event(1.4, 1.2, 0.3, cascade="joiner", warm="promoted")]


GOOD = [
    *(
        run("trainmover", gap, seed, 0.5, 0.95 if gap == 25 else 0.99, good_events())
        for gap in (25, 100)
        for seed in (0, 1, 2)
    ),
    *(run("restart_fork", gap, seed, 5.0, 0.5, []) for gap in (25, 100) for seed in (0, 1, 2)),
]


def test_every_goal_met():
    summary = trainmover_summary(GOOD)
    assert summary["controllable_loss_iters_mean"] == round((1.0 + 1.1 + 1.4) / 3, 4)
    assert summary["controllable_loss_iters_max"] == 1.1  # the cascade is judged as one event, on its own bound
    assert summary["controllable_loss_iters_cascade_max"] == 1.4
    assert summary["recovery_iters_median"] == 0.75 and summary["recovery_iters_max"] == 0.9  # warm joiners only
    assert summary["ettr_rel_g25"] == 0.95 and summary["ettr_rel_g100"] == 0.99
    assert summary["lost_over_fork_restart"] == 0.1
    assert goals_met(summary) == {k: True for k in GOALS}


def test_one_slow_recovery_with_a_warm_joiner_breaks_its_goal():
    runs = copy.deepcopy(GOOD)
    runs[0]["events"][1]["recovery_iters"] = 1.6
    met = goals_met(trainmover_summary(runs))
    assert not met["recovery_iters_max"] and met["recovery_iters_median"]


def test_a_cascade_over_its_bound_and_a_mean_over_its_goal():
    runs = copy.deepcopy(GOOD)
    for r in runs[:6]:
        r["events"][2]["controllable_loss_iters"] = 3.6
    met = goals_met(trainmover_summary(runs))
    assert not met["controllable_loss_iters_cascade_max"] and not met["controllable_loss_iters_mean"]
    assert met["controllable_loss_iters_max"]


def test_a_lost_ratio_and_an_ettr_below_their_goals():
    runs = copy.deepcopy(GOOD)
    for r in runs:
        if r["strategy"] == "trainmover" and r["gap"] == 100:
            r["ettr_rel"], r["lost_per_failure_s"] = 0.97, 1.0
    met = goals_met(trainmover_summary(runs))
    assert not met["ettr_rel_g100"] and met["ettr_rel_g25"]
    assert trainmover_summary(runs)["lost_over_fork_restart"] == 0.15 and met["lost_over_fork_restart"]
    runs[0]["lost_per_failure_s"] = 1.0  # now the median ratio is 0.2
    assert not goals_met(trainmover_summary(runs))["lost_over_fork_restart"]


def test_a_figure_no_event_recorded_is_not_met():
    runs = [run("trainmover", 25, 0, 0.5, 0.95, [event(1.0, 0.5, 0.1, warm="promoted before every role was warm")])]
    summary = trainmover_summary(runs)
    assert summary["recovery_iters_median"] is None and summary["lost_over_fork_restart"] is None
    met = goals_met(summary)
    assert not met["recovery_iters_median"] and not met["lost_over_fork_restart"] and not met["ettr_rel_g100"]
