"""Every input of a projection names its source: measured, published or assumed, and fitted when it was
fitted to the reference paper's own outputs (issue: the simulator as evidence). Pure logic and the CLI."""

from __future__ import annotations

import json
from dataclasses import fields

from trainmover_ext.cli import main
from trainmover_ext.simulate.config import PAPER_CALIBRATION, DowntimeModel, SimConfig, calibrated_to_paper
from trainmover_ext.simulate.sources import CALIBRATED_SOURCES, DEFAULT_SOURCES, inputs_of

FITTED = {
    "restart_ref_s",
    "restart_ref_gpus",
    "restart_scale_exp",
    "checkpoint_load_s",
    "parcae_reconfig_ref_s",
    "parcae_scale_exp",
    "tm_cold_join_s",
    "standby_replace_hours",
}


def test_every_input_has_a_default_source():
    names = {f.name for f in fields(SimConfig) if f.name != "downtimes"} | {f.name for f in fields(DowntimeModel)}
    assert set(DEFAULT_SOURCES) == names, "a new input needs its source in DEFAULT_SOURCES"
    assert {s.kind for s in DEFAULT_SOURCES.values()} <= {"measured", "published", "assumed"}
    assert all(s.reference for s in DEFAULT_SOURCES.values())


def test_no_default_is_fitted_to_the_paper_and_the_calibration_is_named_as_fitted():
    """The defaults are published figures or stated assumptions; the values fitted to the paper's own
    projection come only with --calibrate-to-paper, and are then marked fitted, never measured."""
    assert [i.name for i in inputs_of(SimConfig()) if i.fitted] == []
    # no hangs and no cascades: the paper's projection has none
    assert set(PAPER_CALIBRATION) == set(CALIBRATED_SOURCES) == FITTED | {"hang_fraction", "cascades"}
    cfg = calibrated_to_paper(SimConfig())
    assert cfg.downtimes.restart_ref_s == 540.0 and cfg.standby_replace_hours == 48.0
    inputs = {i.name: i for i in inputs_of(cfg, calibrated=True)}
    assert FITTED == {n for n, i in inputs.items() if i.fitted}
    assert all(inputs[n].source == "assumed" for n in FITTED), "a value fitted to the paper is no measurement"
    assert (
        inputs["unexpected_per_planned"].source == "published"
        and "Llama 3" in inputs["unexpected_per_planned"].reference
    )
    kept = calibrated_to_paper(SimConfig(), keep={"restart_ref_s"})  # a flag or a measurement wins
    assert kept.downtimes.restart_ref_s == DowntimeModel().restart_ref_s and kept.downtimes.restart_scale_exp == 0.17


def test_the_json_carries_each_input_with_its_source(tmp_path, capsys):
    measured = tmp_path / "downtime.json"
    measured.write_text(json.dumps({"unexpected_s": 4.0, "iteration_s": 0.5}))
    out = tmp_path / "sim.json"
    argv = ["simulate", "--gpus", "2048", "--days", "2", "--downtimes-json", str(measured), "--nvrx-s", "60"]
    argv += ["--calibrate-to-paper", "--restart-s", "300"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    by_name = {i["name"]: i for i in doc["inputs"]}
    assert set(by_name) == set(DEFAULT_SOURCES)
    assert by_name["tm_unexpected_s"] == {
        "name": "tm_unexpected_s",
        "value": 4.0,
        "source": "measured",
        "reference": f"{measured}:unexpected_s",
        "fitted": False,
    }
    assert by_name["iteration_s"]["source"] == "measured"
    assert (
        by_name["nvrx_inprocess_s"]["source"] == "assumed"
        and "command line" in by_name["nvrx_inprocess_s"]["reference"]
    )
    assert by_name["gpus"]["value"] == 2048 and "command line" in by_name["gpus"]["reference"]
    assert by_name["restart_ref_s"]["value"] == 300 and not by_name["restart_ref_s"]["fitted"]
    assert set(doc["fitted_inputs"]) == FITTED - {"restart_ref_s"}
    text = capsys.readouterr().out
    assert "tm_unexpected_s = 4.0: measured" in text and "fitted to the paper's own projection" in text


def test_check_without_paper_is_refused(capsys):
    assert main(["simulate", "--gpus", "1024", "--days", "1", "--check"]) == 2
    assert "--paper" in capsys.readouterr().err


def test_the_operators_question_node_mttf_and_the_standby_count_to_keep(tmp_path, capsys):
    """--mttf-node-hours H sets the per-GPU MTTF to H x GPUs per node; with --standbys S the report sets S
    beside the count that maximises goodput per GPU (idle standbys charged), which is never worse; giving
    two MTTFs is refused by name."""
    out = tmp_path / "sim.json"
    argv = ["simulate", "--gpus", "4096", "--days", "7", "--replicas", "1", "--mttf-node-hours", "2000"]
    assert main([*argv, "--standbys", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {i["name"]: i for i in doc["inputs"]}["gpu_mttf_hours"]["value"] == 2000 * 8
    assert abs(doc["job_mttf_hours"] - 2000 / 512) < 1e-9
    given, best = doc["standby_choice"]["given"], doc["standby_choice"]["best"]
    assert given["standbys"] == 0 and best["standbys"] > 0 and best["ettr"] > given["ettr"], doc["standby_choice"]
    assert "standbys 0 (given)" in capsys.readouterr().out
    assert main([*argv, "--mttf-hours", "3"]) == 2
    assert "--mttf-node-hours" in capsys.readouterr().err
