"""``trainmover simulate --replay``: a measured chaos run predicted from its schedule and other benchmarks' results."""

from __future__ import annotations

import json
import os

import pytest

from trainmover_ext.cli import main
from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.replay import STRATEGIES, replay

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def _downtime():
    events = [
        {"scenario": "unexpected", "controllable_loss_iters": v}
        for v in (1.0, 2.0, 9.0)  # median 2
    ] + [{"scenario": "restart_fork", "controllable_loss_iters": v} for v in (4.0, 5.0, 6.0)]  # median 5
    return {"measured_at": {"date": "d", "commit": "c"}, "events": events}


def _detection(kill=0.05, hang=0.55):
    return {"faults": [{"kind": "sigkill", "median_s": kill}, {"kind": "sigstop", "median_s": hang}]}


def _chaos():
    runs = [
        {"strategy": "trainmover", "gap": 25, "seed": 0, "steady_iteration_s": 0.5, "twin_wall_s": 100.0,
         "wall_s": 110.0, "ettr_rel": 0.9091, "save_interval": 4},
        {"strategy": "restart_fork", "gap": 25, "seed": 0, "steady_iteration_s": 0.5, "twin_wall_s": 100.0,
         "wall_s": 120.0, "ettr_rel": 0.8333, "save_interval": 4},
    ]  # fmt: skip
    events = []
    for strategy in ("trainmover", "restart_fork"):
        events += [
            {"strategy": strategy, "gap": 25, "seed": 0, "kind": "kill", "iteration": 11, "fraction_inside": 0.5,
             "cascade": None},
            {"strategy": strategy, "gap": 25, "seed": 0, "kind": "hang", "iteration": 30, "fraction_inside": 0.25,
             "cascade": "joiner" if strategy == "trainmover" else None},
        ]  # fmt: skip
    # another run's events never count for this one
    events.append(
        {"strategy": "trainmover", "gap": 100, "seed": 0, "kind": "kill", "iteration": 5, "fraction_inside": 0}
    )
    return {"measured_at": {"date": "d", "commit": "c"}, "runs": runs, "events": events}


def test_each_failure_costs_what_the_model_composes_from_the_inputs():
    doc = replay(_chaos(), _downtime(), _detection())
    tm, fork = doc["trainmover"], doc["stop_restart"]
    # TrainMover: kill 0.5 + 2 + 0.05/0.5; hang 0.25 + 2 + 0.55/0.5, plus 2 for its cascade
    tm_iters = (0.5 + 2 + 0.1) + (0.25 + 2 + 1.1 + 2)
    assert tm["predicted_wall_s"] == pytest.approx(100 + tm_iters * 0.5, abs=1e-3)
    # fork restart: kill 0.5 + (10 mod 4 = 2 rolled back) + 5; hang 0.25 + (29 mod 4 = 1) + 5 + (0.5/0.5)
    fork_iters = (0.5 + 2 + 5) + (0.25 + 1 + 5 + 1.0)
    assert fork["predicted_wall_s"] == pytest.approx(100 + fork_iters * 0.5, abs=1e-3)
    assert fork["predicted_ettr"] == pytest.approx(100 / fork["predicted_wall_s"], abs=1e-4)
    assert (tm["measured_wall_s"], fork["measured_wall_s"]) == (110.0, 120.0)
    assert tm["wall_error"] == pytest.approx(tm["predicted_wall_s"] / 110.0 - 1, abs=1e-4)
    assert not fork["within_tolerance"] and not tm["within_tolerance"]  # 107.4 against 120; 104.0 against 110
    names = {i["name"]: i for i in doc["inputs"]}
    assert names["tm_loss_iters"]["value"] == 2.0 and names["fork_loss_iters"]["value"] == 5.0
    assert all(i["source"] == "measured" and i["reference"] for i in doc["inputs"])


def test_a_prediction_within_two_percent_passes():
    chaos = _chaos()
    doc = replay(chaos, _downtime(), _detection())
    for run in chaos["runs"]:  # the measured walls made to match what the model predicts
        key = next(k for k, v in STRATEGIES.items() if v == run["strategy"])
        run["wall_s"] = doc[key]["predicted_wall_s"] * 1.01
        run["ettr_rel"] = run["twin_wall_s"] / run["wall_s"]
    again = replay(chaos, _downtime(), _detection())
    assert again["trainmover"]["within_tolerance"] and again["stop_restart"]["within_tolerance"]


def test_missing_inputs_are_refused_with_what_to_run(capsys):
    with pytest.raises(ConfigError, match="restart_fork"):
        replay({"runs": [r for r in _chaos()["runs"] if r["strategy"] == "trainmover"]}, _downtime(), _detection())
    with pytest.raises(ConfigError, match="sigstop"):
        replay(_chaos(), _downtime(), {"faults": [{"kind": "sigkill", "median_s": 0.05}]})
    with pytest.raises(ConfigError, match="downtime.py"):
        replay(_chaos(), {"events": []}, _detection())
    assert main(["simulate", "--replay", os.path.join(RESULTS, "chaos.json")]) == 2
    assert "--detection-json" in capsys.readouterr().err


def test_replay_of_the_committed_chaos_run(tmp_path, capsys):
    """The committed chaos results predicted from the committed downtime and detection results: the report
    and its JSON (whether the prediction holds is the figure, reported, not assumed)."""
    out = tmp_path / "replay.json"
    code = main(
        [
            "simulate",
            "--replay",
            os.path.join(RESULTS, "chaos.json"),
            "--downtimes-json",
            os.path.join(RESULTS, "downtime.json"),
            "--detection-json",
            os.path.join(RESULTS, "detection.json"),
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())["replay"]
    with open(os.path.join(RESULTS, "chaos.json")) as f:
        chaos = json.load(f)
    for key, name in STRATEGIES.items():
        block = doc[key]
        assert {"predicted_wall_s", "measured_wall_s", "predicted_ettr", "measured_ettr"} <= set(block)
        walls = [r["wall_s"] for r in chaos["runs"] if r["strategy"] == name]
        assert block["measured_wall_s"] == pytest.approx(sum(walls), abs=0.01)
        assert len(block["runs"]) == len(walls) >= 6  # three seeds at two failure rates
    assert code == (0 if doc["trainmover"]["within_tolerance"] and doc["stop_restart"]["within_tolerance"] else 1)
    assert "Replay of the chaos run" in capsys.readouterr().out
