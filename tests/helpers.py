"""Shared helpers for integration tests: run the launcher, read metrics, find processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.jobs import REPO_ROOT, launch_cmd


@dataclass
class LaunchedJob:
    """A ``trainmover launch`` process with its log files."""

    popen: subprocess.Popen
    stdout_path: str
    stderr_path: str
    metrics_path: str
    pids_seen: list[int] = field(default_factory=list)
    run_dir: str = ""
    """The launcher's ``--run-dir``: the archived events timeline and finished migrations."""

    def events(self, what: str | None = None) -> list[dict]:
        """The job's events timeline as archived in the run directory (``events.jsonl``), oldest first."""
        from trainmover_ext.control.archive import EVENTS_FILE, read_jsonl

        found = sorted(read_jsonl(os.path.join(self.run_dir, EVENTS_FILE)), key=lambda e: e["time"])
        return [e for e in found if what is None or e["what"] == what]

    def migrations(self) -> list[dict]:
        """Every finished migration plan, as archived in the run directory (``migrations.jsonl``)."""
        from trainmover_ext.control.archive import MIGRATIONS_FILE, read_jsonl

        return list(read_jsonl(os.path.join(self.run_dir, MIGRATIONS_FILE)))

    def stderr(self) -> str:
        return open(self.stderr_path).read()

    def stdout(self) -> str:
        return open(self.stdout_path).read()

    def rank_pids(self) -> list[list[int]]:
        """Rank pid lists, one per (re)start, parsed from the launcher's log."""
        return [json.loads(m) for m in re.findall(r"pids (\[[\d, ]+\])", self.stderr())]

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"job did not finish in {timeout}s; stderr tail:\n{self.stderr()[-3000:]}") from None


def start_job(
    tmp_path, nproc: int, script_args: list[str], *launch_flags: str, name: str = "job", env: dict | None = None
) -> LaunchedJob:
    metrics = str(tmp_path / f"{name}.metrics.jsonl")
    out, err = str(tmp_path / f"{name}.out"), str(tmp_path / f"{name}.err")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    run_dir = str(tmp_path / f"{name}.run")
    popen = subprocess.Popen(
        launch_cmd(nproc, script_args + ["--tm-metrics-file", metrics], "--run-dir", run_dir, *launch_flags),
        stdout=open(out, "w"),
        stderr=open(err, "w"),
        cwd=REPO_ROOT,
        env=env,
    )
    return LaunchedJob(popen, out, err, metrics, run_dir=run_dir)


def crash_head(stderr: str, limit: int = 3000) -> str:
    """The first crash dump's header and its crashing thread's stack (faulthandler's "Fatal Python error"
    and "Current thread" block), or "" without one: a stderr tail shows only the dump's last thread."""
    at = stderr.find("Fatal Python error")
    if at < 0:
        return ""
    header = stderr[at : stderr.find("\n", at)]
    current = stderr.find("Current thread", at)
    block = stderr[current : stderr.find("\n\n", current)][:limit] if current >= 0 else "(no current thread)"
    return f"first crash: {header}\n{block}\n...\n"


def run_job(
    tmp_path,
    nproc: int,
    script_args: list[str],
    *launch_flags: str,
    name: str = "job",
    timeout: float = 300,
    env: dict | None = None,
) -> LaunchedJob:
    job = start_job(tmp_path, nproc, script_args, *launch_flags, name=name, env=env)
    code = job.wait(timeout)
    if code != 0:
        err = job.stderr()
        raise AssertionError(f"{name} exited {code}; {crash_head(err)}stderr tail:\n{err[-4000:]}")
    return job


def finish_job(job: LaunchedJob, timeout: float = 300) -> str:
    """Wait for a started job to end well (killed if it outlives ``timeout``); returns the launcher's log."""
    try:
        code = job.wait(timeout)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert code == 0, job.stderr()[-4000:]
    return job.stderr()


def read_metrics(path: str, event: str = "iteration") -> list[dict]:
    if not os.path.exists(path):
        return []
    records = []
    for line in open(path):
        line = line.strip()
        if line:
            rec = json.loads(line)
            if rec.get("event") == event:
                records.append(rec)
    return records


def losses_by_iteration(path: str) -> dict[int, float]:
    return {rec["iteration"]: rec["loss"] for rec in read_metrics(path)}


