"""TrainMover's flags and their typed config.

``add_trainmover_args`` is the one ``extra_args_provider`` that adds every
``--trainmover``/``--tm-*`` flag to ``pretrain_gpt.py``; ``TrainMoverConfig``
is the typed view the runtime uses. A flag whose capability is not built yet
is declared so that ``--help`` shows the whole surface, but setting it raises
:class:`ConfigError` instead of silently doing nothing (see ``NOT_WIRED``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from trainmover_ext.control.records import STRAGGLER_ACTIONS, RebalancePolicy, StragglerPolicy
from trainmover_ext.control.stragglers import StragglerConfig
from trainmover_ext.errors import ConfigError
from trainmover_ext.launch.heartbeat import DEFAULT_HANG_TIMEOUT_S

KEEP_ROLES = ("first", "middle", "last", "none")

# flag attribute -> why it cannot be used yet. Remove an entry when wiring it.
NOT_WIRED: dict[str, str] = {}


@dataclass(kw_only=True)
class TrainMoverConfig:
    """Typed view of the ``--trainmover`` / ``--tm-*`` flags."""

    enabled: bool = False
    """``--trainmover``: run under the TrainMover runtime."""
    role: str = "worker"
    """``--tm-role``: ``worker`` trains a rank; ``standby`` warms up and waits to be promoted."""
    job: str = "trainmover"
    """``--tm-job``: job name; namespaces every etcd key under ``/trainmover/<job>/``."""
    job_token: str | None = None
    """``--tm-job-token``: shared secret gating writes to the job's keys (generated when absent)."""
    etcd_endpoints: list[str] = field(default_factory=list)
    """``--tm-etcd-endpoints``: external etcd cluster; empty starts an embedded one."""
    etcd_ca: str | None = None
    """``--tm-etcd-ca``: CA certificate for TLS to etcd."""
    etcd_cert: str | None = None
    """``--tm-etcd-cert``: client certificate for TLS to etcd."""
    etcd_key: str | None = None
    """``--tm-etcd-key``: client key for TLS to etcd."""
    etcd_user: str | None = None
    """``--tm-etcd-user``: etcd user for password auth."""
    etcd_password: str | None = None
    """``--tm-etcd-password``: etcd password for password auth."""
    lease_ttl_s: float = 2.0
    """``--tm-lease-ttl``: membership lease TTL in seconds; refreshed every TTL/3."""
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """``--tm-hang-timeout``: the agent fences and reports a rank whose heartbeat is this old and whose
    process used no CPU time meanwhile (frozen), without waiting for its lease; 0 turns this off
    (``trainmover_ext.launch.heartbeat``)."""
    progress_timeout_s: float | None = None
    """``--tm-progress-timeout``: the agent fences and reports a rank whose main thread made no progress
    for this long outside a collective; None: a bound from the rank's own pace; 0 turns it off
    (``trainmover_ext.launch.stalls``)."""
    standbys: int = 0
    """``--tm-standbys``: number of warm standbys the launcher keeps."""
    record_iters: int = 2
    """``--tm-record-iters``: iterations whose collectives are recorded for the sandbox."""
    record_dir: str | None = None
    """``--tm-record-dir``: directory for recorded collective tensors: the job records its first
    ``record_iters`` iterations there and standbys warm from them in the sandbox; a standby whose directory
    lacks them (another node's) copies them from the recording node's agent. ``trainmover launch``
    passes ``<run dir>/recordings`` when the script has none (unless ``--tm-no-sandbox``)."""
    sandbox: bool = True
    """``--tm-no-sandbox`` sets it False: nothing is recorded and standbys do only the basic warm-up."""
    record_timeout_s: float = 300.0
    """``--tm-record-timeout``: seconds a standby waits for the job's recordings before it falls back to
    the basic warm-up (and says so); copying them from another node has as long again."""
    fingerprint_timeout_s: float = 600.0
    """``--tm-fingerprint-timeout``: seconds a standby waits for the job's model fingerprint (published by
    its first worker once the model is built) before it gives up; it advertises no warm role before."""
    compile: bool = False
    """``--tm-compile``: wrap the model in ``torch.compile``."""
    keep_role: str = "last"
    """``--tm-keep-role``: the pipeline role whose model a sandbox standby keeps after warming (``first``,
    ``middle``, ``last`` or ``none``); promoted into that role's recorded rank it adopts the model."""
    standby_duty: float = 1.0
    """``--tm-standby-duty``: the share of one core a warming standby may use (``1`` = unpaced); it pauses
    between shadow iterations to stay within it (``trainmover_ext.sandbox.pacing``)."""
    standby_reserves: int = 4
    """``--tm-standby-reserves``: children the launcher forks at the start to refill the standby pool later."""
    standby_nice: int = 19
    """``--tm-standby-nice``: how much lower a standby's CPU priority is until its promotion (0: not lowered)."""
    refill_nice: int | None = None
    """``--tm-refill-nice``: the same for a standby started while the job trains (a refill of the pool, or a
    leaver rejoining it); None: ``standby_nice``."""
    leaver_becomes_standby: bool = False
    """``--tm-leaver-becomes-standby``: a planned leaver rejoins the pool instead of exiting."""
    metrics_file: str | None = None
    """``--tm-metrics-file``: append one JSON line per iteration (loss, timings, consumed samples)."""
    inject_fault: str | None = None
    """``--tm-inject-fault RANK:ITER:PHASE[:KILL|STOP]``: failure drill (see trainmover_ext.runtime.faults)."""
    optimizer_mirror: bool = True
    """``--tm-optimizer-mirror on|off``: with ``--use-distributed-optimizer`` under ``--trainmover``, every
    rank's optimizer shard is copied after each step into a data-parallel peer's host memory, and a lost
    rank takes its shard from there (:mod:`trainmover_ext.migration.mirror`); off: from the checkpoint."""
    inject_slowdown: str | None = None
    """``--tm-inject-slowdown RANK:FACTOR[:FROM]``: straggler drill (see trainmover_ext.runtime.slowdown)."""
    inject_link_delay: str | None = None
    """``--tm-inject-link-delay A:B:SECONDS[:FROM]``: slow-link drill (see trainmover_ext.runtime.slowdown)."""
    straggler_action: str = StragglerPolicy.action
    """``--tm-straggler-action``: what the controller does with a rank whose compute time stays above its
    peers' (``trainmover_ext.control.straggler_watch``): ``report`` it, ``migrate`` it to a warm standby
    and quarantine its slot, or ``off``. The job's policy; ``trainmover straggler`` changes it at run time."""
    straggler_threshold: float = StragglerPolicy.threshold
    """``--tm-straggler-threshold``: slow means this many times the median compute time of the rank's peers."""
    straggler_window: int = StragglerPolicy.window
    """``--tm-straggler-window``: consecutive slow iterations that make a straggler."""
    rebalance_interval_min: float = 0.0
    """``--tm-rebalance-interval``: minutes between scheduled planned moves (``trainmover_ext.control.rebalance``);
    0: none."""
    comm: str = "auto"
    """``--tm-comm``: ``nccl_delta`` (every group's native communicator replaceable live), ``native``
    (torch's groups as they are), or
    ``auto`` (nccl_delta under ``--trainmover``, native otherwise)."""

    @property
    def use_delta_comm(self) -> bool:
        return self.comm == "nccl_delta" or (self.comm == "auto" and self.enabled)

    def __post_init__(self) -> None:
        if self.comm not in ("auto", "nccl_delta", "native"):
            raise ConfigError("--tm-comm must be auto, nccl_delta or native")
        if self.inject_fault:
            from trainmover_ext.runtime.faults import FaultSpec

            FaultSpec.parse_all(self.inject_fault)
        if self.inject_slowdown:
            from trainmover_ext.runtime.slowdown import Slowdown

            Slowdown.parse(self.inject_slowdown)
        if self.inject_link_delay:
            from trainmover_ext.runtime.slowdown import LinkDelay

            LinkDelay.parse(self.inject_link_delay)
        StragglerPolicy(
            action=self.straggler_action, threshold=self.straggler_threshold, window=self.straggler_window
        ).check()
        RebalancePolicy(interval_s=self.rebalance_interval_min * 60).check()
        if self.role not in ("worker", "standby"):
            raise ConfigError("--tm-role must be 'worker' or 'standby'")
        if self.lease_ttl_s <= 0:
            raise ConfigError("--tm-lease-ttl must be positive")
        if self.hang_timeout_s < 0:
            raise ConfigError("--tm-hang-timeout must be >= 0 seconds (0 leaves hangs to the lease TTL)")
        if self.progress_timeout_s is not None and self.progress_timeout_s < 0:
            raise ConfigError("--tm-progress-timeout must be >= 0 seconds (0 turns the progress watchdog off)")
        if self.standbys < 0:
            raise ConfigError("--tm-standbys must be >= 0")
        if self.leaver_becomes_standby and not self.enabled:
            raise ConfigError("--tm-leaver-becomes-standby needs --trainmover (a leaver exists only under it)")
        if self.record_iters < 1:
            raise ConfigError("--tm-record-iters must be >= 1")
        if self.record_timeout_s <= 0:
            raise ConfigError("--tm-record-timeout must be positive (seconds a standby waits for recordings)")
        if self.fingerprint_timeout_s <= 0:
            raise ConfigError(
                "--tm-fingerprint-timeout must be positive (seconds a standby waits for the job's model fingerprint)"
            )
        if self.keep_role not in KEEP_ROLES:
            raise ConfigError(f"--tm-keep-role must be one of {', '.join(KEEP_ROLES)}")
        if self.standby_reserves < 0:
            raise ConfigError(
                f"--tm-standby-reserves {self.standby_reserves} must be >= 0 (0: refills start a new interpreter)"
            )
        if not 0 <= self.standby_nice <= 19:
            raise ConfigError(f"--tm-standby-nice {self.standby_nice} must be in 0..19 (a niceness)")
        if self.refill_nice is not None and not 0 <= self.refill_nice <= 19:
            raise ConfigError(f"--tm-refill-nice {self.refill_nice} must be in 0..19 (a niceness)")
        if not 0 < self.standby_duty <= 1:
            raise ConfigError(
                f"--tm-standby-duty {self.standby_duty} must be in (0, 1]: the share of one core a "
                "warming standby may use (e.g. 0.25)"
            )
        if not self.sandbox and self.record_dir is not None:
            raise ConfigError("--tm-no-sandbox and --tm-record-dir contradict each other: drop one")
        if self.record_dir is not None and not self.record_dir.strip():
            raise ConfigError("--tm-record-dir must name a directory")
        if any(getattr(self, name) for name in ("etcd_cert", "etcd_key")) and not (self.etcd_cert and self.etcd_key):
            raise ConfigError("--tm-etcd-cert and --tm-etcd-key must be given together")


