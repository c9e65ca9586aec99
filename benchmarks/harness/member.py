"""A stand-in member process: registers, keeps its lease, and idles until killed.

Used by integration tests and ``benchmarks/detection.py`` to have real
processes to SIGKILL and SIGSTOP; ``--controller`` also runs a controller
candidate in it. It prints ``READY <member_id>`` once registered and exits 0 on
SIGTERM (revoking its lease: a clean leave).

Example::

    PYTHONPATH=benchmarks python -m harness.member --endpoints 127.0.0.1:2379 --job j --token T \\
        --member-id w0 --kind worker --ttl 1
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

from trainmover_ext.control.controller import Controller, ControllerConfig
from trainmover_ext.control.membership import Membership
from trainmover_ext.control.records import ROLES, MemberRecord
from trainmover_ext.errors import LaunchError
from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.launch import heartbeat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", required=True, help="etcd host:port list")
    p.add_argument("--job", required=True, help="job name")
    p.add_argument("--token", required=True, help="job token")
    p.add_argument("--member-id", required=True, help="unique member id")
    p.add_argument("--kind", default="worker", choices=["worker", "standby", "agent"], help="member kind")
    p.add_argument("--host", default=socket.gethostname(), help="host name to record")
    p.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds")
    p.add_argument("--controller", action="store_true", help="also run a controller candidate")
    args = p.parse_args(argv)

    kv = EtcdKV(EtcdClientConfig(endpoints=args.endpoints, timeout_s=3))
    space = JobSpace.open(kv, args.job, args.token)
    roles = list(ROLES) if args.kind == "standby" else []
    member = Membership(
        space,
        MemberRecord(member_id=args.member_id, kind=args.kind, host=args.host, pid=os.getpid(), warm_roles=roles),
        ttl_s=args.ttl,
    )
    member.register()
    heartbeat.start_from_env()  # when spawned with a HangWatch's variables (benchmarks/detection.py)
    ctl = (
        Controller(space, ControllerConfig(controller_id=args.member_id, ttl_s=args.ttl)).start()
        if args.controller
        else None
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"READY {args.member_id}", flush=True)
    done.wait()
    if ctl is not None:
        ctl.close()
    member.close()
    kv.close()
    return 0


def spawn_member(
    endpoints, job, token, member_id, *, kind="worker", ttl=2, controller=False, host="h0", timeout=30.0, env=None
):
    """Start ``member_main`` and return the Popen once it printed READY (it holds a registered lease then).
    ``env``: more variables for it (a :class:`HangWatch`'s, so that it beats)."""
    cmd = [
        sys.executable,
        "-m",
        "harness.member",
        "--endpoints",
        ",".join(endpoints),
        "--job",
        job,
        "--token",
        token,
        "--member-id",
        member_id,
        "--kind",
        kind,
        "--ttl",
        str(ttl),
        "--host",
        host,
    ]
    if controller:
        cmd.append("--controller")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, where `harness` lives
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=full_env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if line.startswith("READY"):
                return proc
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise LaunchError(
        f"member {member_id} did not print READY within {timeout:.0f}s (exit code {proc.poll()}): "
        "check etcd and the job token"
    )


def reap(*procs):
    """SIGKILL (after SIGCONT, for stopped ones) and wait, by pid."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())


class ExitWatch:
    """What a launcher's supervisor does for a child, on a thread: once ``proc`` exits, report it through
    :func:`~trainmover_ext.control.supervise.report_exit` unless :meth:`expected_exit` was called."""

    def __init__(self, space, proc, *, rank: int, member_id: str, reporter: str, epoch: int = 0) -> None:
        from trainmover_ext.control.supervise import report_exit

        self._expected = threading.Event()
        self.reported = threading.Event()

        def watch() -> None:
            code = proc.wait()
            if not self._expected.is_set():
                report_exit(space, rank=rank, member_id=member_id, reporter=reporter, code=code, epoch=epoch)
                self.reported.set()

        threading.Thread(target=watch, name=f"exit-watch-{rank}", daemon=True).start()

    def expected_exit(self) -> None:
        """The child is being stopped on purpose: do not report its exit."""
        self._expected.set()


class HangFence:
    """What a launcher's supervisor does for a serving child that beats (``launch.heartbeat``), on a thread:
    every 50 ms, ask ``watch`` whether ``proc`` (beating as ``key``) hung; if so, SIGKILL it and report the
    hang through :func:`~trainmover_ext.control.supervise.report_hang`."""

    def __init__(self, space, watch, proc, key: str, *, rank: int, member_id: str, reporter: str) -> None:
        from trainmover_ext.control.supervise import report_hang

        self._stop = threading.Event()

        def fence() -> None:
            while not self._stop.wait(0.05):
                found = dict(watch.hung({key: proc.pid}))
                if key in found:
                    os.kill(proc.pid, signal.SIGKILL)
                    report_hang(space, rank=rank, member_id=member_id, reporter=reporter, why=found[key], epoch=0)
                    return

        threading.Thread(target=fence, name=f"hang-fence-{rank}", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
