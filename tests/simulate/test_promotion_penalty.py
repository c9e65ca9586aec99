"""--tm-promotion-penalty-iters: the iterations TrainMover's job loses to a promoted rank's slower first
steps, charged at the iteration time on top of each of its recoveries; the default is our measurement
(none measurable on 2 cores), listed with its source."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainmover_ext.cli import main
from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import DowntimeModel, SimConfig
from trainmover_ext.simulate.events import EventKind
from trainmover_ext.simulate.strategies import STRATEGIES


def _cost(cfg, name, kind, standby_free=True):
    return STRATEGIES[name].recover(kind, cfg, standby_free=standby_free).downtime_s


@pytest.mark.parametrize("kind", [EventKind.UNEXPECTED, EventKind.PLANNED, EventKind.REBALANCE])
@pytest.mark.parametrize(
    "name,standby_free", [("trainmover", True), ("trainmover", False), ("trainmover_no_standby", True)]
)
def test_each_trainmover_recovery_pays_the_penalty_at_the_iteration_time(kind, name, standby_free):
    base = SimConfig(iteration_s=4.0)
    slow = replace(base, downtimes=DowntimeModel(tm_promotion_penalty_iters=2.5))
    extra = _cost(slow, name, kind, standby_free) - _cost(base, name, kind, standby_free)
    assert extra == pytest.approx(10.0)


@pytest.mark.parametrize("name", ["stop_restart", "nvrx", "parcae"])
def test_other_strategies_do_not(name):
    base = SimConfig(iteration_s=4.0)
    slow = replace(base, downtimes=DowntimeModel(tm_promotion_penalty_iters=2.5))
    assert _cost(slow, name, EventKind.UNEXPECTED) == _cost(base, name, EventKind.UNEXPECTED)


def test_the_flag_is_listed_with_its_source_and_refused_when_negative(tmp_path):
    with pytest.raises(ConfigError, match="--tm-promotion-penalty-iters"):
        DowntimeModel(tm_promotion_penalty_iters=-1.0)
    out = tmp_path / "p.json"
    argv = ["simulate", "--gpus", "1024", "--weeks", "1", "--replicas", "1", "--json", str(out)]
    assert main(argv) == 0
    entry = next(i for i in json.loads(out.read_text())["inputs"] if i["name"] == "tm_promotion_penalty_iters")
    assert (entry["value"], entry["source"]) == (0.0, "measured") and "downtime.json" in entry["reference"]
    assert main([*argv, "--tm-promotion-penalty-iters", "3"]) == 0
    entry = next(i for i in json.loads(out.read_text())["inputs"] if i["name"] == "tm_promotion_penalty_iters")
    assert (entry["value"], entry["source"]) == (3.0, "assumed")
