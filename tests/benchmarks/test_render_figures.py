"""The README's and docs/benchmarks.md's figures are what ``benchmarks/render_figures.py`` renders from the
committed ``benchmarks/results/*.json``; the companions show the check failing on an edited README and
the rendering touching nothing outside the figure markers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import render_figures as rf

from harness.jobs import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "render_figures.py")
README = os.path.join(REPO_ROOT, "README.md")
DOCS = os.path.join(REPO_ROOT, "docs", "benchmarks.md")


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, "--check", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_readme_and_docs_match_the_committed_results():
    proc = check()
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_a_hand_edited_readme(tmp_path):
    """Companion: one figure line changed inside the markers."""
    text = open(README).read()
    block = text[text.index(rf.BEGIN) : text.index(rf.END)]
    line = next(x for x in block.split("\n") if x.startswith("| "))
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(line, line.replace("|", "| 0.015 x restart_s |", 1), 1))
    proc = check("--readme", str(edited), "--docs", DOCS)
    assert proc.returncode == 1 and "render_figures.py" in proc.stderr, proc.stderr
    assert "0.015 x restart_s" in proc.stderr  # the diff shows what differs


def test_rendering_rewrites_only_between_the_markers(tmp_path):
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    before = "# Title\n\nuser text\n"
    after = "\n## Layout\nmore user text\n"
    readme.write_text(f"{before}{rf.BEGIN} (keep this line) -->\nstale figures\n{rf.END}{after}")
    shutil.copy(DOCS, docs)
    args = ["--readme", str(readme), "--docs", str(docs)]
    subprocess.run([sys.executable, SCRIPT, *args], check=True, capture_output=True, timeout=120)
    text = readme.read_text()
    assert text.startswith(f"{before}{rf.BEGIN} (keep this line) -->\n") and text.endswith(f"{rf.END}{after}")
    assert "stale figures" not in text
    assert check(*args).returncode == 0


def test_a_result_from_before_the_definitions_renders_as_not_yet_measured(tmp_path):
    (tmp_path / "downtime.json").write_text(json.dumps({"unexpected_s": 0.275, "restart_s": 18.1}))
    lines = "\n".join(rf.readme_block(str(tmp_path)))
    assert "0.275" not in lines and "18.1" not in lines
    assert lines.count(rf.NOT_YET) >= len(rf.DOWNTIME_ROWS) + len(rf.CHAOS_ROWS)


def _downtime(n_runs: int) -> dict:
    lost = {"median": 0.8, "min": 0.6, "max": 1.1, "n": n_runs, "values": []}
    scen = {"lost_s": lost, "bit_identical": True, "state_identical": True}
    return {
        "measured_at": {"date": "2026-12-04 10:00 UTC", "commit": "abc123def456", "dirty": True},
        "command": "python benchmarks/downtime.py --json benchmarks/results/downtime.json",
        "scenarios": {"unexpected": scen, "restart_fork": dict(scen, lost_s=dict(lost, median=8.0))},
        "unexpected_over_restart_fork": 0.1,
        "skipped": {"nvrx": "nvidia-resiliency-ext is not installed"},
        "scale": [],
        "iteration_s": 0.4,
        "config": {"save_interval": 5},
        "events": [],
    }


def test_a_figure_is_a_median_with_its_range_runs_date_and_commit(tmp_path):
    (tmp_path / "downtime.json").write_text(json.dumps(_downtime(3)))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "**0.800 s** (0.600-1.10, 3 runs)" in text and "**8.00 s**" in text
    assert "2026-12-04 10:00 UTC" in text and "`abc123def456` plus uncommitted changes" in text
    assert "skipped: nvidia-resiliency-ext is not installed" in text
    assert "| TrainMover, `trainmover migrate` (planned) (`planned_lost_s`) | " + rf.NOT_YET in text


def test_the_downtime_row_says_how_many_joiners_were_warm(tmp_path):
    data = _downtime(3)
    plan = {"epoch": 1}
    data["events"] = [
        {"scenario": "unexpected", "plan": plan, "joiner_warm": "warm"},
        {"scenario": "unexpected", "plan": plan, "joiner_warm": "promoted before every role was warm"},
        {"scenario": "restart_fork", "joiner_warm": False},  # a baseline's event: no plan, not counted
    ]
    (tmp_path / "downtime.json").write_text(json.dumps(data))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "| TrainMover, SIGKILL, a standby takes the rank (warm in 1 of 2) (`unexpected_lost_s`) |" in text


def test_the_planned_switch_is_said_beside_the_moves_lost_time(tmp_path):
    data = _downtime(3)
    (tmp_path / "downtime.json").write_text(json.dumps(data))
    assert "A planned move's switch alone" not in "\n".join(rf.readme_block(str(tmp_path)))  # not measured
    data |= {"planned_switch_s": 0.097, "planned_switch_range_s": [0.041, 0.119], "planned_switch_iters": 0.248}
    (tmp_path / "downtime.json").write_text(json.dumps(data))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "costs 0.097 s (0.041 to 0.119), 0.248 iterations (goal ≤ 0.5)" in text


def test_the_distributed_optimizer_line_prefers_its_own_alternating_run(tmp_path):
    """The A/B of ``downtime_distopt.json`` (more trials, the two scenarios alternating) over the
    downtime run's; with the recovery's own phase, which no twin's pace enters."""

    def doc(distopt: float, unexpected: float, trials: int) -> dict:
        events = [
            {"scenario": "unexpected", "first_iteration_s": 1.0},
            {"scenario": "distopt", "first_iteration_s": 1.2},
        ]
        return _downtime(3) | {
            "config": {"trials": trials, "save_interval": 5},
            "distopt_lost_s": distopt,
            "distopt_lost_range_s": [distopt - 0.5, distopt + 0.5],
            "unexpected_lost_s": unexpected,
            "unexpected_lost_range_s": [unexpected - 0.5, unexpected + 0.5],
            "distopt_over_unexpected": round(distopt / unexpected, 4),
            "events": events,
        }

    (tmp_path / "downtime.json").write_text(json.dumps(doc(2.0, 0.8, 3)))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "one SIGKILL loses 2.00 s (1.50 to 2.50) against 0.800 s" in text and "3 trials of each" in text
    (tmp_path / "downtime_distopt.json").write_text(json.dumps(doc(1.5, 2.5, 5)))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "one SIGKILL loses 1.50 s (1.00 to 2.00) against 2.50 s (2.00 to 3.00) replicated, 5 trials" in text
    assert "(0.600×, goal ≤ 1.5" in text and "1.20 s against 1.00 s (1.20×)" in text


