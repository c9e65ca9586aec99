"""The node agent: start this node's ranks, watch them, tear down or restart.

Contract:
- ``run()`` returns 0 when every rank exited 0, else the first failing rank's
  exit code (128 + signal for a killed rank), after all ranks are gone.
- When a rank fails, every other rank of this node is stopped (SIGTERM, then
  SIGKILL after ``term_timeout_s``). With restarts left, all ranks start again
  as fresh processes; the script is expected to resume from ``--load``.
- SIGINT/SIGTERM to the agent tears every rank down and returns 130/143.
- Ranks die with the agent (PR_SET_PDEATHSIG), so none is orphaned.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, LaunchError
from trainmover_ext.etcd.auth import ROOT_USER
from trainmover_ext.fsutil import write_private
from trainmover_ext.launch.config import LaunchConfig
from trainmover_ext.launch.identity import ENV_NODE_NAME, node_name
from trainmover_ext.launch.process import RankProcess, fork_rank, preimport_for_fork, spawn_rank
from trainmover_ext.launch.summary import Failure, FailureLog, describe_code
from trainmover_ext.netutil import free_port


@dataclass(kw_only=True)
class MetricsEndpoint:
    """Where the agent serves Prometheus /metrics (``--metrics-port``, ``--metrics-host``)."""

    port: int = 0
    """``--metrics-port``: TCP port; 0 picks a free one (printed at start), -1 serves nothing."""
    host: str = "127.0.0.1"
    """``--metrics-host``: address to bind; 0.0.0.0 lets a Prometheus server on another host scrape."""
    metrics_file: str | None = None
    """The workers' ``--tm-metrics-file`` the agent tails for iteration metrics (set by :meth:`Agent.run`)."""
    tokens_per_iteration: int = 0
    """Global batch size x sequence length, for tokens/s (0: not exported)."""
    linger_s: float = 30.0
    """``--metrics-linger``: after a clean finish, serve until the next scrape, at most this long (only when
    something scraped the endpoint), so that Prometheus sees ``trainmover_job_finished 1``."""

    def __post_init__(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ConfigError("--metrics-port must be a TCP port, 0 for a free one, or -1 for none")
        if self.linger_s < 0:
            raise ConfigError(f"--metrics-linger {self.linger_s}: give seconds >= 0 (0: exit at once)")


class Agent:
    """Starts and supervises one node's ranks; see the module docstring."""

    def __init__(
        self, config: LaunchConfig, log=None, *, write_token_file: bool = False, metrics: MetricsEndpoint | None = None
    ):
        self.config = config
        self.endpoint = metrics or MetricsEndpoint(port=-1)
        self.metrics = self.metrics_feed = None
        self.write_token_file = write_token_file
        """The agent generated the job token: save it in the run dir so `trainmover status` can use it."""
        self.procs: list[RankProcess] = []
        self.restarts = 0
        self.stop_signal: int | None = None
        self.log = log or (lambda msg: print(f"[trainmover launch] {msg}", file=sys.stderr, flush=True))
        self.events: list[dict] = []
        self.finished_ok = False
        """Every rank of this node finished (set just before :meth:`run` returns 0)."""
        self.failures = FailureLog(config.script)
        """Every process failure seen, printed as a summary when the launch fails (``launch.summary``)."""
        self.etcd = None

    def rank_env(self, local_rank: int, port: int) -> dict[str, str]:
        cfg = self.config
        return cfg.rendezvous.env(self.restarts) | {
            "RANK": str(cfg.node_rank * cfg.nproc_per_node + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(cfg.node_rank),
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(port),
            "TRAINMOVER_RESTART_COUNT": str(self.restarts),
            "TORCHELASTIC_RESTART_COUNT": str(self.restarts),  # as torchrun sets it
            "TORCHELASTIC_RUN_ID": cfg.rendezvous.job,  # torchrun's --rdzv-id; here the job name
            ENV_NODE_NAME: node_name(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # Megatron wants 1 (TP/SP comm overlap); a user's own setting is kept.
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        }

    def start_ranks(self, method: str) -> None:
        cfg = self.config
        port = cfg.master_port or free_port(cfg.master_addr)
        if method == "fork":
            preimport_for_fork()
        start = spawn_rank if method == "spawn" else fork_rank
        self.procs = []
        for i in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + i
            self.procs.append(
                start(
                    rank,
                    self.rank_env(i, port),
                    cfg.script,
                    cfg.script_args,
                    cfg.logs.open(str(rank), i, self.restarts),
                )
            )
        self.events.append(
            {
                "event": "start",
                "t": time.time(),
                "method": method,
                "restart": self.restarts,
                "pids": [p.pid for p in self.procs],
            }
        )
        self.log(f"started {len(self.procs)} ranks ({method}), pids {[p.pid for p in self.procs]}")

    def stop_ranks(self) -> None:
        """SIGTERM every live rank, SIGKILL what is left after the grace period, reap all."""
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        deadline = Deadline(self.config.term_timeout_s)
        while not deadline.expired and any(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
        for proc in self.procs:
            while proc.poll() is None:
                time.sleep(0.01)

    def _run_trainmover(self) -> int | None:
        """Supervise with warm standbys; returns an exit code, or None to fall back to stop-restart
        (all processes already stopped, restarts then start fresh ranks)."""
        from trainmover_ext.launch.tm_supervisor import TrainMoverSupervisor

        if self.config.rendezvous.backend != "etcd":
            raise LaunchError("--trainmover needs the etcd rendezvous: drop --rdzv-backend")
        sup = TrainMoverSupervisor(self)
        try:
            sup.start()
            self._serve_metrics()
            ok, code = sup.supervise()
        finally:
            sup.close()
        if ok:
            self.stop_ranks()
            self.log("all ranks finished")
            return 0
        self.stop_ranks()
        if self.stop_signal is not None or self.restarts >= self.config.max_restarts or self.config.role == "standby":
            return code  # a standby machine has no ranks of its own to restart
        self.restarts += 1
        self._count_restart()
        self.log(f"restart {self.restarts}/{self.config.max_restarts}: all ranks start again from the checkpoint")
        self.start_ranks(self.config.restart_start_method)
        return None

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def _wait(self) -> tuple[RankProcess | None, bool]:
        """Block until a rank fails (returns it) or all succeed (returns None).

        Of the ranks found failed at once, one killed by a signal is returned first: a killed rank's
        peers then fail with an error of their own (a closed connection), and may be reaped in the
        same poll; the signal is the cause worth reporting."""
        while True:
            if self.stop_signal is not None:
                return None, False
            codes = [p.poll() for p in self.procs]
            failed = [(code, proc) for proc, code in zip(self.procs, codes, strict=False) if code not in (None, 0)]
            if failed:
                killed = [proc for code, proc in failed if code < 0]
                return (killed or [failed[0][1]])[0], False
            if all(code == 0 for code in codes):
                return None, True
            time.sleep(self.config.monitor_interval_s)

    def _start_embedded_etcd(self) -> None:
        """Start a local etcd for rendezvous and membership when no endpoints were given."""
        from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig

        plan = self.config.rendezvous
        run_dir = self.config.run_dir or os.path.join("runs", plan.job)
        os.makedirs(run_dir, exist_ok=True)
        data_dir = os.path.join(run_dir, f"etcd-{os.getpid()}")
        tls: dict = {}
        if self.config.etcd_tls:
            from trainmover_ext.etcd.pki import make_job_certs

            certs = make_job_certs(
                os.path.join(run_dir, "etcd-tls"), job=plan.job, hosts=["127.0.0.1", "localhost", socket.gethostname()]
            )
            tls = {
                "cert_file": certs.server_cert,
                "key_file": certs.server_key,
                "trusted_ca_file": certs.ca_cert,
                "client_cert_auth": True,
            }
            plan.tls.update(ca_cert=certs.ca_cert, client_cert=certs.client_cert, client_key=certs.client_key)
        self.etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=data_dir, die_with_parent=True, **tls)).start()
        plan.endpoints = list(self.etcd.endpoints)
        self._lock_etcd(run_dir)  # before the address is printed: no client connects to it unlocked
        self.log(
            f"embedded etcd at {','.join(plan.endpoints)} (data {data_dir}"
            + (f"; TLS with client certificates from {os.path.dirname(tls['trusted_ca_file'])})" if tls else ")")
        )

    def _lock_etcd(self, run_dir: str) -> None:
        """Turn the embedded etcd's auth on, with the job's own user (see ``etcd.auth``): from now on
        only a process holding the job token reads or writes anything. The root password goes to
        ``<run dir>/etcd-root-password`` (mode 600), for an operator to administer the server."""
        from trainmover_ext.etcd.auth import provision_job
        from trainmover_ext.kv.job import job_user

        plan = self.config.rendezvous
        root_password = provision_job(self.etcd.client_url, plan.job, plan.token, enable=True, tls=self._gateway_tls())
        path = os.path.join(run_dir, "etcd-root-password")
        write_private(path, f"{root_password}\n")
        self.log(
            f"etcd auth on: the job's user {job_user(plan.job)} reads and writes only /trainmover/{plan.job}/ "
            f"(root password in {path})"
        )

    def _provision_external_etcd(self) -> None:
        """``--tm-etcd-user root``: create the job's user on the external etcd (its auth must be on), then
        drop the root login, so that no rank, standby or agent holds more than the job's own prefix."""
        from trainmover_ext.etcd.auth import provision_job
        from trainmover_ext.kv.job import job_user

        plan = self.config.rendezvous
        tls = plan.tls
        scheme = "https" if tls.get("ca_cert") else "http"
        provision_job(
            f"{scheme}://{plan.endpoints[0].split('://')[-1]}",
            plan.job,
            plan.token,
            admin=(tls["user"], tls.get("password") or ""),
            tls=self._gateway_tls(),
        )
        plan.tls = {k: v for k, v in tls.items() if k not in ("user", "password")}
        self.log(
            f"etcd: the job's user {job_user(plan.job)} may read and write /trainmover/{plan.job}/ only; "
            "every process of the job logs in as it (the root login stays with this launcher)"
        )

    def _gateway_tls(self):
        """How the launcher's own admin calls (``etcd.auth``) reach an https etcd, or None."""
        from trainmover_ext.etcd.auth import GatewayTLS

        tls = self.config.rendezvous.tls
        if not tls.get("ca_cert"):
            return None
        return GatewayTLS(ca_cert=tls["ca_cert"], client_cert=tls.get("client_cert"), client_key=tls.get("client_key"))

    def run_dir(self) -> str:
        return self.config.run_dir or os.path.join("runs", self.config.rendezvous.job)

    def _prepare_recordings(self) -> None:
        """Turn the sandbox on by default: a ``--trainmover`` script without ``--tm-record-dir`` (or
        ``--tm-no-sandbox``) records into ``<run dir>/recordings``, which its standbys warm from."""
        cfg = self.config
        if not cfg.sandbox:
            self.log("sandbox: off (--tm-no-sandbox); standbys do the basic warm-up")
            return
        if cfg.record_dir is not None:
            return
        record_dir = os.path.abspath(os.path.join(self.run_dir(), "recordings"))
        os.makedirs(record_dir, exist_ok=True)
        cfg.record_dir = record_dir
        cfg.script_args = list(cfg.script_args) + ["--tm-record-dir", record_dir]
        if cfg.role == "standby":
            self.log(
                f"sandbox: this machine's standbys copy the job's recordings into {record_dir} from the agent "
                "of the node that recorded them, and warm every pipeline role from them (--tm-no-sandbox "
                "turns it off)"
            )
            return
        self.log(
            f"sandbox: the job records its first iterations into {record_dir}; standbys warm every pipeline "
            "role from them, those on other nodes through this agent (--tm-no-sandbox turns it off)"
        )

    def _prepare_metrics(self) -> None:
        """Build the registry and the feed; nothing runs yet (see :meth:`_serve_metrics`)."""
        from trainmover_ext.metrics import AgentMetrics, MetricsFeed

        ep, cfg = self.endpoint, self.config
        if ep.metrics_file is None and cfg.trainmover:
            # A --trainmover script takes --tm-metrics-file; ask its logging rank for one the agent can tail.
            ep.metrics_file = os.path.join(self.run_dir(), "metrics.jsonl")
            os.makedirs(self.run_dir(), exist_ok=True)
            cfg.script_args = list(cfg.script_args) + ["--tm-metrics-file", ep.metrics_file]
        self.metrics = AgentMetrics(job=cfg.rendezvous.job)
        self.metrics_feed = MetricsFeed(
            self.metrics, metrics_file=ep.metrics_file, tokens_per_iteration=ep.tokens_per_iteration
        )

    def _serve_metrics(self) -> None:
        """Serve /metrics and start the feed thread. Called only after ranks are forked: a forked rank
        must inherit neither the listening socket nor a lock held by the feed thread."""
        if self.metrics is None or self.metrics.serving:
            return
        ep = self.endpoint
        try:
            port = self.metrics.serve(ep.port, ep.host)
        except OSError as exc:
            raise LaunchError(
                f"cannot serve /metrics on {ep.host}:{ep.port} ({exc}): pick another --metrics-port, "
                "or 0 for a free one"
            ) from exc
        self.metrics_feed.start()
        shown = socket.gethostname() if ep.host in ("0.0.0.0", "::") else ep.host
        self.log(
            f"metrics: http://{shown}:{port}/metrics"
            + ("" if ep.metrics_file else " (no iteration series: the script has no --tm-metrics-file)")
        )

    def _count_restart(self) -> None:
        if self.metrics is not None:
            self.metrics.restarts.labels(self.metrics.job).inc()

    def _stop_metrics(self, finished: bool = False) -> None:
        """Stop serving; after a clean finish (``finished``) first say so and wait for one more scrape."""
        if finished and self.metrics is not None and self.metrics.serving:
            self.metrics.job_finished.labels(self.metrics.job).set(1)
            if self.metrics.linger(self.endpoint.linger_s):
                self.log("metrics: Prometheus read that the job finished")
        if self.metrics_feed is not None:
            self.metrics_feed.close()
            self.metrics_feed = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _announce_job(self) -> None:
        """Print how to look at the job; a token this agent generated goes to ``<run dir>/job-token`` (mode 600)."""
        plan = self.config.rendezvous
        token_ref = "$TRAINMOVER_JOB_TOKEN"
        if self.write_token_file:
            run_dir = self.run_dir()
            os.makedirs(run_dir, exist_ok=True)
            token_file = os.path.join(run_dir, "job-token")
            write_private(token_file, plan.token + "\n")
            token_ref = f"$(cat {token_file})"
        tls = "".join(
            f" --tm-etcd-{flag} {plan.tls[name]}"
            for flag, name in (("ca", "ca_cert"), ("cert", "client_cert"), ("key", "client_key"))
            if plan.tls.get(name)
        )
        self.log(
            f"status: trainmover status --tm-etcd-endpoints {','.join(plan.endpoints)} --tm-job {plan.job} "
            f"--tm-job-token {token_ref}{tls}"
        )

    def _stop_embedded_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
            shutil.rmtree(self.etcd.config.data_dir, ignore_errors=True)
            self.etcd = None

    def record_failure(self, rank: int, code: int, *, pid: int | None, member: str = "", note: str = "") -> None:
        """Add a process failure to the summary printed when the launch fails."""
        cfg = self.config
        local = rank - cfg.node_rank * cfg.nproc_per_node
        log_dir = cfg.logs.log_dir
        self.failures.add(
            Failure(
                rank=rank,
                local_rank=local if 0 <= local < cfg.nproc_per_node and cfg.role == "worker" else None,
                pid=pid,
                code=code,
                time=time.time(),
                host=node_name(),
                member=member,
                log_file=os.path.join(log_dir, f"attempt_{self.restarts}", member or str(rank), "stderr.log")
                if log_dir
                else None,
                note=note,
            )
        )

    def run(self) -> int:
        """Run the node until its ranks finish; on a non-zero exit (not asked to stop) print the failures."""
        code = self._run()
        if code != 0 and self.stop_signal is None:
            for line in self.failures.render():
                self.log(line)
        return code

    def _run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            plan = self.config.rendezvous
            if plan.backend == "etcd" and not plan.endpoints:
                self._start_embedded_etcd()
            elif plan.backend == "etcd" and plan.tls.get("user") == ROOT_USER:
                self._provision_external_etcd()
            if plan.backend == "etcd" and plan.token and self.config.node_rank == 0 and self.config.role == "worker":
                self._announce_job()
            if self.endpoint.port >= 0:
                self._prepare_metrics()
            if self.config.trainmover:
                self._prepare_recordings()
                code = self._run_trainmover()
                if code is not None:
                    self.finished_ok = code == 0
                    return code
            else:
                self.start_ranks(self.config.start_method)
            self._serve_metrics()
            while True:
                failed, ok = self._wait()
                if ok:
                    self.log("all ranks finished")
                    self.finished_ok = True
                    return 0
                if failed is None:  # asked to stop
                    self.log(f"received {signal.Signals(self.stop_signal).name}; stopping ranks")
                    self.stop_ranks()
                    return 128 + self.stop_signal
                code = failed.returncode
                t_fail = time.time()
                self.events.append({"event": "failure", "t": t_fail, "rank": failed.rank, "code": code})
                self.record_failure(failed.rank, code, pid=failed.pid)
                self.log(f"rank {failed.rank} (pid {failed.pid}) failed with {describe_code(code)}; stopping all ranks")
                self.stop_ranks()
                if self.restarts >= self.config.max_restarts:
                    if self.config.max_restarts:
                        self.log(f"no restarts left (--max-restarts {self.config.max_restarts}); giving up")
                    return 128 - code if code < 0 else code
                self.restarts += 1
                self._count_restart()
                self.log(
                    f"restart {self.restarts}/{self.config.max_restarts}: all ranks start again and "
                    "resume from the latest checkpoint"
                )
                self.start_ranks(self.config.restart_start_method)
        finally:
            if any(p.poll() is None for p in self.procs):
                self.stop_ranks()
            self._stop_metrics(finished=self.finished_ok)
            self._stop_embedded_etcd()
            for sig, handler in old.items():
                signal.signal(sig, handler)