_FLAG_TO_FIELD = {
    "trainmover": "enabled",
    "tm_role": "role",
    "tm_job": "job",
    "tm_job_token": "job_token",
    "tm_etcd_endpoints": "etcd_endpoints",
    "tm_etcd_ca": "etcd_ca",
    "tm_etcd_cert": "etcd_cert",
    "tm_etcd_key": "etcd_key",
    "tm_etcd_user": "etcd_user",
    "tm_etcd_password": "etcd_password",
    "tm_lease_ttl": "lease_ttl_s",
    "tm_hang_timeout": "hang_timeout_s",
    "tm_progress_timeout": "progress_timeout_s",
    "tm_standbys": "standbys",
    "tm_record_iters": "record_iters",
    "tm_record_dir": "record_dir",
    "tm_no_sandbox": "sandbox",
    "tm_record_timeout": "record_timeout_s",
    "tm_fingerprint_timeout": "fingerprint_timeout_s",
    "tm_compile": "compile",
    "tm_keep_role": "keep_role",
    "tm_standby_duty": "standby_duty",
    "tm_standby_nice": "standby_nice",
    "tm_refill_nice": "refill_nice",
    "tm_standby_reserves": "standby_reserves",
    "tm_leaver_becomes_standby": "leaver_becomes_standby",
    "tm_metrics_file": "metrics_file",
    "tm_comm": "comm",
    "tm_optimizer_mirror": "optimizer_mirror",
    "tm_inject_fault": "inject_fault",
    "tm_inject_slowdown": "inject_slowdown",
    "tm_inject_link_delay": "inject_link_delay",
    "tm_straggler_action": "straggler_action",
    "tm_straggler_threshold": "straggler_threshold",
    "tm_straggler_window": "straggler_window",
    "tm_rebalance_interval": "rebalance_interval_min",
}