def test_fewer_than_three_runs_say_so(tmp_path):
    (tmp_path / "downtime.json").write_text(json.dumps(_downtime(1)))
    assert "(0.600-1.10, 1 run; a figure needs 3)" in "\n".join(rf.readme_block(str(tmp_path)))


def test_results_json_keeps_every_value_with_one_row_a_line():
    from common import dumps

    payload = {"a": {"b": [1, 2]}, "iterations": [{"run": "x", "iteration": 1, "start": 0.5, "end": 1.0}], "events": []}
    text = dumps(payload)
    assert json.loads(text) == payload
    assert '\n    {"run": "x", "iteration": 1, "start": 0.5, "end": 1.0}\n' in text


def test_a_chaos_figure_is_the_pooled_value_with_its_range_over_runs(tmp_path):
    from chaos_goals import GOALS, goals_met, trainmover_summary

    def ev(seed: int, gap: int, recovery: float) -> dict:
        return {"strategy": "trainmover", "seed": seed, "gap": gap, "controllable_loss_iters": 1.0}, {
            "recovery_iters": recovery,
            "penalty_iters": 0.2,
            "cascade": None,
            "joiner_warm": "warm",
        }

    runs, events = [], []
    for seed, recovery in ((0, 0.5), (1, 0.7), (2, 0.9)):
        tags, fields = ev(seed, 25, recovery)
        events.append(tags | fields)
        runs.append({"strategy": "trainmover", "gap": 25, "seed": seed, "ettr_rel": 0.95, "lost_per_failure_s": 1.0})
    full = [dict(r, events=[e for e in events if e["seed"] == r["seed"]]) for r in runs]
    for r in full:
        r |= {"state_identical": True, "bit_identical": True, "restarts": 0, "scheduled_failures": 1}
        r |= {"kills_with_cascades": 1}
    tm = trainmover_summary(full)
    data = {
        "measured_at": {"date": "2026-12-04 10:00 UTC", "commit": "abc", "dirty": False},
        "command": "python benchmarks/chaos.py",
        "trainmover": tm,
        "goals": {k: f"{op} {b}" for k, (op, b) in GOALS.items()},
        "goals_met": goals_met(tm),
        "fault_free": {"plans": 0, "fenced": 0},
        "runs": [{k: v for k, v in r.items() if k != "events"} for r in full],
        "events": events,
        "seeds": [0, 1, 2],
        "gaps": [25],
    }
    (tmp_path / "chaos.json").write_text(json.dumps(data))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert "**0.700** (runs: median 0.700, 0.500-0.900, 3 runs)" in text  # the recovery median
    assert "| ETTR relative to the twin, a failure every ~100 iterations (`ettr_rel_g100`) | " + rf.NOT_YET in text


