"""Logging configuration: level, per-process label, JSON lines."""

from __future__ import annotations

import json
import logging

import pytest

from trainmover_ext.errors import ConfigError
from trainmover_ext.logconfig import configure


@pytest.fixture
def restore_logging():
    yield
    configure(level="WARNING", json_lines=False, label="agent")


def test_json_lines_carry_the_process_label(capsys, restore_logging):
    configure(level="INFO", json_lines=True, label="rank 3")
    logging.getLogger("trainmover_ext.migration.worker").info("recovering at epoch %d", 2)
    logging.getLogger("x").debug("below the level")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    assert lines[0]["process"] == "rank 3" and lines[0]["level"] == "INFO"
    assert lines[0]["msg"] == "recovering at epoch 2" and lines[0]["logger"] == "trainmover_ext.migration.worker"


def test_text_lines_and_the_environment(capsys, monkeypatch, restore_logging):
    monkeypatch.setenv("TRAINMOVER_LOG_LEVEL", "error")
    monkeypatch.setenv("RANK", "5")
    configure()
    logging.getLogger("a").warning("dropped")
    logging.getLogger("a").error("kept")
    err = capsys.readouterr().err
    assert "dropped" not in err and "ERROR [rank 5] a: kept" in err
    assert len(logging.getLogger().handlers) == len(set(logging.getLogger().handlers))


def test_a_bad_level_names_the_flag(restore_logging):
    with pytest.raises(ConfigError, match="--tm-log-level"):
        configure(level="LOUD")
