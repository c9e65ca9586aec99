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


STANDBY_REFUSED_EXIT_CODE = 78
"""Exit status of a standby refused by its job (:class:`StandbyRefused`); sysexits' ``EX_CONFIG``.
The launcher does not restart a standby that exited with it: the same flags would be refused again."""


class StandbyRefused(ConfigMismatch):
    """A standby's model fingerprint differs from the one its job published: it must never serve a rank.

    ``fields`` maps every differing field to ``(job value, standby value)``. The process exits with
    :data:`STANDBY_REFUSED_EXIT_CODE`, and its launcher does not start it again."""

    exit_code = STANDBY_REFUSED_EXIT_CODE

    def __init__(self, message: str, fields: dict[str, tuple]) -> None:
        super().__init__(message)
        self.fields = fields


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


class RecoverySuperseded(MigrationAborted):
    """A newer plan superseded the migration step under way; the runtime restarts recovery at the newest epoch."""


class ReplayMismatch(TrainMoverError):
    """A sandbox replay call differs from what was recorded (op, shape or dtype)."""


# --- control plane (issue 3) ---


class EtcdNotFound(ConfigError):
    """No etcd binary was found; the message says how to install one or which flag names it."""


class EtcdUnavailable(StoreError):
    """No etcd endpoint answered within the deadline; the message names the endpoints tried."""


class MalformedValue(StoreError):
    """A key holds bytes that are not the versioned JSON TrainMover expects; the key is left untouched."""


class SchemaVersionError(MalformedValue):
    """A key holds a value written by an incompatible TrainMover version; the key is left untouched."""


class LeadershipLost(TrainMoverError):
    """This controller's leader lease expired or another controller took over; its write was refused."""


def exit_on_error(prog: str):
    """Context manager for ``__main__`` blocks: print a TrainMoverError as one line and exit 2
    (or the error's own ``exit_code``, e.g. :data:`STANDBY_REFUSED_EXIT_CODE`).

    Configuration errors are identical on every rank, so only rank 0 prints them.
    ``TRAINMOVER_DEBUG=1`` prints the traceback too.
    """
    import contextlib
    import os
    import sys

    @contextlib.contextmanager
    def _guard():
        try:
            yield
        except TrainMoverError as exc:
            if os.environ.get("TRAINMOVER_DEBUG"):
                import traceback

                traceback.print_exc()
            if not isinstance(exc, ConfigError) or os.environ.get("RANK", "0") == "0":
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(getattr(exc, "exit_code", 2)) from None

    return _guard()


class CommAbandoned(CommLinkError):
    """An op was cut short because the control plane abandoned its epoch; rebuild links with ``recover(epoch)``."""


class CommTimeout(CommLinkError, TimeoutError):
    """A link op or link rendezvous ran past its deadline; the peer is hung or never arrived."""


# --- sandbox (issue 5) ---


class RecordingNotFound(TrainMoverError):
    """No sealed recording exists for a role yet; the job has not finished recording its first iterations."""


class RecordingCorrupt(TrainMoverError):
    """A recording fails its checksum or its index is unreadable; it is never used. Record again."""


class KeptRoleUnusable(TrainMoverError):
    """A standby's kept model cannot serve the rank it was promoted into (another rank's coordinates, or a
    replay group it still holds that cannot be re-pointed). The standby builds the rank's model anew."""
