"""The one error tree of TrainMover.

Every error the runtime raises on purpose derives from :class:`TrainMoverError`
and carries a message that says what to do next. Wrap lower-level exceptions
with ``raise X(...) from exc`` so the cause stays visible.
"""

from __future__ import annotations


class TrainMoverError(Exception):
    """Base class of every TrainMover error."""


class ConfigError(TrainMoverError, ValueError):
    """A flag or config value is invalid; the message names the flag that fixes it."""


class ConfigMismatch(ConfigError):
    """A joining process's model, parallel layout or library version differs from the job's."""


class PatchError(TrainMoverError):
    """A runtime patch does not fit the installed megatron-core (unknown version or changed source)."""


class DataError(TrainMoverError):
    """A dataset is missing, unreadable or too small for the requested run."""


class CheckpointError(TrainMoverError):
    """A checkpoint is missing, incomplete or was written by an incompatible job."""


class LaunchError(TrainMoverError):
    """The launcher could not start, supervise or restart its processes."""


class MembershipLost(TrainMoverError):
    """This process lost its membership (lease expired or epoch moved on without it)."""


class StoreError(TrainMoverError):
    """The etcd store is unreachable, refused a request, or holds a malformed value."""


class StoreTimeout(StoreError, TimeoutError):
    """A blocking store operation ran past its deadline."""


class AuthError(StoreError):
    """A request carried the wrong job token or credentials."""


class CommLinkError(TrainMoverError):
    """A communication link failed; the message names the peer, the group and the op."""


class MigrationAborted(TrainMoverError):
    """A migration could not complete; the job keeps its previous membership epoch."""


class ReplayMismatch(TrainMoverError):
    """A sandbox replay call differs from what was recorded (op, shape or dtype)."""
