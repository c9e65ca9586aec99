"""The sandbox: record the job's collectives, replay them so a standby warms any role alone.

Job side (every training rank; the recorder ranks act, the others are inert)::

    handle = maybe_start_recording(args, layout)     # after model/optimizer/iterators, before the loop
    ...each iteration k...: index = handle.after_iteration(k)   # dict once, when sealed -> etcd
    finally: handle.close()

Standby side (a process with the job's flags and no process group)::

    recordings = load_recordings(record_dir)          # verifies checksums
    results = warm_standby(args, recordings)          # first, middle, last in turn
    # or one role: warm_up(args, "middle", recordings["middle"])

See ``docs/sandbox.md`` for the recording format, the replay rules and the
measured costs.
"""

from .fingerprint import check_compatible, job_fingerprint
from .recorder import Recorder, RecordingHandle, maybe_start_recording, recorder_role
from .recording import Recording, load_recordings
from .replay import ReplayProcessGroup, ReplaySession, replay_world
from .parts import state_digest
from .shadow import (ShadowProgram, ShadowProgress, WarmResult, default_program, program_from_providers,
                     warm_standby, warm_up)

__all__ = [
    "Recorder", "RecordingHandle", "maybe_start_recording", "recorder_role", "Recording", "load_recordings",
    "ReplayProcessGroup", "ReplaySession", "replay_world", "ShadowProgram", "ShadowProgress", "WarmResult",
    "state_digest", "default_program", "program_from_providers", "warm_standby", "warm_up", "check_compatible", "job_fingerprint",
]
