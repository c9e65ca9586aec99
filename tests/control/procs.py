"""Helpers for integration tests: real member processes that can be SIGKILLed and SIGSTOPped."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time


def spawn_member(endpoints, job, token, member_id, *, kind="worker", ttl=2, controller=False, host="h0", timeout=30.0):
    """Start ``member_main`` and return the Popen once it printed READY (it holds a registered lease then)."""
    cmd = [sys.executable, "-m", "trainmover_ext.control.member_main", "--endpoints", ",".join(endpoints), "--job", job,
           "--token", token, "--member-id", member_id, "--kind", kind, "--ttl", str(ttl), "--host", host]
    if controller:
        cmd.append("--controller")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
    raise RuntimeError(f"member {member_id} did not become ready (exit {proc.poll()})")


def reap(*procs):
    """SIGKILL (after SIGCONT, for stopped ones) and wait, by pid."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
