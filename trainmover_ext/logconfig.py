"""Python ``logging`` for every TrainMover process: level, a per-process prefix, optional JSON lines.

Contract:
- :func:`configure` is called once per process: by ``trainmover`` (the agent and the other
  subcommands) and by ``pretrain_gpt.py`` (every rank and standby). A second call replaces the
  handler it installed, so a forked rank re-labels itself.
- The level comes from the argument, else ``TRAINMOVER_LOG_LEVEL``, else ``WARNING``; JSON from
  the argument, else ``TRAINMOVER_LOG_JSON=1``. The agent exports both to the processes it starts,
  so one flag sets every process of a node.
- Each line names its process: ``rank R``, ``standby <member id>`` or ``agent``, so the lines of
  many ranks in one stream (or one file, see ``--log-dir``) can be told apart.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

ENV_LEVEL = "TRAINMOVER_LOG_LEVEL"
ENV_JSON = "TRAINMOVER_LOG_JSON"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_handler: logging.Handler | None = None


def process_label() -> str:
    """``rank R``, ``standby <id>`` or ``agent`` for this process, from the environment the agent set."""
    member = os.environ.get("TRAINMOVER_MEMBER_ID", "")
    if os.environ.get("RANK") is not None:
        return f"rank {os.environ['RANK']}"
    if member.startswith("standby"):
        return f"standby {member}"
    return "agent"


class _JsonFormatter(logging.Formatter):
    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "t": round(record.created, 6),
            "level": record.levelname,
            "process": self.label,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(level: str | None = None, json_lines: bool | None = None, label: str | None = None) -> None:
    """Install the process's log handler on the root logger (see the module docstring)."""
    global _handler
    level = (level or os.environ.get(ENV_LEVEL) or "WARNING").upper()
    if level not in LEVELS:
        from trainmover_ext.errors import ConfigError

        raise ConfigError(f"log level {level!r} is not one of {', '.join(LEVELS)} (--tm-log-level / {ENV_LEVEL})")
    if json_lines is None:
        json_lines = os.environ.get(ENV_JSON) == "1"
    label = label or process_label()
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(_JsonFormatter(label))
    else:
        formatter = logging.Formatter(
            f"%(asctime)s.%(msecs)03d %(levelname)s [{label}] %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
        )
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler
