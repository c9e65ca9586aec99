"""A real Slurm on one machine, for testing the sbatch scripts.

Contract:
- :func:`ensure_slurm_installed` installs Debian's ``slurmctld slurmd
  slurm-client munge`` with apt when a binary is missing, and raises
  :class:`SlurmUnavailable` saying what to do when that is impossible. It never
  skips: CI runs as root with apt, so a missing Slurm is a failure.
- :class:`SlurmCluster` starts munged, slurmctld and one ``slurmd -N nX`` per
  emulated node, all on loopback with free ports, from a generated
  ``slurm.conf`` in its own work directory. Nodes declare more CPUs than the
  machine has (``SlurmdParameters=config_overrides``) so several tasks fit.
- :meth:`SlurmCluster.stop` cancels every job, waits for an empty ``squeue``
  (otherwise slurmstepd and its tasks are orphaned), then stops each daemon it
  started by pid: SIGTERM to all at once, SIGKILL after a grace period.
- Every call that waits takes a timeout and raises :class:`SlurmError` with the
  daemon logs' tail when it expires.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainmover_ext.netutil import free_ports

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "munged", "mungekey"]
CRED_SETTLE_S = 2.0
"""How long after a requeue a job's next run may be started (see :meth:`SlurmCluster.start_requeued_now`)."""


class SlurmError(RuntimeError):
    """A Slurm daemon or command did not behave; the message carries the logs to read."""


class SlurmUnavailable(SlurmError):
    """Slurm is not installed and could not be installed here."""


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def ensure_slurm_installed(timeout: float = 300) -> None:
    """Install the Debian packages when any binary is missing; see the module contract."""
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm binaries {missing} are missing and apt-get is not available: "
            f"install {' '.join(PACKAGES)} (Slurm 22.05 + munge) by hand"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` took more than {timeout}s: check the package mirror") from exc
        if proc.returncode != 0:
            raise SlurmUnavailable(
                f"`{' '.join(cmd)}` failed ({proc.returncode}); run it as root. "
                f"Output tail:\n{(proc.stdout + proc.stderr)[-2000:]}"
            )
    still = [b for b in BINARIES if _which(b) is None]
    if still:
        raise SlurmUnavailable(f"installed {PACKAGES} but {still} are still missing from PATH and /usr/sbin")


def parse_kv_line(line: str) -> dict[str, str]:
    """``scontrol -o show ...`` output (``Key=Value`` words) as a dict; values with spaces keep only their
    first word."""
    out: dict[str, str] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


@dataclass
class SlurmCluster:
    """One slurmctld and ``nodes`` emulated slurmd on this machine; see the module contract."""

    workdir: Path
    nodes: int = 2
    cpus_per_node: int = 8
    partition: str = "tm"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ctld_port: int = 0
    node_ports: list[int] = field(default_factory=list)

    @property
    def node_names(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.nodes)]

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.workdir / "munge" / "munge.sock"

    def env(self, base: dict | None = None) -> dict[str, str]:
        """The environment for Slurm clients and daemons of this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    # -- start -------------------------------------------------------------
    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        w = self.workdir
        lines = [
            "ClusterName=tmtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}",
            f"SlurmdPidFile={w / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={w / 'slurmctld.log'}",
            f"SlurmdLogFile={w / 'slurmd'}-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "KillWait=2",
            "MessageTimeout=10",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
        ]
        for name, port in zip(self.node_names, self.node_ports, strict=False):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus_per_node} State=UNKNOWN"
            )
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.workdir / f"{name}.stdout", "w")
        # Own session: a Ctrl-C of the test run reaches pytest, which stops us by pid.
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start munged, slurmctld and the slurmd nodes; return when every node is idle."""
        ensure_slurm_installed()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "state").mkdir(exist_ok=True)
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(exist_ok=True)
        os.chmod(munge_dir, 0o755)  # munged refuses a socket dir others can write to
        os.chmod(self.workdir, 0o755)
        for name in self.node_names:
            (self.workdir / "spool" / name).mkdir(parents=True, exist_ok=True)
        ports = free_ports(self.nodes + 1)
        self.ctld_port, self.node_ports = ports[0], ports[1:]
        self._write_conf()
        key = munge_dir / "munge.key"
        self._run([_which("mungekey"), "-c", "-f", "-k", str(key)], timeout=30)
        try:
            self._spawn(
                "munged",
                [
                    _which("munged"),
                    "-F",
                    "--force",
                    "--key-file",
                    str(key),
                    "--socket",
                    str(self.munge_socket),
                    "--pid-file",
                    str(munge_dir / "munged.pid"),
                    "--log-file",
                    str(munge_dir / "munged.log"),
                    "--seed-file",
                    str(munge_dir / "seed"),
                ],
            )
            self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
            for name in self.node_names:
                self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout, f"{self.nodes} idle nodes in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_idle(self) -> bool:
        self._check_alive()
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True, text=True, timeout=15
        )
        states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.node_names)

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise SlurmError(f"Slurm daemons exited early: {dead}\n{self.logs()}")

    # -- use ---------------------------------------------------------------
    def _run(self, cmd: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"`{' '.join(cmd)}` did not return within {timeout}s\n{self.logs()}") from exc
        if check and proc.returncode != 0:
            raise SlurmError(f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return proc

    def submit(
        self,
        script: str,
        script_args: list[str],
        sbatch_args: list[str],
        cwd: str,
        env: dict | None = None,
        timeout: float = 30,
    ) -> int:
        """``sbatch --parsable`` from ``cwd``; returns the job id."""
        cmd = ["sbatch", "--parsable", *sbatch_args, script, *script_args]
        try:
            proc = subprocess.run(cmd, env=self.env(env), cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"sbatch did not return within {timeout}s\n{self.logs()}") from exc
        if proc.returncode != 0:
            raise SlurmError(f"sbatch exited {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job ID`` as a dict (JobState, ExitCode, StdOut, NodeList, Reason ...)."""
        return parse_kv_line(self._run(["scontrol", "-o", "show", "job", str(job_id)]).stdout)

    def start_requeued_now(self, job_id: int, timeout: float) -> dict[str, str]:
        """Make a requeued job eligible at once; returns its state once it is.

        Slurm holds a requeued batch job back (its begin time about two minutes ahead), and refuses a
        new begin time while the job's first run is still completing. Retries ``scontrol update
        StartTime=now`` until the job runs, ends, or pends for another reason than its begin time;
        raises SlurmError with the job's state otherwise. It waits :data:`CRED_SETTLE_S` after the call
        first: slurmd refuses a job credential no newer, in whole seconds, than the revocation of the
        job's first run ("Killing non-startable batch JobId=8: Job credential revoked" when the second
        run was allocated 0.6 s after the requeue, in the same second)."""
        time.sleep(CRED_SETTLE_S)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state = info.get("JobState")
            if state not in ("PENDING", "REQUEUED", "COMPLETING", "REQUEUE_HOLD", "REQUEUE_FED"):
                return info
            if state == "PENDING" and info.get("Reason") != "BeginTime":
                return info
            if state == "PENDING":
                # scontrol's name for the earliest start is StartTime (it refuses BeginTime=).
                self._run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
            time.sleep(0.3)
        raise SlurmError(f"requeued job {job_id} not eligible within {timeout}s: {info}\n{self.logs()}")

    def wait_running(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job is RUNNING; raises SlurmError with its state and reason otherwise."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") == "RUNNING":
                return info
            if info.get("JobState") not in ("PENDING", "CONFIGURING"):
                break
            time.sleep(0.2)
        raise SlurmError(
            f"job {job_id} is {info.get('JobState')}, not RUNNING, after waiting up to {timeout}s "
            f"(reason {info.get('Reason')})\n{self.logs()}"
        )

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING; raises SlurmError with its state on timeout."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return info
            time.sleep(0.5)
        raise SlurmError(
            f"job {job_id} still {info.get('JobState')} after {timeout}s (reason {info.get('Reason')})\n{self.logs()}"
        )

    def logs(self, tail: int = 1500) -> str:
        """The tail of every daemon log, for error messages."""
        parts = []
        for path in sorted(self.workdir.glob("*.log")) + sorted(self.workdir.glob("munge/*.log")):
            parts.append(f"--- {path.name}:\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # -- stop --------------------------------------------------------------
    def stop(self, timeout: float = 30) -> None:
        """Cancel all jobs, wait for an empty queue, then stop every daemon we started, by pid."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            subprocess.run(["scancel", "--full", "-p", self.partition], env=self.env(), capture_output=True, timeout=15)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                q = subprocess.run(
                    ["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True, timeout=15
                )
                if q.returncode == 0 and not q.stdout.strip():
                    break
                time.sleep(0.3)
        # slurmd before slurmctld before munged, but in parallel: each takes ~2 s on SIGTERM.
        for group in ([n for n in self.procs if n.startswith("slurmd")], ["slurmctld"], ["munged"]):
            live = [self.procs[n] for n in group if n in self.procs and self.procs[n].poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for p in live:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)

    # -- node loss ---------------------------------------------------------
    def lose_node(self, name: str) -> list[int]:
        """SIGKILL node ``name`` as a machine loss would end it: its slurmd, every task Slurm runs on it
        (``SLURMD_NODENAME`` in their environment) and their slurmstepd. Returns the task pids killed."""
        tasks = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"SLURMD_NODENAME={name}".encode() in environ:
                tasks.append(pid)
        stepds = set()
        for pid in tasks:
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if "slurmstepd" in Path(f"/proc/{ppid}/cmdline").read_text(errors="replace"):
                    stepds.add(ppid)
            except (OSError, ValueError, IndexError):
                continue
        self.procs[f"slurmd-{name}"].kill()
        for pid in [*stepds, *tasks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[f"slurmd-{name}"].wait(timeout=10)
        return tasks

    def restore_node(self, name: str, timeout: float = 60) -> None:
        """Start node ``name``'s slurmd again and return it to service once it is idle."""
        self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
            if self._all_idle():
                return
            time.sleep(1)
        raise SlurmError(f"node {name} did not return to service within {timeout:.0f}s\n{self.logs()}")

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise SlurmError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")
