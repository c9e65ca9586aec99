"""Hints that used to name things that do not exist: each now names something a user can type."""

from __future__ import annotations

import argparse

import pytest

from trainmover_ext.errors import ConfigError, EtcdNotFound
from trainmover_ext.etcd.server import find_etcd_binary


def test_a_named_etcd_binary_that_is_missing_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINMOVER_ETCD_BINARY", str(tmp_path / "nonexistent"))
    with pytest.raises(EtcdNotFound, match="TRAINMOVER_ETCD_BINARY=.*nonexistent is not an executable file"):
        find_etcd_binary()
    monkeypatch.delenv("TRAINMOVER_ETCD_BINARY")
    assert find_etcd_binary()  # companion: without it, the etcd on PATH (installed by `make test`)


def test_the_missing_dataset_hint_is_a_command_that_builds_that_dataset(tmp_path):
    from trainmover_training.arguments import parse_args
    from trainmover_training.errors import ConfigError as TrainingConfigError

    prefix = tmp_path / "nope_text_document"
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
    argv += ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--data-path", str(prefix)]
    with pytest.raises(TrainingConfigError) as err:
        parse_args(argv=argv, world_size=1)
    hint = str(err.value)
    assert f"--input YOUR_TEXT_OR_JSONL --output-prefix {tmp_path / 'nope'}`" in hint, hint
    assert "_text_document_text_document" not in hint


def test_simulate_days_names_days():
    from trainmover_ext.simulate.cli import add_parser, config_from_args

    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_parser(sub)
    with pytest.raises(ConfigError, match="--days -1.0: must be > 0"):
        config_from_args(parser.parse_args(["--days", "-1"]))
    config_from_args(parser.parse_args(["--days", "2"]))  # companion: a valid value passes


def test_unreachable_etcd_hint_does_not_offer_an_embedded_etcd_to_status():
    from trainmover_ext.errors import EtcdUnavailable
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV

    with pytest.raises(EtcdUnavailable) as err:
        EtcdKV(EtcdClientConfig(endpoints=["127.0.0.1:1"], timeout_s=0.3, connect_timeout_s=0.3))
    assert "omit it" not in str(err.value) and "--tm-etcd-endpoints" in str(err.value)


@pytest.mark.parametrize("restarts", [0, 1])
def test_giving_up_on_live_recovery_says_whether_a_restart_or_the_jobs_end_follows(restarts):
    """With a restart left (--max-restarts 1, none used) the agent falls back to stop-restart; with none left
    the line says the job fails and what to change, instead of promising a restart that will not come."""
    from types import SimpleNamespace

    from trainmover_ext.launch.tm_supervisor import TrainMoverSupervisor

    lines: list[str] = []
    agent = SimpleNamespace(config=SimpleNamespace(max_restarts=1, node_rank=0), restarts=restarts, log=lines.append)
    sup = TrainMoverSupervisor(agent)
    events: list[str] = []
    sup._event = lambda what, detail: events.append(what)
    assert sup._fall_back("no replacement for rank 5 within 30s") == (False, 1)
    assert events == ["stop_restart"]
    if restarts == 0:
        assert lines == ["no replacement for rank 5 within 30s; falling back to stop-restart"]
    else:
        assert lines[0].startswith("no replacement for rank 5 within 30s; the job fails: no stop-restart is left")
        assert "--max-restarts 1" in lines[0] and "falling back" not in lines[0], lines
