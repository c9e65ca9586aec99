"""The one error tree of TrainMover, grouped by what an error means.

Every error the runtime raises on purpose derives from :class:`TrainMoverError` and carries a
message that says what to do next. Wrap lower-level exceptions with ``raise X(...) from exc`` so
the cause stays visible.

Two lower layers have errors of their own, re-exported here under their names: the training layer
(``trainmover_training.errors``: :class:`TrainingError`, :class:`DataError`, :class:`CheckpointError`)
and the communicator (``nccl_delta.errors``: :class:`CommLinkError` and its kinds). They import
nothing of the runtime. :data:`USER_ERRORS` catches all three trees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from nccl_delta.errors import CommAbandoned, CommLinkError, CommTimeout, DeltaConfigError, DeltaError, SwapAborted
from trainmover_training.errors import CheckpointError, DataError, TrainingError
from trainmover_training.errors import ConfigError as TrainingConfigError

__all__ = [
    "AuthError",
    "CONFIG_ERRORS",
    "CheckpointError",
    "CommAbandoned",
    "CommLinkError",
    "CommTimeout",
    "ConfigError",
    "ConfigMismatch",
    "DataError",
    "DeltaConfigError",
    "DeltaError",
    "EtcdNotFound",
    "EtcdUnavailable",
    "KeptRoleUnusable",
    "LaunchError",
    "LeadershipLost",
    "MalformedValue",
    "MembershipLost",
    "MigrationAborted",
    "PatchError",
    "RecordingCorrupt",
    "RecordingNotFound",
    "RecoverySuperseded",
    "ReplayMismatch",
    "STANDBY_REFUSED_EXIT_CODE",
    "SchemaVersionError",
    "StandbyRefused",
    "StoreError",
    "LeaseNotFound",
    "StoreTimeout",
    "SwapAborted",
    "TrainMoverError",
    "TrainingConfigError",
    "TrainingError",
    "USER_ERRORS",
    "exit_on_error",
]


class TrainMoverError(Exception):
    """Base class of every TrainMover error."""


USER_ERRORS = (TrainMoverError, TrainingError, DeltaError)
"""Every error any layer of TrainMover raises on purpose: what an entry point reports as one line."""


# --- the user must change something: flags, installation, a joining process's build ---


class ConfigError(TrainMoverError, TrainingConfigError):
    """A flag or config value is invalid; the message names the flag that fixes it."""


class ConfigMismatch(ConfigError):
    """A joining process's model, parallel layout or library version differs from the job's."""


STANDBY_REFUSED_EXIT_CODE = 78
"""Exit status of a standby refused by its job (:class:`StandbyRefused`); sysexits' ``EX_CONFIG``.
The launcher does not restart a standby that exited with it: the same flags would be refused again."""


class StandbyRefused(ConfigMismatch):
    """A standby's model fingerprint differs from the one its job published: it must never serve a rank.

    ``fields`` maps every differing field to ``(job value, standby value)``. The process exits with
    :data:`STANDBY_REFUSED_EXIT_CODE`, and its launcher does not start it again."""

    exit_code = STANDBY_REFUSED_EXIT_CODE

    def __init__(self, message: str, fields: dict[str, tuple[object, object]]) -> None:
        super().__init__(message)
        self.fields = fields


class EtcdNotFound(ConfigError):
    """No etcd binary was found; the message says how to install one or which flag names it."""


class PatchError(TrainMoverError):
    """A runtime patch does not fit the installed megatron-core (unknown version or changed source)."""


CONFIG_ERRORS = (TrainingConfigError, DeltaConfigError)
"""Configuration errors of every layer (TrainMover's :class:`ConfigError` is a ``TrainingConfigError``)."""


# --- the control store (etcd) ---


class StoreError(TrainMoverError):
    """The etcd store is unreachable, refused a request, or holds a malformed value."""


class LeaseNotFound(StoreError):
    """A write named a lease that has expired (or was revoked): its owner must register again."""


class StoreTimeout(StoreError, TimeoutError):
    """A blocking store operation ran past its deadline."""


class EtcdUnavailable(StoreError):
    """No etcd endpoint answered within the deadline; the message names the endpoints tried."""


class AuthError(StoreError):
    """A request carried the wrong job token or credentials."""


class MalformedValue(StoreError):
    """A key holds bytes that are not the versioned JSON TrainMover expects; the key is left untouched."""


class SchemaVersionError(MalformedValue):
    """A key holds a value written by an incompatible TrainMover version; the key is left untouched."""


# --- membership and leadership ---


class MembershipLost(TrainMoverError):
    """This process lost its membership (lease expired or epoch moved on without it)."""


class LeadershipLost(TrainMoverError):
    """This controller's leader lease expired or another controller took over; its write was refused."""


class LaunchError(TrainMoverError):
    """The launcher could not start, supervise or restart its processes."""


# --- migrations and recovery (link failures are nccl_delta's CommLinkError kinds) ---


class MigrationAborted(TrainMoverError):
    """A migration could not complete; the job keeps its previous membership epoch."""


class JobFinishedFirst(TrainMoverError):
    """Every rank completed training before a planned move took effect: its joiner leaves, with nothing to do."""


class RecoverySuperseded(MigrationAborted):
    """A newer plan superseded the migration step under way; the runtime restarts recovery at the newest epoch."""


# --- the sandbox: recordings, replay, kept roles ---


class RecordingNotFound(TrainMoverError):
    """No sealed recording exists for a role yet; the job has not finished recording its first iterations."""


class RecordingCorrupt(TrainMoverError):
    """A recording fails its checksum or its index is unreadable; it is never used. Record again."""


class ReplayMismatch(TrainMoverError):
    """A sandbox replay call differs from what was recorded (op, shape or dtype)."""


class KeptRoleUnusable(TrainMoverError):
    """A standby's kept model cannot serve the rank it was promoted into (another rank's coordinates, or a
    replay group it still holds that cannot be re-pointed). The standby builds the rank's model anew."""


def exit_on_error(prog: str) -> contextlib.AbstractContextManager[None]:
    """Context manager for ``__main__`` blocks: print any of :data:`USER_ERRORS` as one line and exit 2
    (or the error's own ``exit_code``, e.g. :data:`STANDBY_REFUSED_EXIT_CODE`).

    Configuration errors are identical on every rank, so only rank 0 prints them.
    ``TRAINMOVER_DEBUG=1`` prints the traceback too.
    """
    import os
    import sys

    @contextlib.contextmanager
    def _guard() -> Iterator[None]:
        try:
            yield
        except USER_ERRORS as exc:
            if os.environ.get("TRAINMOVER_DEBUG"):
                import traceback

                traceback.print_exc()
            if not isinstance(exc, CONFIG_ERRORS) or os.environ.get("RANK", "0") == "0":
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(getattr(exc, "exit_code", 2)) from None

    return _guard()
