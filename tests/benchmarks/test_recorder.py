"""The benchmark's per-process records: the state hash sees one bit of any parameter or optimizer state,
and installing the records makes every process's metrics writes land in its own file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from harness.jobs import REPO_ROOT
from harness.recorder import RECORDS_ENV, state_digest


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(5, 4)).sum().backward()
        opt.step()
    return model, opt


def _flip_last_bit(t: torch.Tensor) -> None:
    with torch.no_grad():
        flat = t.view(-1).view(torch.int32)
        flat[0] ^= 1


def test_same_training_same_hash():
    assert state_digest([_trained()[0]], _trained()[1]) == state_digest([_trained()[0]], _trained()[1])


def test_one_bit_of_a_parameter_changes_the_params_hash():
    model, opt = _trained()
    before = state_digest(model, opt)
    _flip_last_bit(next(model.parameters()))
    after = state_digest(model, opt)
    assert after["params"] != before["params"]


def test_one_bit_of_the_optimizer_state_changes_the_optimizer_hash_only():
    model, opt = _trained()
    before = state_digest(model, opt)
    p = next(model.parameters())
    _flip_last_bit(opt.state[p]["exp_avg_sq"])
    after = state_digest(model, opt)
    assert after["optimizer"] != before["optimizer"] and after["params"] == before["params"]


def test_a_hyperparameter_changes_the_optimizer_hash():
    model, opt = _trained()
    before = state_digest(model, opt)
    opt.param_groups[0]["lr"] *= 1.0000001
    assert state_digest(model, opt)["optimizer"] != before["optimizer"]


CHILD = """
import sys
sys.path.insert(0, {bench!r})
from harness import recorder
assert recorder.install_from_env()
from trainmover_training.training import MetricsLog
MetricsLog(None, False).write(event="recovered", t=1.5, epoch=2)
"""


def test_install_records_writes_of_a_rank_that_does_not_log(tmp_path):
    env = dict(os.environ, **{RECORDS_ENV: str(tmp_path)})
    code = CHILD.format(bench=os.path.join(REPO_ROOT, "benchmarks"))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, capture_output=True)
    (path,) = tmp_path.iterdir()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["process", "recovered"]
    assert records[1]["epoch"] == 2 and records[1]["pid"] == int(path.stem)
    assert abs(records[0]["process_start"] - records[1]["t_written"]) < 60
