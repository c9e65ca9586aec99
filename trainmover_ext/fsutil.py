"""Writing secrets to disk.

Contract: :func:`write_private` leaves ``path`` holding exactly ``data`` with exactly ``mode`` (0o600
by default), whether or not the file existed before and whatever mode it had: it writes a new file
next to it, readable by nobody else from its first byte, and renames it over ``path``. A reader
sees the old content or the new one, never a part. Used for the job token, the etcd root password
and the job's TLS keys.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o600) -> str:
    """Atomically replace ``path`` with ``data`` (str is written as UTF-8) at permission ``mode``; returns ``path``."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0o600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return str(path)
