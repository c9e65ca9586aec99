"""The stall dump prints every stack once when its step is unfinished, and nothing when it finished."""

import subprocess
import sys

SCRIPT = """
import threading, time
from trainmover_ext.runtime import stall_dump
done = {done}
stall_dump.arm(lambda: done, 0.2, "epoch 3")
threading.Event().wait(0.6)
"""


def _stderr(done: bool) -> str:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(done=done)], capture_output=True, text=True, timeout=60, check=True
    ).stderr


def test_an_unfinished_step_prints_every_stack():
    err = _stderr(done=False)
    assert "epoch 3 is still not carried out" in err
    assert "--- thread MainThread" in err and "--- thread trainmover_stall_dump" in err


def test_a_finished_step_prints_nothing():
    assert _stderr(done=True) == ""