def wait_for(
    predicate,
    timeout: float,
    interval: float = 0.01,
    what: str = "condition",
    detail: Callable[[], str] | None = None,
    give_up: Callable[[], bool] | None = None,
):
    """The first truthy ``predicate()``, polled every ``interval`` s. AssertionError after ``timeout`` s, or
    as soon as ``give_up()`` holds (e.g. the job ended); its message ends with ``detail()`` (e.g. a log tail)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if give_up is not None and give_up():
            value = predicate()  # what happened just before it gave up
            if value:
                return value
            raise AssertionError(f"gave up waiting for {what}" + (f":\n{detail()}" if detail else ""))
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f":\n{detail()}" if detail else ""))


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except FileNotFoundError:
        return False


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tiny_args(
    data_prefix: str | None,
    *,
    tp: int = 1,
    pp: int = 1,
    iters: int = 10,
    gbs: int = 8,
    dropout: float = 0.1,
    extra: list[str] | None = None,
) -> list[str]:
    """A tiny GPT for tests: 4 layers, hidden 32, seq 32, Megatron's default dropout unless told."""
    from harness.jobs import model_args

    args = model_args(layers=4, hidden=32, heads=4, seq=32, mbs=1, gbs=gbs, iters=iters, lr=1e-3, dropout=dropout)
    args += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if data_prefix:
        args += ["--data-path", data_prefix + "_text_document"]
    else:
        args += ["--mock-data"]
    return args + (extra or [])


LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--ffn-hidden-size",
    "64",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
"""Llama's architecture flags on the tiny model (hidden 32, 4 heads in 2 key/value groups)."""


# --- live migration ---------------------------------------------------------

ITERS = 12


def tm_args(corpus, *, tp=2, pp=2, gbs=8, iters=ITERS, extra=None, standby_nice: int | None = 0, sandbox: bool = False):
    """The tiny GPT under --trainmover with one standby.

    Its standbys keep their CPU priority (``--tm-standby-nice 0``) unless ``standby_nice`` says
    otherwise (None: the launcher's default, 19): the ranks keep both cores busy, so a standby at
    the lowest priority warms at an iteration no test can foresee, and a drill that fires at a fixed
    iteration would find none warm. Tests that wait until a standby is warm run the default.

    They warm with the basic warm-up (``--tm-no-sandbox``) unless ``sandbox``: on two cores a
    standby's shadow iterations at niceness 0 take the ranks' CPU in every test, and what the
    sandbox adds to a promotion is proved by the tests that turn it on (``tests/sandbox``,
    ``tests/migration/test_sandbox_standby.py``, which runs the launcher's default)."""
    nice = [] if standby_nice is None else ["--tm-standby-nice", str(standby_nice)]
    off = [] if sandbox else ["--tm-no-sandbox"]
    return tiny_args(
        corpus,
        tp=tp,
        pp=pp,
        iters=iters,
        gbs=gbs,
        extra=["--trainmover", "--tm-standbys", "1", *nice, *off] + (extra or []),
    )


def trajectory(path: str) -> dict[int, tuple[float, int, float | None]]:
    """iteration -> (loss, consumed samples, fp16 loss scale or None); an iteration logged twice
    (re-run after an abandon) must carry identical values."""
    out: dict[int, tuple[float, int]] = {}
    for line in open(path):
        rec = json.loads(line)
        if rec.get("event") != "iteration":
            continue
        value = (rec["loss"], rec["consumed_samples"], rec.get("loss_scale"))
        assert out.setdefault(rec["iteration"], value) == value, f"iteration {rec['iteration']} re-ran differently"
    return out