_FOR_THE_AGENT = " Read by the agents of `trainmover launch`; needs --trainmover."

_FOR_THE_LAUNCHER = (
    " Read by `trainmover launch` (before or after the script), which gives it to every process it starts; "
    "needs --trainmover."
)

CONNECTION_FLAGS = {
    "tm_job": ("TRAINMOVER_JOB", "job"),
    "tm_job_token": ("TRAINMOVER_JOB_TOKEN", "job_token"),
    "tm_etcd_endpoints": ("TRAINMOVER_ETCD_ENDPOINTS", "etcd_endpoints"),
    "tm_etcd_ca": ("TRAINMOVER_ETCD_CA", "etcd_ca"),
    "tm_etcd_cert": ("TRAINMOVER_ETCD_CERT", "etcd_cert"),
    "tm_etcd_key": ("TRAINMOVER_ETCD_KEY", "etcd_key"),
    "tm_etcd_user": ("TRAINMOVER_ETCD_USER", "etcd_user"),
}
"""The job and etcd flags a rank gets from its launcher's environment (``launch.rendezvous``), by the
variable that carries each. ``--tm-etcd-password`` is not compared: an external etcd's root login stays
with the launcher, which hands the ranks the job's own login instead."""


def endpoint_list(text: str) -> list[str]:
    """``--tm-etcd-endpoints HOST:PORT,HOST:PORT`` -> a list (the syntax of every ``trainmover`` command)."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise argparse.ArgumentTypeError("give HOST:PORT, or several separated by commas")
    return endpoints


def check_connection_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """A rank's job and etcd flags must name what its launcher connected it to.

    ``trainmover launch`` takes these flags on either side of the script and hands them to its ranks in the
    environment; a rank that still sees one in its own arguments was started some other way. Raises
    :class:`ConfigError` when such a flag disagrees with the launcher's environment, or is given where no
    launcher reads it (without ``--trainmover``)."""
    for flag, (var, _) in CONNECTION_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        name = "--" + flag.replace("_", "-")
        if not getattr(args, "trainmover", None):
            raise ConfigError(f"{name} names a TrainMover job: add --trainmover, or drop {name}")
        shown = ",".join(value) if isinstance(value, list) else str(value)
        if var in environ and environ[var] != shown:
            raise ConfigError(
                f"{name} {shown if flag != 'tm_job_token' else '(given)'} differs from what this process's "
                f"launcher connected it to: give {name} once, to `trainmover launch` (before or after the script)"
            )


def on_off(text: str) -> bool:
    """``on`` / ``off`` -> True / False (a flag's argparse type)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"give on or off, not {text!r}")
    return text == "on"


def add_trainmover_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``extra_args_provider`` adding every TrainMover flag (defaults are ``None``
    so that :func:`config_from_args` can tell a flag that was given)."""
    g = parser.add_argument_group("trainmover", "Resilient runtime: warm standbys, delta communicator, live migration.")
    g.add_argument("--trainmover", action="store_true", default=None, help="Run under the TrainMover runtime.")
    g.add_argument(
        "--tm-role",
        choices=["worker", "standby"],
        default=None,
        help="'worker' trains a rank; 'standby' warms up in a sandbox and waits to be promoted.",
    )
    g.add_argument(
        "--tm-job",
        default=None,
        help="Job name; namespaces the job's etcd keys (default 'trainmover')." + _FOR_THE_LAUNCHER,
    )
    g.add_argument(
        "--tm-job-token",
        default=None,
        help="Shared secret for the job's etcd keys (default: generated by the launcher)." + _FOR_THE_LAUNCHER,
    )
    g.add_argument(
        "--tm-etcd-endpoints",
        type=endpoint_list,
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="External etcd endpoints, comma-separated; without it the launcher starts an embedded etcd."
        + _FOR_THE_LAUNCHER,
    )
    g.add_argument("--tm-etcd-ca", default=None, help="CA certificate file for TLS to etcd." + _FOR_THE_LAUNCHER)
    g.add_argument("--tm-etcd-cert", default=None, help="Client certificate file for TLS to etcd." + _FOR_THE_LAUNCHER)
    g.add_argument("--tm-etcd-key", default=None, help="Client private key file for TLS to etcd." + _FOR_THE_LAUNCHER)
    g.add_argument(
        "--tm-etcd-user", default=None, help="etcd user name for password authentication." + _FOR_THE_LAUNCHER
    )
    g.add_argument(
        "--tm-etcd-password", default=None, help="etcd password for password authentication." + _FOR_THE_LAUNCHER
    )
    g.add_argument(
        "--tm-lease-ttl",
        type=float,
        default=None,
        help="Membership lease TTL in seconds (default 2). A lapsed lease is evidence, not proof: a rank whose "
        "lease lapsed while its node's agent lives is replaced only if it has not registered again within two "
        "TTLs and a second (its agent reports a dead, frozen or stalled rank at once), and while the "
        "controller's own lease lapsed that recently (etcd stalled) no lapse replaces anyone; a whole lost "
        "node is replaced at once.",
    )
    g.add_argument(
        "--tm-hang-timeout",
        type=float,
        default=None,
        help=f"Seconds (default {DEFAULT_HANG_TIMEOUT_S:g}) after which the launcher's agent kills and reports a "
        "rank whose process is frozen: its heartbeat thread has not beaten for this long and the process "
        "used no CPU time meanwhile, nor waited for a CPU or a disk (e.g. SIGSTOP). Faster than the lease "
        "TTL, which still covers every "
        "other hang. 0 turns it off (e.g. while a debugger holds a rank stopped).",
    )
    g.add_argument(
        "--tm-progress-timeout",
        type=float,
        default=None,
        help="Seconds after which the launcher's agent kills and reports a rank whose main thread made no "
        "progress outside a collective (a deadlock, a stuck data loader or kernel) while its process lives; "
        "ranks waiting in a collective for it are left alone. Default: 4 of the rank's recent iterations, "
        "at least 2.5 s, not during saves, evaluations, recoveries or the first iterations. 0 turns it off.",
    )
    g.add_argument("--tm-standbys", type=int, default=None, help="Number of warm standbys to keep (default 0).")
    g.add_argument(
        "--tm-record-iters",
        type=int,
        default=None,
        help="Iterations whose collectives are recorded for standby warm-up (default 2).",
    )
    g.add_argument(
        "--tm-record-dir",
        default=None,
        help="Directory where the job records its first --tm-record-iters iterations' collective results; "
        "standbys warm every pipeline role from them in the sandbox. Under `trainmover launch` it need not "
        "be shared: a standby on another node copies them from the recording node's agent (job token "
        "required). Default under `trainmover launch`: <run dir>/recordings. Without it (and without the "
        "launcher) standbys do the basic warm-up and say why.",
    )
    g.add_argument(
        "--tm-no-sandbox",
        action="store_false",
        default=None,
        help="Record nothing; standbys do only the basic warm-up (data index and one layer's kernels), "
        "which leaves the ranks' cores alone but makes a promoted standby's first iterations colder.",
    )
    g.add_argument(
        "--tm-record-timeout",
        type=float,
        default=None,
        help="Seconds a standby waits for the job's recordings before the basic warm-up (default 300); "
        "copying them from another node may take as long again.",
    )
    g.add_argument(
        "--tm-fingerprint-timeout",
        type=float,
        default=None,
        help="Seconds a standby waits for the job's model fingerprint before it gives up (default 600). "
        "It compares the fingerprint with its own before it advertises any warm role; a standby "
        "whose model, precision, layout, optimizer or batch flags differ is refused (exit 78).",
    )
    g.add_argument("--tm-compile", action="store_true", default=None, help="Wrap the model in torch.compile.")
    g.add_argument(
        "--tm-keep-role",
        choices=KEEP_ROLES,
        default=None,
        help="Pipeline role whose model a sandbox standby keeps after its warm-up (default last; it is "
        "warmed last, so memory stays one role's). Promoted into the rank that role was recorded "
        "at (TP and DP rank 0 of its stage), the standby adopts that model instead of building "
        "one; 'none' keeps no model.",
    )
    g.add_argument(
        "--tm-standby-nice",
        type=int,
        default=None,
        metavar="N",
        help="How much lower (a niceness, 0..19; default 19) a standby's CPU priority is from its "
        "start until its promotion, so that starting and warming a standby (the pool is refilled "
        "after every promotion) does not take the ranks' cores; a lowered standby also runs under "
        "Linux's idle scheduling policy (SCHED_IDLE), so a rank that wakes preempts it at once. "
        "Applied only where a promoted standby can raise its priority back (root, CAP_SYS_NICE or "
        "RLIMIT_NICE >= 20); the launcher says when it cannot. 0 turns it off.",
    )
    g.add_argument(
        "--tm-refill-nice",
        type=int,
        default=None,
        metavar="N",
        help="The niceness (0..19; default: --tm-standby-nice's) of a standby started while the job trains: "
        "a refill of the pool after a promotion, or a leaver that rejoins it. The first standbys warm up "
        "while the job starts; a refill warms up beside ranks that train, on their cores where the "
        "node has few. E.g. --tm-standby-nice 0 --tm-refill-nice 19: the first standby is warm soon, "
        "later ones never slow the ranks.",
    )
    g.add_argument(
        "--tm-standby-reserves",
        type=int,
        default=None,
        metavar="N",
        help="Children the launcher forks at the start, while forking is safe, to refill the standby "
        "pool later (default 4; 0: none). A refill then wakes one instead of starting a new "
        "interpreter, which would take seconds of CPU (importing torch and megatron-core) from "
        "the ranks right after a promotion. Each sleeps until used and shares the launcher's "
        "memory pages; once all are used, refills start new interpreters.",
    )
    g.add_argument(
        "--tm-standby-duty",
        type=float,
        default=None,
        metavar="FRACTION",
        help="Share of one CPU core a warming standby may use, in (0, 1] (default 1: unpaced). Below 1 "
        "it pauses between shadow iterations and roles so that its CPU time stays within that "
        "share of the wall time: on a node whose cores the ranks keep busy, e.g. 0.25 keeps its "
        "warm-up from slowing the job (the warm-up takes about 1/FRACTION as long). Pausing "
        "ends at promotion.",
    )
    g.add_argument(
        "--tm-leaver-becomes-standby",
        action="store_true",
        default=None,
        help="After a planned migration the leaver (its state handed over, its groups torn down) stays "
        "alive and rejoins the standby pool in the same process, instead of exiting; its agent "
        "then starts no new standby for the one the move consumed.",
    )
    g.add_argument(
        "--tm-comm",
        choices=["auto", "nccl_delta", "native"],
        default=None,
        help="Communicator for every process group: nccl_delta (torch's own gloo/NCCL groups whose "
        "communicators are replaced live, one group at a time; the default under --trainmover) or native "
        "(plain torch groups, no live replacement; the default without --trainmover).",
    )
    g.add_argument(
        "--tm-optimizer-mirror",
        type=on_off,
        default=None,
        metavar="on|off",
        help="With --use-distributed-optimizer: copy each rank's optimizer shard (main parameters, Adam "
        "moments, step, settings) after every step into the host memory of a data-parallel peer on another "
        "node where there is one, so a lost rank is replaced from that copy with no rollback to the "
        "checkpoint (default on; costs the holder twice the shard in host memory and the shard's bytes "
        "in traffic per step). off: a lost shard comes from the latest checkpoint.",
    )
    g.add_argument(
        "--tm-inject-fault",
        default=None,
        metavar="RANK:ITER:PHASE[:KILL|STOP]",
        help="Failure drill: the worker serving RANK sends itself SIGKILL (or SIGSTOP) during "
        "iteration ITER in PHASE: forward, backward, allreduce (the gradient reduction), clip "
        "(before the optimizer step's gradient-norm all-reduce: the replicas end one step apart), "
        "step (inside the optimizer step), log (after the step, before the metrics record), or save "
        "(during the checkpoint save after ITER steps). Migration drills name an epoch instead of "
        "ITER: join (the standby promoted into RANK dies while joining), recover (RANK dies in that "
        "epoch's recovery), send (RANK dies while sending its state), prepare / handover (the "
        "planned leaver dies in phase 1 / while handing over). Comma-separate several drills.",
    )
    g.add_argument(
        "--tm-inject-slowdown",
        default=None,
        metavar="RANK:FACTOR[:FROM]",
        help="Straggler drill: the worker serving RANK computes FACTOR times slower from iteration FROM "
        "(default 1) on: it sleeps FACTOR-1 times its compute time at the end of each iteration, so its peers "
        "wait for it; the numerics do not change. A standby that takes the rank over is not slowed.",
    )
    g.add_argument(
        "--tm-inject-link-delay",
        default=None,
        metavar="A:B:SECONDS[:FROM]",
        help="Slow-link drill: from iteration FROM (default 1) on, every wait of rank A's or rank B's worker in a "
        "point-to-point op with the other ends SECONDS later, as over a slow network path between them; their "
        "compute and the numerics do not change. The straggler watch reports the pair (trainmover status).",
    )
    g.add_argument(
        "--tm-straggler-action",
        choices=STRAGGLER_ACTIONS,
        default=None,
        help="What the controller does with a straggler, a rank whose compute time (forward, backward and step, "
        "without waits in collectives) stays --tm-straggler-threshold times its peers' median (the ranks of "
        "the same pipeline role) for --tm-straggler-window iterations: report (the default) logs it, records "
        "it in `trainmover status` and on the timeline; migrate also moves it to a warm standby with a planned "
        "move and quarantines its slot (no standby there is promoted until `trainmover quarantine --clear`); "
        "off judges nothing. Needs the agent's heartbeat files (--tm-hang-timeout above 0). The job's first "
        "agent records it; `trainmover straggler --action ...` changes it while the job runs." + _FOR_THE_AGENT,
    )
    g.add_argument(
        "--tm-straggler-threshold",
        type=float,
        default=None,
        help="A rank is slow in an iteration when its compute time is at least this many times its peers' "
        f"median (default {StragglerPolicy.threshold:g}, must be > 1)." + _FOR_THE_AGENT,
    )
    g.add_argument(
        "--tm-straggler-window",
        type=int,
        default=None,
        help=f"Consecutive slow iterations that make a straggler (default {StragglerPolicy.window}). A rank's pace "
        f"in an iteration is the mean of its last {StragglerConfig.smooth} compute times less their highest "
        f"{StragglerConfig.trim}, so one spike (a garbage collection) makes no slow iteration. A rank's first "
        f"{StragglerConfig.settle} iterations after it joins are not counted, nor are saves and evaluations (they "
        "are outside the measured compute)." + _FOR_THE_AGENT,
    )
    g.add_argument(
        "--tm-rebalance-interval",
        type=float,
        default=None,
        metavar="MIN",
        help="Minutes between scheduled planned moves that rotate the job's members through the standby pool "
        "(e.g. to cycle machines through maintenance): each moves the rank served longest to an idle warm "
        "standby, one at a time and never during a recovery. Default 0: none. `trainmover rebalance` changes it "
        "while the job runs, or asks for one move now." + _FOR_THE_AGENT,
    )
    g.add_argument(
        "--tm-log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=None,
        help="Python logging level of this process (default: env TRAINMOVER_LOG_LEVEL, else WARNING); "
        "lines are prefixed with the process (rank R / standby ID).",
    )
    g.add_argument(
        "--tm-log-json",
        action="store_true",
        default=None,
        help="Log JSON lines (t, level, process, logger, msg) instead of text (env TRAINMOVER_LOG_JSON=1).",
    )
    g.add_argument(
        "--tm-metrics-file",
        default=None,
        help="Append one JSON line per iteration (iteration, loss, ms, consumed samples) to this file.",
    )
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> TrainMoverConfig:
    """Build the typed config; raises :class:`ConfigError` for a flag that is not wired yet, and for a job or
    etcd flag that disagrees with the launcher (:func:`check_connection_flags`; ``environ`` defaults to
    ``os.environ``)."""
    check_connection_flags(args, os.environ if environ is None else environ)
    given = {}
    for flag, name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            if flag in NOT_WIRED:
                raise ConfigError(
                    f"--{flag.replace('_', '-')} is declared but not available in this build: "
                    f"{NOT_WIRED[flag]}. Remove the flag."
                )
            given[name] = value
    valid = {f.name for f in fields(TrainMoverConfig)}
    return TrainMoverConfig(**{k: v for k, v in given.items() if k in valid})
