"""--checkpoint-young-daly: checkpoint-based strategies save at Daly's optimum for the save's cost and the
job MTTF, the engine charges saves and rollbacks at that interval, and the interval is the best one."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.checkpointing import young_daly_interval_s
from trainmover_ext.simulate.cli import add_parser, config_from_args, run
from trainmover_ext.simulate.config import SimConfig
from trainmover_ext.simulate.engine import simulate, simulate_replicas
from trainmover_ext.simulate.events import EventKind, Interruption
from trainmover_ext.simulate.sources import inputs_of
from trainmover_ext.simulate.strategies import STRATEGIES


def build_parser() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser().add_subparsers())


def test_daly_interval_against_youngs_first_order_and_its_bound():
    # Young's sqrt(2 delta M) for a save far cheaper than the MTBF; Daly's terms shift it by under 2 % here.
    assert young_daly_interval_s(60.0, 10_800.0) == pytest.approx(math.sqrt(2 * 60 * 10_800) - 60, rel=0.02)
    assert young_daly_interval_s(60.0, 10_800.0) == pytest.approx(1098.77, abs=0.01)
    assert young_daly_interval_s(30.0, 10.0) == 10.0  # a save costing over twice the MTBF: every MTBF
    for bad in ((0.0, 10.0), (1.0, 0.0), (math.inf, 10.0)):
        with pytest.raises(ValueError):
            young_daly_interval_s(*bad)


def test_the_config_derives_the_interval_from_the_save_and_the_job_mttf():
    cfg = SimConfig(gpus=8192, checkpoint_save_s=60.0, checkpoint_young_daly=True)
    assert cfg.checkpoint_interval_s() == young_daly_interval_s(60.0, cfg.job_mttf_s)
    assert replace(cfg, checkpoint_young_daly=False).checkpoint_interval_s() == 30 * 60.0
    with pytest.raises(ConfigError, match="--checkpoint-save-s"):
        SimConfig(checkpoint_young_daly=True)  # an asynchronous save (0 s) has no optimum


def test_a_failure_rolls_back_to_the_last_daly_checkpoint():
    cfg = SimConfig(gpus=1024, weeks=1 / 7, replicas=1, checkpoint_save_s=30.0, checkpoint_young_daly=True)
    interval = cfg.checkpoint_interval_s()
    at = 2.5 * interval
    res = simulate(cfg, STRATEGIES["stop_restart"], events=[Interruption(run_s=at, kind=EventKind.UNEXPECTED)])
    assert res.redone_s == pytest.approx(at - 2 * interval)
    # Companion: at the fixed 30 minutes the same failure redoes another amount.
    fixed = simulate(
        replace(cfg, checkpoint_young_daly=False),
        STRATEGIES["stop_restart"],
        events=[Interruption(run_s=at, kind=EventKind.UNEXPECTED)],
    )
    assert fixed.redone_s == pytest.approx(at % 1800.0) and fixed.redone_s != pytest.approx(res.redone_s)


def test_dalys_interval_beats_half_and_twice_it():
    cfg = SimConfig(
        gpus=8192, checkpoint_save_s=60.0, checkpoint_young_daly=True, weeks=8, replicas=4, unexpected_per_planned=0
    )
    best = simulate_replicas(cfg, STRATEGIES["stop_restart"]).ettr
    for factor in (0.5, 2.0):
        other = replace(
            cfg, checkpoint_young_daly=False, checkpoint_interval_min=cfg.checkpoint_interval_s() * factor / 60
        )
        assert simulate_replicas(other, STRATEGIES["stop_restart"]).ettr < best - 0.01, factor


def test_the_flag_names_its_interval_among_the_inputs_and_refuses_a_sweep_of_it(capsys):
    args = build_parser().parse_args(["--checkpoint-young-daly", "--checkpoint-save-s", "60", "--days", "1"])
    cfg, origins = config_from_args(args)
    assert cfg.checkpoint_young_daly
    by_name = {i.name: i for i in inputs_of(cfg, measured=origins.measured, given=origins.given)}
    assert by_name["checkpoint_interval_min"].value == pytest.approx(cfg.checkpoint_interval_s() / 60, abs=1e-3)
    assert "Daly" in by_name["checkpoint_interval_min"].reference
    swept = build_parser().parse_args(
        ["--checkpoint-young-daly", "--checkpoint-save-s", "60", "--sweep", "checkpoint_interval_min=10:60"]
    )
    with pytest.raises(ConfigError, match="sweep checkpoint_save_s instead"):
        run(swept)