def control_flags(job: LaunchedJob, timeout: float = 60) -> list[str]:
    """``--tm-etcd-endpoints/--tm-job/--tm-job-token`` (and the TLS flags of a ``--tm-etcd-tls`` job) of a
    running job, from the launcher's status hint."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(
            r"status: trainmover status --tm-etcd-endpoints (\S+) --tm-job (\S+) "
            r"--tm-job-token \$\(cat (\S+)\)((?: --tm-etcd-\w+ \S+)*)",
            job.stderr(),
        )
        if m and os.path.exists(m.group(3)):
            return [
                "--tm-etcd-endpoints",
                m.group(1),
                "--tm-job",
                m.group(2),
                "--tm-job-token",
                open(m.group(3)).read().strip(),
                *m.group(4).split(),
            ]
        time.sleep(0.2)
    raise AssertionError(f"the launcher printed no status hint in {timeout}s:\n{job.stderr()[-2000:]}")


def wait_iteration(job: LaunchedJob, iteration: int, timeout: float = 120) -> None:
    """Block until the job logged ``iteration`` (or fail with the launcher's log)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r["iteration"] >= iteration for r in read_metrics(job.metrics_path)):
            return
        if job.popen.poll() is not None:
            raise AssertionError(
                f"job exited {job.popen.returncode} before iteration {iteration}:\n{job.stderr()[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"iteration {iteration} not reached in {timeout}s:\n{job.stderr()[-2000:]}")


def trainmover_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``trainmover <argv>`` and return the completed process (never raises on a non-zero exit)."""
    return subprocess.run(
        [sys.executable, "-m", "trainmover_ext.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


@dataclass(frozen=True)
class TransferReport:
    """One side of a state transfer as a rank recorded it (sizes in MiB)."""

    side: str  # "sent" or "received"
    rank: int
    peer: int
    state_mib: float
    start_mib: float
    peak_mib: float
    end_mib: float | None  # the receiver's resident size after the receive
    mirror: bool = False  # an optimizer shard served from its holder's mirror

    @property
    def extra_mib(self) -> float:
        """Memory beyond what the rank held (sender: at the start) or keeps (receiver: after)."""
        return self.peak_mib - (self.start_mib if self.side == "sent" else self.end_mib)


def transfers(job: LaunchedJob) -> list[TransferReport]:
    """Every state transfer the job's ranks recorded in its timeline (``state_transfer`` events), both sides."""
    mib = 2**20
    return [
        TransferReport(
            side=d["side"],
            rank=d["rank"],
            peer=d["peer"],
            state_mib=d["bytes"] / mib,
            start_mib=d["start_rss"] / mib,
            peak_mib=d["peak_rss"] / mib,
            end_mib=d["end_rss"] / mib if "end_rss" in d else None,
            mirror=bool(d.get("mirror")),
        )
        for d in (e["detail"] for e in job.events("state_transfer"))
    ]


def transfer_reports(job: LaunchedJob) -> list[tuple[int, float, float]]:
    """(source rank, RSS MiB at the start, peak MiB during) of every state transfer's sending side."""
    return [(t.rank, t.start_mib, t.peak_mib) for t in transfers(job) if t.side == "sent"]


def transfer_pairs(job: LaunchedJob) -> set[tuple[int, int]]:
    """(source rank, target rank) of every state transfer the job's ranks reported."""
    return {(t.rank, t.peer) for t in transfers(job) if t.side == "sent"}


def assert_transfer_memory(job: LaunchedJob, fraction: float = 0.02, slack_mib: float = 2.0) -> None:
    """Neither side of any state transfer took more than ``fraction`` of the state (+ ``slack_mib``)
    beyond what it held: the sender beyond its resident size at the start, the receiver beyond what
    it keeps. On the tests' tiny states (under 1 MiB) the slack absorbs the fixed ~1.1 MiB a sender
    takes whatever the state's size; the dedicated memory test (tests/migration/test_transfer_memory.py)
    uses a state large enough to need no slack."""
    reports = transfers(job)
    assert any(t.side == "sent" for t in reports), "no state transfer was reported:\n" + job.stdout()[-2000:]
    for t in reports:
        assert t.extra_mib <= fraction * t.state_mib + slack_mib, (
            f"rank {t.rank} ({t.side} {t.state_mib:.1f} MiB): peak {t.peak_mib:.1f} MiB is {t.extra_mib:.1f} MiB "
            f"over {'its resident size at the start' if t.side == 'sent' else 'what it keeps'}"
        )


def replaced(job: LaunchedJob, reason: str | None = None) -> list[dict]:
    """Every replacement the controller planned, oldest first, from the job's timeline
    (``migration_planned`` events): ``rank``, ``leaver``, ``joiner``, for a failure ``why`` (how the loss
    was detected: ``lease expired`` or ``link broken: process exited with code N``), and the plan's
    ``epoch`` and ``reason``."""
    return [
        dict(r, epoch=e["detail"]["epoch"], reason=e["detail"]["reason"])
        for e in job.events("migration_planned")
        for r in e["detail"]["replacements"]
        if reason is None or e["detail"]["reason"] == reason
    ]


def state_sources(job: LaunchedJob, rank: int) -> list[str]:
    """Where each finished migration of ``rank`` took its state from (``replica``, ``checkpoint``,
    ``leaver``), oldest first, from the run archive's finished plans."""
    return [
        r["state_source"]["kind"]
        for p in sorted(job.migrations(), key=lambda p: p["epoch"])
        for r in p["replacements"]
        if r["rank"] == rank
    ]


def assert_killed(job: LaunchedJob, rank: int, code: int = -9) -> None:
    """``rank`` was replaced because its agent saw its process exit with ``code`` (the fast path)."""
    whys = [r["why"] for r in replaced(job, "failure") if r["rank"] == rank]
    assert f"link broken: process exited with code {code}" in whys, f"rank {rank}: {whys}"


def fell_back(job: LaunchedJob) -> bool:
    """Whether any node gave up on live recovery and asked for a stop-restart (a ``stop_restart`` event)."""
    return bool(job.events("stop_restart"))


def assert_recovered(job: LaunchedJob, ref: dict, victim: int) -> None:
    """``job`` lost ``victim`` once, replaced it with a standby without a restart, and trained the
    fault-free trajectory ``ref`` bit for bit, with no sample skipped or repeated."""
    got = trajectory(job.metrics_path)
    assert sorted(got) == list(range(1, ITERS + 1)), "an iteration is missing"
    for it in ref:
        assert got[it] == ref[it], f"iteration {it}: {got[it]} != fault-free {ref[it]}"
    # no sample skipped or repeated: consumed samples advance by exactly one global batch
    consumed = [got[i][1] for i in sorted(got)]
    assert all(b - a == consumed[0] for a, b in zip(consumed, consumed[1:], strict=False))
    tail = job.stderr()[-3000:]
    # the timeline the launcher archived: the victim's rank went to a standby in a failure epoch that
    # finished, and no node fell back to stop-restart
    served = [
        p
        for p in job.migrations()
        if p["reason"] == "failure"
        and p["status"] == "done"
        and any(r["rank"] == victim and r["joiner"].startswith("standby") for r in p["replacements"])
    ]
    assert served, f"no finished failure epoch gave rank {victim} to a standby: {job.migrations()}\n{tail}"
    assert not fell_back(job), tail
    # pool upkeep: a fresh standby replaces the consumed one once the migration is over, woken from a
    # child forked at the start (--tm-standby-reserves) rather than a new interpreter
    refills = [e for e in job.events("standby_started") if e["detail"]["how"] != "fork"]
    assert refills and all(e["detail"]["how"] == "pre-forked" for e in refills), f"{refills}\n{tail}"
    assert_transfer_memory(job)


class JobProbe:
    """Reads one job's control keys straight from etcd (who leads, which plans were written)."""

    def __init__(self, endpoints: list[str], job: str, token: str):
        self.endpoints, self.job, self.token = endpoints, job, token

    def _space(self):
        from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
        from trainmover_ext.kv.job import JobSpace, job_login

        config = job_login(EtcdClientConfig(endpoints=",".join(self.endpoints)), self.job, self.token)
        return JobSpace.open(EtcdKV(config), self.job, self.token)

    def leader(self) -> str | None:
        from trainmover_ext.kv.codec import decode

        space = self._space()
        try:
            entry = space.kv.get(space.key("leader"))
            return None if entry is None else decode(entry.value, kind="leader", key=space.key("leader"))["id"]
        finally:
            space.kv.close()

    def view(self):
        """The job's control state as the controller reads it (:class:`~trainmover_ext.control.view.View`)."""
        from trainmover_ext.control.view import read_view

        space = self._space()
        try:
            return read_view(space)
        finally:
            space.kv.close()

    def plans(self) -> list:
        from trainmover_ext.control.records import MigrationPlan

        space = self._space()
        try:
            return [
                MigrationPlan.from_bytes(e.value, key=e.key)
                for e in space.kv.get_prefix(space.key("migrations") + "/").entries
            ]
        finally:
            space.kv.close()

    def members(self, kind: str | None = None) -> list[dict]:
        """The ``members/<id>`` records as stored, of ``kind`` if given: a standby's holds its ``warmup``
        report (mode, per-role timings, where its recordings were copied from), which the view drops."""
        from trainmover_ext.kv.codec import decode

        space = self._space()
        try:
            entries = space.kv.get_prefix(space.key("members") + "/").entries
            found = [decode(e.value, kind="member", key=e.key) for e in entries]
            return [m for m in found if kind is None or m["kind"] == kind]
        finally:
            space.kv.close()

    def events(self, what: str) -> list[dict]:
        """The details of the job's timeline events named ``what`` (``events/``), oldest first."""
        from trainmover_ext.control.records import Event

        space = self._space()
        try:
            entries = space.kv.get_prefix(space.events_prefix).entries
            return [ev.detail for ev in (Event.from_bytes(e.value, key=e.key) for e in entries) if ev.what == what]
        finally:
            space.kv.close()


def wait_until(pred, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``pred()`` until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def warm_standbys(job, role: str | None = None) -> set[str]:
    """Standby member ids that `trainmover status` lists with warm roles (with ``role``: warm for it)."""
    status = trainmover_cli("status", *control_flags(job))
    assert status.returncode == 0, status.stderr[-2000:]
    section = status.stdout.split("standbys:", 1)[1].split("last migration:", 1)[0]
    rows = [line.split() for line in section.splitlines()[2:] if line.strip() and "(starting)" not in line]
    return {row[0] for row in rows if role is None or role in row[3].split(",")}


def wait_warm(job, role: str | None = None, member: str | None = None) -> set[str]:
    """Wait until a standby (``member``, or any) is warm (for ``role``); returns the warm ones."""

    def ready() -> set[str] | None:
        warm = warm_standbys(job, role)
        return warm if (member in warm if member else warm) else None

    return wait_for(
        ready,
        120,
        interval=0.2,
        what=f"{member or 'a standby'} to be warm for {role or 'any role'}",
        detail=lambda: job.stdout()[-3000:],
        give_up=lambda: job.popen.poll() is not None,
    )
