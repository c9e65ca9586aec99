"""The test session's etcd servers keep their data on tmpfs, not on the shared disk.

Every test starts a real etcd (directly, or through a launcher's embedded one).
etcd fsyncs its write-ahead log on every write, and a lease renewal waits for
the writes before it. On a busy disk one fdatasync can take over a second
(seen: 1.1 s while other tests wrote checkpoints). With the tests' 2 s lease
TTL, that stall lets leases of live ranks expire and the controller replace
ranks nobody killed. The data directory on tmpfs takes the disk out of the
lease path; everything else about etcd stays as users run it.

How: ``$TRAINMOVER_ETCD_BINARY`` (the binary TrainMover's etcd lookup takes
first) names a wrapper script that rewrites ``--data-dir D`` to
``<root>/<checksum of D>`` and execs the real binary. A new ``D`` becomes a
symlink to that (emptied) directory, so a server started again on ``D`` finds
its data, a test that looks under ``D`` sees it, and one that deletes ``D``
starts the next server empty, as on disk. An existing real directory ``D`` is
left where it is. Each server's WAL preallocates 64 MB of
memory there, so :func:`sweep` (after every test) deletes the directories no
live etcd process names, and :func:`remove` deletes the root at the end.

Used only where ``/dev/shm`` is a tmpfs with room (:data:`MIN_FREE_BYTES`),
and not when ``TM_TEST_ETCD_ON_DISK=1``.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

SHM = Path("/dev/shm")
MIN_FREE_BYTES = 2 << 30
ROOT_PREFIX = "tm-test-etcd-"

_WRAPPER = """#!/bin/sh
# Written by tests/support/etcd_tmpfs.py: run etcd with its data directory on tmpfs.
root='{root}'
n=$#
take=
for a in "$@"; do
  if [ -n "$take" ]; then
    if [ -L "$a" ]; then  # started here before: the same data
      a=$(readlink "$a")
    elif [ ! -e "$a" ]; then  # a new (or deleted) data directory starts empty
      shm="$root/$(printf %s "$a" | cksum | cut -d' ' -f1)"
      rm -rf "$shm"
      ln -s "$shm" "$a"
      a="$shm"
    fi  # an existing real directory stays where it is
    take=
  elif [ "$a" = --data-dir ]; then
    take=1
  fi
  set -- "$@" "$a"
done
shift "$n"
exec '{real}' "$@"
"""


def install() -> Path | None:
    """Point ``$TRAINMOVER_ETCD_BINARY`` at a wrapper over the etcd the tests would run; returns the root
    (None when tmpfs is not used: no room, opted out, or no etcd found, which the tests report themselves)."""
    if os.environ.get("TM_TEST_ETCD_ON_DISK") == "1" or not SHM.is_dir():
        return None
    usage = shutil.disk_usage(SHM)
    if usage.free < MIN_FREE_BYTES:
        return None
    from trainmover_ext.errors import TrainMoverError
    from trainmover_ext.etcd.server import find_etcd_binary

    try:
        real = find_etcd_binary()
    except TrainMoverError:
        return None
    _remove_stale_roots()
    root = SHM / f"{ROOT_PREFIX}{os.getpid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    wrapper = root / "etcd"
    wrapper.write_text(_WRAPPER.format(root=root, real=real))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    os.environ["TRAINMOVER_ETCD_BINARY"] = str(wrapper)
    return root


def _live_cmdlines() -> list[bytes]:
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    lines.append(f.read())
            except OSError:
                continue
    return lines


def sweep(root: Path) -> list[Path]:
    """Delete the data directories under ``root`` that no live process names on its command line; returns
    them. A server stopped and started again within one test keeps its directory (the sweep runs between
    tests)."""
    names = [p for p in root.iterdir() if p.is_dir()]
    if not names:
        return []
    cmdlines = _live_cmdlines()
    gone = [p for p in names if not any(str(p).encode() + b"\0" in c for c in cmdlines)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def _remove_stale_roots() -> None:
    """Roots of earlier sessions whose pytest process is gone (killed before it could clean up)."""
    for p in SHM.glob(f"{ROOT_PREFIX}*"):
        pid = p.name[len(ROOT_PREFIX) :]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(p, ignore_errors=True)
