"""--downtime-cv: each interruption's downtime is its strategy's figure times a lognormal factor of mean 1
and the given coefficient of variation, drawn from a stream of its own; every projection reports the
per-event downtime as a distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainmover_ext.cli import main
from trainmover_ext.errors import ConfigError
from trainmover_ext.simulate.config import SimConfig
from trainmover_ext.simulate.engine import simulate
from trainmover_ext.simulate.strategies import STRATEGIES


def _runs(cv: float):
    # Without cascades: whether a recovery is struck depends on its (spread) length.
    cfg = SimConfig(gpus=8192, weeks=8, replicas=1, downtime_cv=cv, cascades=False)
    fixed = simulate(SimConfig(gpus=8192, weeks=8, replicas=1, cascades=False), STRATEGIES["stop_restart"], seed=3)
    spread = simulate(cfg, STRATEGIES["stop_restart"], seed=3)
    return fixed, spread


def test_the_spread_has_mean_one_and_the_asked_variation_and_moves_no_interruption():
    fixed, spread = _runs(0.5)
    assert spread.events == fixed.events and len(fixed.downtimes) > 400  # the same interruptions, in order
    factors = np.asarray(spread.downtimes) / np.asarray(fixed.downtimes)
    assert factors.mean() == pytest.approx(1.0, abs=0.05)
    assert factors.std() / factors.mean() == pytest.approx(0.5, abs=0.08)
    assert spread.redone_s == pytest.approx(fixed.redone_s)  # rollbacks follow progress, not downtime
    dist = spread.downtime_distribution()
    assert dist["n"] == len(spread.downtimes) and dist["p95"] > dist["p50"] > 0


def test_without_a_spread_each_kind_costs_the_same():
    fixed, zero = _runs(0.0)
    assert zero.downtimes == fixed.downtimes
    assert len(set(np.round(fixed.downtimes, 6))) <= len(fixed.events) + 1  # one figure per kind (hangs apart)


@pytest.mark.parametrize("cv", [-0.1, 3.5, float("nan")])
def test_a_spread_out_of_range_is_refused(cv):
    with pytest.raises(ConfigError, match="--downtime-cv"):
        SimConfig(downtime_cv=cv)


def test_the_json_gives_each_strategys_downtime_per_event(tmp_path):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "simulate",
                "--gpus",
                "4096",
                "--weeks",
                "1",
                "--replicas",
                "1",
                "--downtime-cv",
                "0.3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    per = doc["downtime_per_event_s"]
    assert set(per) == set(doc["ettr"])
    assert all(set(d) == {"n", "mean", "p50", "p95", "max"} for d in per.values())
    assert per["stop_restart"]["p95"] > per["stop_restart"]["p50"]
    assert {"name": "downtime_cv", "value": 0.3} == {
        k: v for k, v in next(i for i in doc["inputs"] if i["name"] == "downtime_cv").items() if k in ("name", "value")
    }
