"""Job losses (--job-loss-mttf-hours): the whole job is lost, every strategy restarts from its last
checkpoint, so the strategies that otherwise recover without one (TrainMover, shrink/rebuild) take saves
too: at the checkpoint interval, or with --checkpoint-young-daly at Daly's optimum for the losses' MTTF."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from trainmover_ext.cli import main
from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.checkpointing import young_daly_interval_s
from trainmover_ext.simulate.config import SimConfig
from trainmover_ext.simulate.engine import simulate
from trainmover_ext.simulate.events import EventKind, interruption_stream
from trainmover_ext.simulate.strategies import STRATEGIES

LOSS_H = 24.0


def _cfg(**kw) -> SimConfig:
    base = dict(gpus=8192, weeks=8, replicas=1, cascades=False, checkpoint_save_s=30.0, job_loss_mttf_hours=LOSS_H)
    return SimConfig(**(base | kw))


def _first(stream, n):
    return [next(stream) for _ in range(n)]


def test_losses_come_at_their_rate_and_move_no_machine_interruption():
    cfg = _cfg()
    mixed = _first(interruption_stream(cfg, seed=4), 3000)
    losses = [e for e in mixed if e.kind is EventKind.JOB_LOSS]
    machines = [e for e in mixed if e.kind is not EventKind.JOB_LOSS]
    assert machines == _first(interruption_stream(replace(cfg, job_loss_mttf_hours=0.0), seed=4), len(machines))
    span_h = mixed[-1].run_s / 3600.0
    assert len(losses) == pytest.approx(span_h / LOSS_H, rel=0.25)
    assert [e.run_s for e in mixed] == sorted(e.run_s for e in mixed)


def test_trainmover_saves_and_a_loss_rolls_it_back_to_its_last_checkpoint():
    cfg = _cfg()
    run = simulate(cfg, STRATEGIES["trainmover"], standbys=20, seed=1)
    losses = run.events["job_loss"]
    assert losses > 30
    interval = cfg.checkpoint_interval_s(rolls_back_on_failure=False)
    assert interval == 30 * 60.0
    saves = cfg.work_s / interval  # at least: every save of progress that a rollback made it redo too
    assert saves * cfg.checkpoint_save_s <= run.stall_s <= (saves + losses) * cfg.checkpoint_save_s
    # Each loss redoes the progress since its last save (uniform over the interval) and an in-flight
    # iteration of each machine failure.
    failures = run.events["unexpected"]
    assert run.redone_s == pytest.approx(losses * interval / 2 + failures * cfg.iteration_s / 2, rel=0.25)
    calm = simulate(replace(cfg, job_loss_mttf_hours=0.0), STRATEGIES["trainmover"], standbys=20, seed=1)
    assert calm.stall_s == 0 and "job_loss" not in calm.events


def test_a_loss_costs_every_strategy_a_full_restart():
    cfg = _cfg()
    restart = STRATEGIES["stop_restart"].recover(EventKind.JOB_LOSS, cfg, standby_free=True)
    for name in ("trainmover", "parcae", "nvrx"):
        recovery = STRATEGIES[name].recover(EventKind.JOB_LOSS, cfg, standby_free=True)
        assert recovery == restart and recovery.rollback_to_checkpoint and not recovery.used_standby


def test_young_daly_gives_each_strategy_the_optimum_for_what_rolls_it_back():
    cfg = _cfg(checkpoint_young_daly=True)
    assert cfg.checkpoint_interval_s(rolls_back_on_failure=False) == young_daly_interval_s(30.0, LOSS_H * 3600.0)
    both = 1.0 / (1.0 / cfg.job_mttf_s + 1.0 / (LOSS_H * 3600.0))
    assert cfg.checkpoint_interval_s() == young_daly_interval_s(30.0, both)
    assert math.isinf(replace(cfg, job_loss_mttf_hours=0.0).checkpoint_interval_s(rolls_back_on_failure=False))


def test_the_flag_is_listed_with_its_source_and_refused_when_negative(tmp_path):
    with pytest.raises(ConfigError, match="--job-loss-mttf-hours"):
        SimConfig(job_loss_mttf_hours=-1.0)
    out = tmp_path / "p.json"
    argv = ["simulate", "--gpus", "1024", "--weeks", "2", "--replicas", "1", "--checkpoint-save-s", "30"]
    assert main([*argv, "--job-loss-mttf-hours", "48", "--checkpoint-young-daly", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    entry = next(i for i in doc["inputs"] if i["name"] == "job_loss_mttf_hours")
    assert (entry["value"], entry["source"]) == (48.0, "assumed")
    interval = next(i for i in doc["inputs"] if i["name"] == "checkpoint_interval_min")
    assert "job loss alone" in interval["reference"]
    assert doc["events"]["trainmover"]["job_loss"] == doc["events"]["stop_restart"]["job_loss"] > 0
