"""Typed configuration of ``trainmover launch``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainmover_ext.control.records import RebalancePolicy, StragglerPolicy
from trainmover_ext.errors import ConfigError
from trainmover_ext.launch.heartbeat import DEFAULT_HANG_TIMEOUT_S
from trainmover_ext.launch.logs import LogConfig
from trainmover_ext.launch.rendezvous import RendezvousPlan

_TLS_FLAG = {"ca_cert": "ca", "client_cert": "cert", "client_key": "key", "user": "user", "password": "password"}


@dataclass(kw_only=True)
class LaunchConfig:
    """What the agent starts and how it reacts to failures."""

    script: str
    """Training script run in every rank (e.g. ``pretrain_gpt.py``)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed to the script unchanged."""
    nproc_per_node: int = 1
    """``--nproc-per-node``: ranks started on this node."""
    nnodes: int = 1
    """``--nnodes``: number of nodes in the job."""
    node_rank: int = 0
    """``--node-rank``: this node's index in ``[0, nnodes)``."""
    master_addr: str = "127.0.0.1"
    """``--master-addr``: address of the rendezvous host (node 0)."""
    master_port: int = 0
    """``--master-port``: rendezvous port; 0 picks a free port (single node only)."""
    max_restarts: int = 0
    """``--max-restarts``: stop-restart from the latest checkpoint up to this many times."""
    start_method: str = "fork"
    """``--start-method``: 'fork' forks ranks from this warm process; 'spawn' starts fresh interpreters."""
    restart_start_method: str = "spawn"
    """How restarted ranks start: fresh interpreters, as torchrun does (the baseline pays imports)."""
    term_timeout_s: float = 5.0
    """``--term-timeout``: grace between SIGTERM and SIGKILL when tearing ranks down."""
    monitor_interval_s: float = 0.05
    """How often the agent polls its children."""
    logs: LogConfig = field(default_factory=LogConfig)
    """``--log-dir``/``--redirects``/``--tee``: where each started process writes."""
    rendezvous: RendezvousPlan = field(default_factory=RendezvousPlan)
    """Where ranks meet (etcd by default; an embedded etcd is started when no endpoints are given)."""
    trainmover: bool = False
    """The script runs with ``--trainmover``: failed ranks are replaced by standbys instead of restarting."""
    standbys: int = 0
    """``--tm-standbys`` of the script: warm standbys the agent keeps."""
    lease_ttl_s: float = 2.0
    """``--tm-lease-ttl`` of the script: membership lease TTL (controller and agent use it too)."""
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """``--tm-hang-timeout`` of the script: a serving process frozen this long is fenced and reported by
    this agent (``launch.heartbeat``); 0: only its lease expiry tells."""
    progress_timeout_s: float | None = None
    """``--tm-progress-timeout`` of the script: a serving rank whose main thread stalled this long outside a
    collective is fenced and reported by this agent (``launch.stalls``); None: from its pace; 0: off."""
    straggler: StragglerPolicy = field(default_factory=StragglerPolicy)
    """``--tm-straggler-action/-threshold/-window`` of the script: the job's straggler policy, recorded by the
    first agent (``control.straggler_watch``)."""
    rebalance: RebalancePolicy = field(default_factory=RebalancePolicy)
    """``--tm-rebalance-interval`` of the script: scheduled rotation moves, recorded by the first agent that has one."""
    leaver_becomes_standby: bool = False
    """``--tm-leaver-becomes-standby`` of the script: a planned leaver stays alive as one of this agent's standbys."""
    standby_reserves: int = 4
    """``--tm-standby-reserves`` of the script: children forked at the start that later refill the pool."""
    standby_nice: int = 19
    """``--tm-standby-nice`` of the script: niceness of standbys until promotion (see ``launch.priority``)."""
    refill_nice: int = 19
    """``--tm-refill-nice`` of the script (``--tm-standby-nice``'s when not given): niceness of the standbys
    started while the job trains (refills, and the reserves that start them)."""
    sandbox: bool = True
    """Not ``--tm-no-sandbox`` in the script: it records, and standbys warm in the sandbox."""
    record_dir: str | None = None
    """``--tm-record-dir`` of the script; None: the agent passes ``<run dir>/recordings`` (with ``sandbox``)
    and sets this to it."""
    recordings_host: str | None = None
    """``--recordings-host``: where the agent of an active node serves its recordings to standbys on other
    nodes; None: the address this node reaches ``master_addr`` from."""
    recordings_port: int = 0
    """``--recordings-port``: the port of ``recordings_host``; 0 picks a free one."""
    etcd_tls: bool = False
    """``--tm-etcd-tls``: the embedded etcd serves TLS with client certificates from a job CA (``etcd.pki``)."""
    run_dir: str | None = None
    """``--run-dir``: the job's working directory (embedded etcd data, logs); default runs/<job>."""
    role: str = "worker"
    """``--tm-role``: ``worker`` starts this node's ranks; ``standby`` makes it a standby machine that
    joins a running job with one warm standby per slot (``--nproc-per-node`` slots), each ready to take
    a rank in its own slot's device, and a whole lost node into all of them."""

    def __post_init__(self) -> None:
        if self.role not in ("worker", "standby"):
            raise ConfigError("--tm-role must be 'worker' or 'standby'")
        if self.role == "standby":
            if not self.trainmover:
                raise ConfigError("--tm-role standby needs --trainmover in the script's arguments")
            if self.rendezvous.backend != "etcd" or not self.rendezvous.endpoints or not self.rendezvous.token:
                raise ConfigError(
                    "a standby machine (--tm-role standby) joins a running job: give that job's "
                    "--tm-etcd-endpoints, --tm-job and --tm-job-token (`trainmover status` shows them)"
                )
        if self.nproc_per_node < 1:
            raise ConfigError("--nproc-per-node must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("--node-rank must be in [0, --nnodes)")
        if self.hang_timeout_s < 0:
            raise ConfigError("--tm-hang-timeout must be >= 0 seconds (0 leaves hangs to the lease TTL)")
        if self.progress_timeout_s is not None and self.progress_timeout_s < 0:
            raise ConfigError("--tm-progress-timeout must be >= 0 seconds (0 turns the progress watchdog off)")
        if self.standby_reserves < 0:
            raise ConfigError("--tm-standby-reserves must be >= 0")
        if self.standbys and not self.trainmover:
            raise ConfigError("--tm-standbys needs --trainmover in the script's arguments")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")
        if self.start_method not in ("fork", "spawn"):
            raise ConfigError("--start-method must be 'fork' or 'spawn'")
        if self.restart_start_method not in ("fork", "spawn"):
            raise ConfigError("--restart-start-method must be 'fork' or 'spawn'")
        if not 0 <= self.recordings_port <= 65535:
            raise ConfigError(
                f"--recordings-port must be a TCP port (0-65535; 0 picks a free one), not {self.recordings_port}"
            )
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("--master-port is required with --nnodes > 1")
        if self.etcd_tls and (self.rendezvous.endpoints or self.rendezvous.backend != "etcd"):
            raise ConfigError(
                "--tm-etcd-tls secures the embedded etcd; an external etcd brings its own certificates: "
                "pass --tm-etcd-ca/--tm-etcd-cert/--tm-etcd-key instead"
            )
        external = [name for name, value in self.rendezvous.tls.items() if value]
        if external and not self.rendezvous.endpoints:
            flags = ", ".join(f"--tm-etcd-{_TLS_FLAG[name]}" for name in external)
            raise ConfigError(
                f"{flags} log in to an external etcd: give its --tm-etcd-endpoints too (the embedded etcd the "
                "launcher starts makes its own credentials; --tm-etcd-tls serves it over TLS)"
            )
        if self.rendezvous.backend == "etcd" and not self.rendezvous.endpoints and self.nnodes > 1:
            raise ConfigError(
                "a multi-node job needs a shared etcd: pass --tm-etcd-endpoints (e.g. started on the first node "
                "by scripts/slurm/trainmover.sbatch), or --rdzv-backend tcp"
            )
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script {self.script} does not exist")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node