def test_the_steady_state_table_is_the_training_ratio_with_its_range_and_what_a_replacement_rebuilds(tmp_path):
    data = {
        "measured_at": {"date": "2026-12-04 10:00 UTC", "commit": "abc", "dirty": False},
        "command": "python benchmarks/comm.py --json benchmarks/results/comm.json",
        "training": [
            {
                "ranks": 8,
                "model": "demo",
                "layout": "TP2.PP2.DP2, --overlap-grad-reduce",
                "ratio": 1.04,
                "ratio_range": [0.97, 1.12],
                "runs": 5,
                "trainmover_it_s": 0.41,
                "plain_it_s": 0.39,
                "ratio_native_comm": 1.01,
                "ratio_native_comm_range": [0.98, 1.05],
            },
            {  # an older run, before the --tm-comm native job was part of each round
                "ranks": 8,
                "model": "tiny",
                "layout": "TP2.PP2.DP2, --overlap-grad-reduce",
                "ratio": 1.3,
                "ratio_range": [1.2, 1.4],
                "runs": 3,
                "trainmover_it_s": 0.3,
                "plain_it_s": 0.23,
            },
        ],
        "replacement": [
            {"ranks": 8, "groups_rebuilt": 10, "members_rebuilt": 22, "world_rebuilt": False},
            {"ranks": 4000, "groups_rebuilt": 12, "members_rebuilt": 2261, "world_rebuilt": False, "simulated": True},
        ],
    }
    (tmp_path / "comm.json").write_text(json.dumps(data))
    text = "\n".join(rf.readme_block(str(tmp_path)))
    assert (
        "| 8 ranks, demo model, TP2.PP2.DP2, --overlap-grad-reduce | 0.410 / 0.390 | **1.04** (0.970-1.12, 5 runs) | "
        "1.01 (0.980-1.05) |" in text
    )
    assert "| 0.300 / 0.230 | **1.30** (1.20-1.40, 3 runs) | - |" in text
    rebuilt = "| 4000 (simulated (megatron's groups, the real rule)) | 12 | 2261 | no |"
    assert rebuilt not in text, "the README keeps the ratio; what a replacement rebuilds is in docs/benchmarks.md"
    assert rebuilt in "\n".join(rf.docs_block(str(tmp_path)))
    # Companion: without the JSON the table says so instead of a figure.
    (tmp_path / "comm.json").unlink()
    assert "`python benchmarks/comm.py --json benchmarks/results/comm.json`" in "\n".join(
        rf.readme_block(str(tmp_path))
    )


def test_detection_is_a_line_in_the_readme_and_a_table_in_the_docs(tmp_path):
    fault = {"trials": 3, "goal": "g", "min_s": 0.04, "max_s": 0.06, "per_trial": []}
    data = {
        "measured_at": {"date": "2026-12-04 10:00 UTC", "commit": "abc", "dirty": False},
        "command": "python benchmarks/detection.py --json benchmarks/results/detection.json",
        "faults": [
            dict(
                fault,
                kind="sigkill",
                median_s=0.046,
                latencies_s=[0.045, 0.046, 0.061],
                right_rank=True,
                false_replacements=0,
                trained_on=True,
            ),
            dict(
                fault,
                kind="load",
                median_s=None,
                latencies_s=[],
                right_rank=None,
                false_replacements=2,
                trained_on=True,
            ),
        ],
    }
    (tmp_path / "detection.json").write_text(json.dumps(data))
    readme = "\n".join(rf.readme_block(str(tmp_path)))
    assert "SIGKILL 0.046 s," in readme and "2 ranks replaced that nobody failed" in readme
    docs = "\n".join(rf.docs_block(str(tmp_path)))
    assert "| SIGKILL | **0.046 s** (0.045-0.061, 3 runs) | yes | 0 (3 trials) | yes | g |" in docs
    # Companion: a culprit missed in one trial says so in both.
    data["faults"][0]["right_rank"] = False
    (tmp_path / "detection.json").write_text(json.dumps(data))
    assert "**not every** trial" in "\n".join(rf.readme_block(str(tmp_path)))
    assert "| **no** |" in "\n".join(rf.docs_block(str(tmp_path)))


def test_the_straggler_line_says_in_how_many_runs_the_slow_rank_was_not_named():
    """A run whose straggler was never named has no detection figure: the line says so rather than showing the
    median of the runs that named it as if it were all of them."""
    data = json.load(open(os.path.join(REPO_ROOT, "benchmarks", "results", "straggler.json")))
    data["trials"] = data["trials"][:2]
    data["detected_after_iterations"] = {"median": 31, "min": 31, "max": 31, "n": 1, "values": [31]}
    assert "(not named in 1 of 2 runs)" in rf.straggler_lines(data)[0]
    data["detected_after_iterations"] = {"median": 31, "min": 30, "max": 32, "n": 2, "values": [30, 32]}
    assert "not named" not in rf.straggler_lines(data)[0]
