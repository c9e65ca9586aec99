"""Prometheus metrics of the control plane, and a loopback /metrics server.

Contract: each :class:`ControlMetrics` owns its own ``CollectorRegistry``, so
several controllers in one process (tests) never collide on metric names.
:meth:`ControlMetrics.serve` exposes it on ``host:port`` (loopback by default;
port 0 picks a free one) from a daemon thread, and returns the bound port.

Example::

    metrics = ControlMetrics(job="llama")
    port = metrics.serve(0)          # curl http://127.0.0.1:<port>/metrics
    Controller(space, metrics=metrics, ...)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

# Detection latency buckets: the SIGKILL goal is < 0.5 s, the SIGSTOP goal < 2x the lease TTL.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class ControlMetrics:
    """Gauges and counters of one job's control plane; see the module docstring."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["job"]
        self.members = Gauge("trainmover_members", "Live members by kind", labels + ["kind"], registry=self.registry)
        self.epoch = Gauge("trainmover_epoch", "Current membership epoch", labels, registry=self.registry)
        self.is_leader = Gauge("trainmover_controller_leader", "1 while this controller holds the leader key", labels, registry=self.registry)
        self.detections = Counter("trainmover_detections", "Failures acted on, by detection path", labels + ["path"], registry=self.registry)
        self.detection_latency = Histogram("trainmover_detection_latency_seconds",
                                           "From detection (report or observed lease loss) to committed plan",
                                           labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.plans = Counter("trainmover_migration_plans", "Migration plans committed, by reason", labels + ["reason"], registry=self.registry)
        self.alerts = Counter("trainmover_alerts", "Orphaned ranks with no standby", labels, registry=self.registry)
        self.job = job
        self._server = None

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

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
