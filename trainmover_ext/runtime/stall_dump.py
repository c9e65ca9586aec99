"""Every thread's stack, printed once when a step this rank must finish is still unfinished long after.

Why: a rank whose main thread is blocked while its background threads live keeps its lease and
prints nothing; its peers only see that it never did its part. Its own stacks say where it waits.

Contract
- :func:`arm` starts a daemon timer (any thread, never blocks). When it fires and ``done()`` is
  false, one block goes to standard error in a single write (ranks share the launcher's stderr, so
  the blocks of several ranks never interleave): a header naming ``what`` and this process, what
  ``describe()`` says (the communicator's state, say), and every thread's stack. Nothing else
  happens: the dump diagnoses, it decides nothing.
- ``done`` and ``describe`` run on the timer's thread: they must only read state; an error of
  ``describe`` is printed in its place.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable


def stacks() -> str:
    """Every thread's stack, most recent call last, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    out = []
    for ident, frame in frames:
        out.append(f"--- thread {names.get(ident, '?')} ({ident:#x}):\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


def arm(
    done: Callable[[], bool], after_s: float, what: str, describe: Callable[[], str] | None = None
) -> threading.Timer:
    """Dump every stack to stderr in ``after_s`` seconds unless ``done()`` holds by then."""

    def check() -> None:
        if done():
            return
        try:
            state = describe() if describe is not None else ""
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not fail where it is needed most
            state = f"(could not describe the state: {type(exc).__name__}: {exc})"
        block = (
            f"[trainmover] pid {os.getpid()}: {what} is still not carried out {after_s:.0f}s after it began; "
            f"its state and the stacks of every thread follow\n{state.rstrip()}\n{stacks()}"
            f"[trainmover] pid {os.getpid()}: end of the stacks\n"
        )
        data = block.encode(errors="replace")
        sys.stderr.flush()
        while data:
            data = data[os.write(sys.stderr.fileno(), data) :]

    timer = threading.Timer(after_s, check)
    timer.daemon = True
    timer.name = "trainmover_stall_dump"
    timer.start()
    return timer
