"""The training layer's errors. It imports nothing of TrainMover's runtime; TrainMover's error tree
(``trainmover_ext.errors``) re-exports these, and its own ``ConfigError`` derives from this one."""

from __future__ import annotations


class TrainingError(Exception):
    """Base class of every error the training layer raises on purpose; the message says what to do."""


class ConfigError(TrainingError, ValueError):
    """A flag is invalid or flags contradict each other; the message names the flag that fixes it."""


class DataError(TrainingError):
    """A dataset is missing, unreadable or too small for the requested run."""


class CheckpointError(TrainingError):
    """A checkpoint is missing, incomplete or was written by an incompatible job."""
