"""Prometheus metrics of an agent (training progress, membership, migrations) and a /metrics server.

Contract:
- Each :class:`ControlMetrics` / :class:`AgentMetrics` owns its own
  ``CollectorRegistry``, so several in one process (tests) never collide.
  :meth:`ControlMetrics.serve` exposes it on ``host:port`` (loopback by
  default; port 0 picks a free one) from a daemon thread and returns the port.
- The controller feeds the control-plane series it alone knows (leader flag,
  detections by path, detection latency, plans it committed): on a multi-node
  job these appear on the endpoint of the agent that led when it happened.
- :class:`MetricsFeed` (one daemon thread per agent) feeds the rest:
  training progress by tailing the workers' ``--tm-metrics-file`` (only the
  node hosting the logging rank has one), and job-wide membership and
  migrations by reading the job's etcd space. Job-wide series come from the
  agent whose controller leads only (``is_leader``); the others drop them, so a
  ``sum`` over every agent counts each once.
- Every series carries the label ``tm_job`` (Prometheus sets ``job`` itself, to
  the scrape job). ``trainmover_build_info`` says which versions run.
- Nothing here ever raises into training: a failed read is retried next round.

Example::

    metrics = AgentMetrics(job="llama")
    port = metrics.serve(0)          # curl http://127.0.0.1:<port>/metrics
    feed = MetricsFeed(metrics, metrics_file="runs/llama/metrics.jsonl", tokens_per_iteration=16 * 2048).start()
    feed.attach(space)               # once the agent has joined the job in etcd
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

logger = logging.getLogger(__name__)

# Detection latency buckets: the SIGKILL goal is < 0.5 s, the SIGSTOP goal < 2x the lease TTL.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# Migration phases run from milliseconds (decide) to tens of seconds (a checkpoint load on a big model).
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITERATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINISHED_STATUSES = ("done", "aborted")


class _ScrapeCounter:
    """A collector that exports nothing and counts the reads of its registry (one per scrape)."""

    def __init__(self, owner: ControlMetrics) -> None:
        self.owner = owner

    def describe(self) -> list:
        return []  # registering must not count as a scrape

    def collect(self) -> list:
        self.owner.scrapes += 1
        return []


class ControlMetrics:
    """Gauges and counters of one job's control plane; see the module docstring. It is the
    controller's :class:`~trainmover_ext.control.controller.ControlObserver`."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["tm_job"]
        self.build_info = Gauge(
            "trainmover_build_info",
            "Always 1; the labels name the versions this agent runs",
            labels + ["version", "torch", "megatron_core", "python"],
            registry=self.registry,
        )
        self.build_info.labels(job, *_versions()).set(1)
        self.members = Gauge("trainmover_members", "Live members by kind", labels + ["kind"], registry=self.registry)
        self.epoch = Gauge(
            "trainmover_membership_epoch",
            "Current membership epoch (bumped by every committed migration)",
            labels,
            registry=self.registry,
        )
        self.is_leader = Gauge(
            "trainmover_controller_leader",
            "1 while this controller holds the leader key",
            labels,
            registry=self.registry,
        )
        self.detections = Counter(
            "trainmover_detections", "Failures acted on, by detection path", labels + ["path"], registry=self.registry
        )
        self.detection_latency = Histogram(
            "trainmover_detection_latency_seconds",
            "From detection (report or observed lease loss) to committed plan",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.alerts = Counter(
            "trainmover_unserved_ranks",
            "Failed ranks that no warm standby could take (the job cannot go on without one)",
            labels,
            registry=self.registry,
        )
        self.job = job
        self._server = None
        self.scrapes = 0
        """How many times /metrics was read (see :meth:`linger`)."""
        self.registry.register(_ScrapeCounter(self))
        # Exported as 0 before the first occurrence, so that rate() and alert rules see the series.
        self.alerts.labels(job)
        for path in ("report", "lease"):
            self.detections.labels(job, path)

    def observe_leadership(self, is_leader: bool) -> None:
        self.is_leader.labels(self.job).set(1 if is_leader else 0)

    def observe_plan(self, epoch: int, detection_paths: list[str], latency_s: float | None) -> None:
        self.epoch.labels(self.job).set(epoch)
        for path in detection_paths:
            self.detections.labels(self.job, path).inc()
        if latency_s is not None:
            self.detection_latency.labels(self.job).observe(latency_s)

    def observe_alert(self) -> None:
        self.alerts.labels(self.job).inc()

    def observe_view(self, members_by_kind: dict[str, int], epoch: int | None) -> None:
        for kind in ("worker", "standby", "agent"):
            self.members.labels(self.job, kind).set(members_by_kind.get(kind, 0))
        if epoch is not None:
            self.epoch.labels(self.job).set(epoch)

    def render(self) -> bytes:
        """The text exposition format, as served at /metrics."""
        return generate_latest(self.registry)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve /metrics on ``host:port`` from a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def linger(self, timeout_s: float) -> bool:
        """Keep serving until /metrics is read once more, at most ``timeout_s``; returns whether it was.

        A job's agent calls this at a clean finish, with ``trainmover_job_finished`` set, so that Prometheus
        sees the finish before the series vanish (``TrainMoverJobDown`` stays quiet). Nothing waits when
        nobody ever scraped this endpoint."""
        if not self.serving or self.scrapes == 0 or timeout_s <= 0:
            return False
        seen, deadline = self.scrapes, time.monotonic() + timeout_s
        while self.scrapes == seen and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.scrapes != seen

    @property
    def serving(self) -> bool:
        """True between :meth:`serve` and :meth:`close`."""
        return self._server is not None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class AgentMetrics(ControlMetrics):
    """:class:`ControlMetrics` plus training progress, standby readiness and migration phases."""

    def __init__(self, job: str) -> None:
        super().__init__(job)
        labels, reg = ["tm_job"], self.registry
        self.iteration = Gauge("trainmover_iteration", "Last completed training iteration", labels, registry=reg)
        self.iterations = Counter(
            "trainmover_iterations",
            "Training iterations completed (a re-run after an abandon counts once)",
            labels,
            registry=reg,
        )
        self.iteration_time = Gauge(
            "trainmover_last_iteration_seconds",
            "Wall time of the last completed iteration (every iteration: trainmover_iteration_duration_seconds)",
            labels,
            registry=reg,
        )
        self.iteration_hist = Histogram(
            "trainmover_iteration_duration_seconds",
            "Wall time of each iteration",
            labels,
            buckets=_ITERATION_BUCKETS,
            registry=reg,
        )
        self.tokens = Counter(
            "trainmover_tokens",
            "Training tokens processed (global batch x sequence length per "
            "completed iteration; a re-run after an abandon counts once)",
            labels,
            registry=reg,
        )
        self.loss = Gauge("trainmover_loss", "Loss of the last completed iteration", labels, registry=reg)
        self.last_progress = Gauge(
            "trainmover_last_progress_timestamp_seconds",
            "Unix time at which the last iteration completed (alert when it stops moving)",
            labels,
            registry=reg,
        )
        self.tokens_per_s = Gauge(
            "trainmover_tokens_per_second",
            "Tokens per second of the last iteration (global batch x sequence length / iteration time)",
            labels,
            registry=reg,
        )
        self.restarts = Counter(
            "trainmover_restarts",
            "Stop-restarts of every rank from the checkpoint (under "
            "--trainmover: a failure no warm standby could take)",
            labels,
            registry=reg,
        )
        self.restarts.labels(job)
        self.standbys_ready = Gauge(
            "trainmover_standbys_ready", "Live standbys that finished warm-up and serve no rank", labels, registry=reg
        )
        self.migrations = Counter(
            "trainmover_migrations",
            "Migrations committed (migrations/<epoch> in etcd), by kind",
            labels + ["kind"],
            registry=reg,
        )
        self.migration_phase = Histogram(
            "trainmover_migration_phase_seconds",
            "Duration of each step of a finished migration, labelled by the step it ends in "
            "(decided, joined/links_rebuilt, transferred/checkpoint_loaded, first_iteration)",
            labels + ["kind", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=reg,
        )
        self.migration_downtime = Histogram(
            "trainmover_migration_downtime_seconds",
            "From the first recorded step (detection or request) to the last "
            "(end of the first iteration after resume) of a finished migration",
            labels + ["kind"],
            buckets=_PHASE_BUCKETS,
            registry=reg,
        )
        self.migration_age = Gauge(
            "trainmover_migration_in_progress_seconds",
            "Age of the oldest committed migration that has not finished (0: none); a migration that never "
            "finishes keeps growing it",
            labels,
            registry=reg,
        )
        self.job_finished = Gauge(
            "trainmover_job_finished",
            "1 once every rank of the job finished training (the job's series may then vanish: no alert)",
            labels,
            registry=reg,
        )
        gpu = labels + ["slot"]
        self.gpu_unfit = Gauge(
            "trainmover_gpu_unfit",
            "1 while the GPU of this slot has XID errors, uncorrected ECC errors or clocks held down by the board",
            gpu,
            registry=reg,
        )
        self.gpu_sm_clock = Gauge("trainmover_gpu_sm_clock_mhz", "SM clock of the slot's GPU", gpu, registry=reg)
        self.gpu_temperature = Gauge(
            "trainmover_gpu_temperature_celsius", "Temperature of the slot's GPU", gpu, registry=reg
        )
        self.gpu_ecc = Gauge(
            "trainmover_gpu_ecc_uncorrected_errors",
            "Volatile uncorrected ECC errors of the slot's GPU",
            gpu,
            registry=reg,
        )
        self.gpu_xid = Gauge(
            "trainmover_gpu_xid_errors", "XID errors of the slot's GPU since the agent started", gpu, registry=reg
        )
        self.zero_migrations()

    def observe_gpus(self, readings: Mapping[int, Any], unfit: Mapping[int, list[str]]) -> None:
        """After each read of the node's GPUs: slot -> its ``trainmover_ext.launch.gpu_health.GpuReading`` (read
        by attribute: this layer is below the launcher's), and each slot's problems."""
        for slot, r in readings.items():
            key = (self.job, str(slot))
            self.gpu_unfit.labels(*key).set(1 if unfit.get(slot) else 0)
            self.gpu_xid.labels(*key).set(len(r.xid_errors))
            for gauge, value in (
                (self.gpu_sm_clock, r.sm_clock_mhz),
                (self.gpu_temperature, r.temperature_c),
                (self.gpu_ecc, r.ecc_uncorrected),
            ):
                if value is not None:
                    gauge.labels(*key).set(value)

    def zero_migrations(self) -> None:
        """Export the migrations counter as 0 per kind before the first migration, so rate() works."""
        for kind in ("failure", "planned"):
            self.migrations.labels(self.job, kind)


def _versions() -> tuple[str, str, str, str]:
    """(trainmover, torch, megatron-core, python) versions, "unknown" where one cannot be read."""
    import importlib.metadata
    import platform

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return version("trainmover"), version("torch"), version("megatron-core"), platform.python_version()


def migration_phases(steps: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(phase, start, end)`` for consecutive recorded steps in time order; a phase is named by the step it ends in."""
    ordered = sorted(steps.items(), key=lambda kv: kv[1])
    return [(name, t0, t1) for (_, t0), (name, t1) in zip(ordered, ordered[1:], strict=False)]


class MetricsFeed:
    """Feeds an :class:`AgentMetrics` from the workers' metrics file and the job's etcd space (see the module
    docstring)."""

    def __init__(
        self, metrics: AgentMetrics, *, metrics_file: str | None, tokens_per_iteration: int = 0, interval_s: float = 0.5
    ) -> None:
        self.metrics, self.metrics_file = metrics, metrics_file
        self.is_leader: Callable[[], bool] = lambda: True
        """Whether this agent exports the job-wide series (its controller leads); set by :meth:`attach`."""
        self.tokens_per_iteration = tokens_per_iteration
        self.interval_s = interval_s
        self.space = None
        # Records already in the file belong to an earlier run (the logging rank appends).
        self._offset = os.path.getsize(metrics_file) if metrics_file and os.path.exists(metrics_file) else 0
        self._partial = b""
        self._last_iteration = 0
        self._seen_epochs: set[int] = set()
        self._finished_epochs: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsFeed:
        self._thread = threading.Thread(target=self._run, name="tm-metrics-feed", daemon=True)
        self._thread.start()
        return self

    def attach(self, space, is_leader: Callable[[], bool] | None = None) -> None:
        """Also read membership and migrations from ``space`` (a :class:`~trainmover_ext.kv.job.JobSpace`),
        exporting them while ``is_leader()`` (this agent's controller leads) says so."""
        self.space = space
        if is_leader is not None:
            self.is_leader = is_leader

    def detach(self) -> None:
        """Stop reading the job from etcd and keep the job-wide series as they are: called when this agent
        stops, before its controller resigns, so that the figures of a finished job stay exported (an
        agent whose controller merely lost the lead clears them instead)."""
        self.space = None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after one last round, so a finished job's final numbers are exported."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.poll()
            if stopping:
                return
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        """One round: new iteration records, then the etcd picture; errors are logged and retried next round."""
        try:
            self.read_iterations()
        except (OSError, ValueError) as exc:
            logger.warning("metrics: could not read %s: %s", self.metrics_file, exc)
        if self.space is not None:
            from trainmover_ext.errors import TrainMoverError

            try:
                self.read_job()
            except TrainMoverError as exc:
                logger.info("metrics: etcd read failed (retrying): %s", exc)

    # -- training progress ---------------------------------------------------------
    def read_iterations(self) -> None:
        path = self.metrics_file
        if not path or not os.path.exists(path):
            return
        size = os.path.getsize(path)
        if size < self._offset:  # the file was replaced (a new run): start over
            self._offset, self._partial = 0, b""
        with open(path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an incomplete last line is read again next round
        for line in lines:
            if line.strip():
                self.observe_record(json.loads(line))

    def observe_record(self, rec: dict) -> None:
        if rec.get("event") != "iteration":
            return
        m, job = self.metrics, self.metrics.job
        iteration, seconds = int(rec["iteration"]), float(rec.get("iteration_s") or 0.0)
        if iteration > self._last_iteration:
            new = iteration - self._last_iteration if self._last_iteration else 1
            m.iterations.labels(job).inc(new)
            m.tokens.labels(job).inc(new * self.tokens_per_iteration)
            self._last_iteration = iteration
        m.iteration.labels(job).set(iteration)
        if rec.get("loss") is not None:
            m.loss.labels(job).set(float(rec["loss"]))
        if rec.get("t_end") is not None:
            m.last_progress.labels(job).set(float(rec["t_end"]))
        if seconds > 0:
            m.iteration_time.labels(job).set(seconds)
            m.iteration_hist.labels(job).observe(seconds)
            if self.tokens_per_iteration:
                m.tokens_per_s.labels(job).set(self.tokens_per_iteration / seconds)

    # -- membership and migrations -------------------------------------------------
    def read_job(self) -> None:
        from trainmover_ext.control.records import MigrationPlan
        from trainmover_ext.control.view import read_view
        from trainmover_ext.errors import MalformedValue

        m, job, space = self.metrics, self.metrics.job, self.space
        if space is None:  # detached meanwhile (the agent stops)
            return
        if not self.is_leader():
            for series in (
                m.members,
                m.epoch,
                m.standbys_ready,
                m.migrations,
                m.migration_phase,
                m.migration_downtime,
                m.migration_age,
                m.job_finished,
            ):
                series.clear()
            self._seen_epochs.clear()  # counted again, from zero, if this agent leads later
            self._finished_epochs.clear()
            return
        m.zero_migrations()
        view = read_view(space)
        m.observe_view(dict(Tally(mem.kind for mem in view.members.values())), view.epoch)
        serving = {rec.member_id for rec in view.ranks.values()}
        m.standbys_ready.labels(job).set(
            sum(
                1
                for mem in view.members.values()
                if mem.kind == "standby" and mem.warm_roles and mem.health == "ok" and mem.member_id not in serving
            )
        )
        m.job_finished.labels(job).set(1 if view.ranks and set(view.ranks) <= view.finished else 0)
        oldest: float | None = None
        for entry in space.kv.get_prefix(space.key("migrations/")).entries:
            try:
                plan = MigrationPlan.from_bytes(entry.value, key=entry.key)
            except MalformedValue:
                continue
            if plan.status not in FINISHED_STATUSES and plan.steps and plan.epoch == view.epoch:
                started = min(plan.steps.values())  # an older unfinished plan was superseded by a newer one
                oldest = started if oldest is None else min(oldest, started)
            if plan.epoch not in self._seen_epochs:
                self._seen_epochs.add(plan.epoch)
                m.migrations.labels(job, plan.reason).inc()
            if plan.status in FINISHED_STATUSES and plan.epoch not in self._finished_epochs:
                self._finished_epochs.add(plan.epoch)
                for phase, t0, t1 in migration_phases(plan.steps):
                    m.migration_phase.labels(job, plan.reason, phase).observe(t1 - t0)
                if len(plan.steps) >= 2:
                    m.migration_downtime.labels(job, plan.reason).observe(
                        max(plan.steps.values()) - min(plan.steps.values())
                    )
        m.migration_age.labels(job).set(0.0 if oldest is None else max(0.0, time.time() - oldest))
