"""Pre-forked reserves (launch.process): a woken reserve runs the script as a forked rank would, with
the environment, arguments and output descriptors it is sent; an unused one is discarded cleanly.

Each case runs in a fresh interpreter: the test process may hold gRPC channels, which must never be
forked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

DRIVER = textwrap.dedent("""
    import os, sys, time
    from trainmover_ext.launch.logs import LogConfig
    from trainmover_ext.launch.process import activate, discard, fork_reserve, _reserve_socks

    out_dir, script = sys.argv[1], sys.argv[2]
    os.environ["TM_RESERVE_BEFORE"] = "inherited"
    used, spare = fork_reserve(niceness=3), fork_reserve()
    assert len(_reserve_socks) == 2
    time.sleep(0.2)  # both asleep
    output = LogConfig(log_dir=out_dir, redirects={-1: 3}).open("refill", 0, 0)
    proc = activate(used, -1, {"TM_RESERVE_SENT": "sent"}, script, ["--flag", "a b"], output)
    assert proc is not None and proc.pid == used.pid and used.sock.fileno() == -1
    deadline = time.time() + 30
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    print("exit", proc.returncode)
    discard(spare)
    try:
        os.waitpid(spare.pid, os.WNOHANG)
        print("spare not reaped")
    except ChildProcessError:
        print("spare reaped")
    print("left", len(_reserve_socks))
    print("gone", activate(spare, -1, {}, script, [], None))
""")

SCRIPT = textwrap.dedent("""
    import os, sys
    print("argv", sys.argv[1:])
    print("env", os.environ.get("TM_RESERVE_BEFORE"), os.environ.get("TM_RESERVE_SENT"))
    print("nice", os.getpriority(os.PRIO_PROCESS, 0), "pgid is pid", os.getpgid(0) == os.getpid())
    print("to stderr", file=sys.stderr)
    sys.exit(7)
""")


def test_a_woken_reserve_runs_the_script_with_what_it_was_sent(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "logs"), str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "exit 7" in lines, done.stdout + done.stderr
    assert lines[-3:] == ["spare reaped", "left 0", "gone None"], done.stdout
    logs = tmp_path / "logs" / "attempt_0" / "refill"
    out = (logs / "stdout.log").read_text()
    assert "argv ['--flag', 'a b']" in out and "env inherited sent" in out, out
    assert "nice 3 pgid is pid True" in out, out
    assert (logs / "stderr.log").read_text() == "to stderr\n"


def test_the_launcher_keeps_cuda_checks_off_the_cuda_runtime():
    """The agent forks its ranks, so its CUDA checks must go through NVML (torch's switch): a check
    through the CUDA runtime makes every forked rank fail at ``torch.cuda.set_device`` on a GPU
    machine (scripts/gpu_check.sh runs that case). A value the user set is kept."""
    probe = (
        "import os; from trainmover_ext.launch.process import NVML_CUDA_CHECK, preimport_for_fork; "
        "preimport_for_fork(); print(os.environ.get(NVML_CUDA_CHECK))"
    )
    for given, expected in ((None, "1"), ("0", "0")):
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
        if given is not None:
            env["PYTORCH_NVML_BASED_CUDA_CHECK"] = given
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == expected, out.stdout
