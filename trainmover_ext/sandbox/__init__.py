"""The sandbox: record the job's collectives, replay them so a standby warms any role alone.

Job side: ``pretrain`` wraps its runtime with :func:`hook.attach_recorder` when
``--tm-record-dir`` is set. The recorder rank of each role (first, middle,
last) records ``--tm-record-iters`` iterations, seals them on disk, removes its
hooks and publishes the index in etcd at ``recordings/<role>``.

Standby side: ``migration.standby.warm_up`` calls
:func:`standby.warm_general_standby`: wait for the recordings, check the
config fingerprint, run shadow iterations of every role against a replay
world, report warm roles and timings on the member record.

Modules: ``recorder`` (class hooks), ``recording`` (files, checksums), ``fetch`` (copying
a recording from the node that recorded it),
``registry`` (etcd index, waiting), ``replay`` (the ``tm_replay`` backend),
``shadow`` (shadow iterations), ``standby`` (the general standby),
``fingerprint`` (ConfigMismatch), ``compile`` (``--tm-compile``), ``hook``
(the training-loop hook), ``harness``/``promotion`` (forked jobs for tests
and ``benchmarks/warmup.py``). See ``docs/sandbox.md``.
"""

from .fingerprint import check_compatible, job_fingerprint
from .parts import state_digest
from .recorder import Recorder, RecordingHandle, maybe_start_recording, recorder_role
from .recording import Recording, load_recordings
from .replay import ReplayProcessGroup, ReplaySession, replay_world
from .shadow import (
    ShadowProgram,
    ShadowProgress,
    WarmResult,
    default_program,
    program_from_providers,
    warm_standby,
    warm_up,
)

__all__ = [
    "Recorder",
    "RecordingHandle",
    "maybe_start_recording",
    "recorder_role",
    "Recording",
    "load_recordings",
    "ReplayProcessGroup",
    "ReplaySession",
    "replay_world",
    "ShadowProgram",
    "ShadowProgress",
    "WarmResult",
    "state_digest",
    "default_program",
    "program_from_providers",
    "warm_standby",
    "warm_up",
    "check_compatible",
    "job_fingerprint",
]
