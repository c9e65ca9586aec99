"""``trainmover launch``: the torchrun-like entry point."""

from __future__ import annotations

import argparse
import os

from trainmover_ext.control.cli import add_connection_flags
from trainmover_ext.control.records import RebalancePolicy, StragglerPolicy
from trainmover_ext.errors import ConfigError
from trainmover_ext.kv.job import new_token
from trainmover_ext.launch.agent import Agent, MetricsEndpoint
from trainmover_ext.launch.config import LaunchConfig
from trainmover_ext.launch.heartbeat import DEFAULT_HANG_TIMEOUT_S
from trainmover_ext.launch.logs import LogConfig, parse_std_spec
from trainmover_ext.launch.rendezvous import RendezvousPlan


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="Start and supervise this node's ranks (like torchrun).",
        description="Start --nproc-per-node ranks of a training script on this node and supervise them. "
        "Example: trainmover launch --nproc-per-node 8 pretrain_gpt.py --mock-data ... --trainmover. "
        "The script's own --trainmover/--tm-* flags may also stand before the script, and the job and etcd "
        "flags below after it: either way they reach the launcher and the ranks (a flag given twice with "
        "two values is refused).",
        allow_abbrev=False,  # an abbreviated launch flag would be mistaken for the script
    )
    # torchrun's spellings are accepted too (--nproc_per_node ...), so that a launch script written for
    # torchrun runs with `torchrun` replaced by `trainmover launch`.
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N|gpu|cpu|auto",
        help="Ranks to start on this node: a number, 'gpu' (one per visible GPU), 'cpu' (one per "
        "core) or 'auto' (gpu when CUDA is present, else cpu).",
    )
    parser.add_argument(
        "--nnodes",
        default="1",
        metavar="N",
        help="Number of nodes in the job (torchrun's MIN:MAX form is accepted when MIN = MAX).",
    )
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        help="This node's index in [0, nnodes): 0 on the --master-addr node. Required with --nnodes > 1 (a node "
        "without it would claim rank 0); ignored with --tm-role standby.",
    )
    parser.add_argument(
        "--tm-role",
        choices=("worker", "standby"),
        default="worker",
        help="worker (default): start this node's ranks. standby: make this node a standby machine of a "
        "running job: one warm standby per slot (--nproc-per-node slots; give the job's --nnodes and the "
        "same --nproc-per-node as its nodes), which takes a failed rank in a free slot, or every rank of "
        "a lost node in the same slots. Needs the job's --tm-etcd-endpoints, --tm-job and --tm-job-token; "
        "--node-rank is ignored.",
    )
    parser.add_argument(
        "--master-addr", "--master_addr", default="127.0.0.1", help="Rendezvous host (node 0's address)."
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=0,
        help="Rendezvous port (default: a free port; required with --nnodes > 1).",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's single-node mode: one node, a local rendezvous on a free port.",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help="torchrun's rendezvous endpoint: the same as --master-addr HOST --master-port PORT.",
    )
    parser.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default=None,
        help="torchrun's job id: names the job (--tm-job) unless --tm-job is given.",
    )
    parser.add_argument(
        "--log-dir",
        "--log_dir",
        default=None,
        help="Write each started process's stdout and stderr to LOG_DIR/attempt_<restart>/<rank or "
        "standby id>/{stdout,stderr}.log (the console still shows them unless --redirects).",
    )
    parser.add_argument(
        "--redirects",
        "-r",
        default=None,
        metavar="0-3|LOCAL:0-3,...",
        help="With --log-dir, send these streams to the files only: 0 none, 1 stdout, 2 stderr, "
        "3 both; e.g. 3, or 0:3,1:2 per local rank.",
    )
    parser.add_argument(
        "--tee",
        "-t",
        default=None,
        metavar="0-3|LOCAL:0-3,...",
        help="With --log-dir, send these streams to the files and the console (same values as --redirects).",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="On a rank failure, restart all ranks from the latest checkpoint up to K times "
        "(the classic stop-restart baseline). 0 = fail the job.",
    )
    parser.add_argument(
        "--start-method",
        choices=["fork", "spawn"],
        default="fork",
        help="'fork' forks ranks from this already-warm process (fast start on few cores); "
        "'spawn' starts fresh interpreters. Restarts spawn unless --restart-start-method fork.",
    )
    parser.add_argument(
        "--restart-start-method",
        choices=["spawn", "fork"],
        default="spawn",
        help="How --max-restarts starts ranks again: 'spawn' (default) fresh interpreters, as a "
        "real stop-restart pays; 'fork' from this warm process (a lower bound for benchmarks).",
    )
    parser.add_argument(
        "--term-timeout", type=float, default=5.0, help="Seconds between SIGTERM and SIGKILL when stopping ranks."
    )
    parser.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.05,
        metavar="SECONDS",
        help="How often the agent polls its processes for an exit (default 0.05; torchrun's is 0.1).",
    )
    parser.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        metavar="LOCAL,...",
        help="Show only these local ranks' output on the console, e.g. 0 or 0,3 (log files under --log-dir "
        "still get every rank's).",
    )
    parser.add_argument(
        "--local-addr",
        "--local_addr",
        default=None,
        metavar="HOST",
        help="torchrun's address of this node: used as --recordings-host when that is not given.",
    )
    # torchrun flags with no counterpart here: declared so that --help says why, refused when given.
    parser.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="Refused: torchrun's rendezvous options have no counterpart; etcd is named with "
        "--tm-etcd-endpoints and the membership timeouts follow the script's --tm-lease-ttl.",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="Refused: the script must be a file (its path), since ranks and standbys run it by path; e.g. "
        "pass pretrain_gpt.py rather than -m pretrain_gpt.",
    )
    parser.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="Refused: the agent forks its ranks from its own warm Python process (or starts `python "
        "SCRIPT`), so the script must be a Python file; set the environment in the shell that runs "
        "`trainmover launch` instead of in a wrapper.",
    )
    parser.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        choices=["etcd", "tcp", "c10d", "static"],
        default="etcd",
        help="Rendezvous store: 'etcd' (default; no rank hosts a store the job depends on) or "
        "'tcp' (torch's TCPStore on rank 0, a single point of failure; torchrun's 'c10d' and "
        "'static' mean the same here).",
    )
    parser.add_argument(
        "--tm-etcd-tls",
        action="store_true",
        help="Serve the embedded etcd over TLS with client certificates: a CA made for this job "
        "signs the server and member certificates (in <run dir>/etcd-tls, keys mode 600), and a "
        "client without the member certificate cannot connect. For an external etcd use "
        "--tm-etcd-ca/--tm-etcd-cert/--tm-etcd-key instead.",
    )
    parser.add_argument(
        "--run-dir", default=None, help="Job directory for the embedded etcd's data and logs (default runs/<job>)."
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Serve this agent's Prometheus /metrics on this port (0, the default: a free port; "
        "-1: none). The URL is printed at start. Series: iteration, tokens/s, iteration time "
        "(tailed from the workers' --tm-metrics-file, which the agent adds under --trainmover), "
        "members, standbys ready, epoch, migrations by kind, migration phase and downtime "
        "histograms, detection latency.",
    )
    parser.add_argument(
        "--metrics-linger",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="After every rank finished, keep /metrics up until it is scraped once more, at most this long "
        "(default 30; only if something scraped it during the job), so that Prometheus sees "
        "trainmover_job_finished 1 and the dead-job alert stays quiet. Set it above your scrape interval; "
        "0 exits at once.",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="Address /metrics binds to (default loopback; 0.0.0.0 for a Prometheus server on another host).",
    )
    parser.add_argument(
        "--recordings-host",
        default=None,
        help="Address this agent serves its node's sandbox recordings on, to standbys on other nodes "
        "(authenticated with the job token; see docs/sandbox.md). Default: the address this node "
        "reaches --master-addr from.",
    )
    parser.add_argument(
        "--recordings-port",
        type=int,
        default=0,
        help="Port for --recordings-host (0, the default: a free port, written on this node's record for "
        "the standbys). Give one where a firewall opens only known ports between nodes.",
    )
    add_connection_flags(parser, call_timeout=False)
    parser.add_argument("script", help="Training script, e.g. pretrain_gpt.py.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Arguments for the training script.")
    parser.set_defaults(func=run, preflight=None)
    return parser


def peek_trainmover_flags(script_args: list[str]) -> dict:
    """The script flags the agent itself acts on (they stay in the script's arguments)."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--trainmover", action="store_true")
    peek.add_argument("--tm-standbys", type=int, default=0)
    peek.add_argument("--tm-lease-ttl", type=float, default=2.0)
    peek.add_argument("--tm-hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S)
    peek.add_argument("--tm-progress-timeout", type=float, default=None)
    peek.add_argument("--tm-leaver-becomes-standby", action="store_true")
    peek.add_argument("--tm-straggler-action", default=StragglerPolicy.action)
    peek.add_argument("--tm-straggler-threshold", type=float, default=StragglerPolicy.threshold)
    peek.add_argument("--tm-straggler-window", type=int, default=StragglerPolicy.window)
    peek.add_argument("--tm-rebalance-interval", type=float, default=0.0)
    peek.add_argument("--tm-standby-nice", type=int, default=19)
    peek.add_argument("--tm-refill-nice", type=int, default=None)
    peek.add_argument("--tm-standby-reserves", type=int, default=4)
    peek.add_argument("--tm-job", default=None)
    peek.add_argument("--tm-metrics-file", default=None)
    peek.add_argument("--tm-record-dir", default=None)
    peek.add_argument("--tm-no-sandbox", action="store_true")
    peek.add_argument("--seq-length", type=int, default=0)
    peek.add_argument("--global-batch-size", type=int, default=0)
    known, _ = peek.parse_known_args(script_args)
    return vars(known)


def job_token(args: argparse.Namespace) -> str:
    """The job token: the one given, or a fresh one for a single-node job.

    Every node of a multi-node job must present the same token, and a token one
    agent generated is unknown to the others, so a multi-node launch without
    ``--tm-job-token`` is refused rather than failing later on a token mismatch.
    """
    if args.tm_job_token:
        return args.tm_job_token
    if getattr(args, "tm_role", "worker") == "standby":
        raise ConfigError(
            "a standby machine (--tm-role standby) joins a running job: pass that job's --tm-job-token "
            "(or export TRAINMOVER_JOB_TOKEN)"
        )
    if args.nnodes > 1:
        raise ConfigError(
            "a multi-node launch (--nnodes > 1) needs one job token shared by every node: generate one with "
            "`python -c 'import secrets; print(secrets.token_hex(16))'` and pass it to every node's "
            "`trainmover launch` as --tm-job-token TOKEN (or export TRAINMOVER_JOB_TOKEN); "
            "scripts/slurm/trainmover.sbatch does this for you"
        )
    return new_token()


def nproc_per_node(value: str) -> int:
    """``--nproc-per-node``: a count, or torchrun's ``gpu``, ``cpu`` and ``auto``."""
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    import torch  # only here: a count needs no device query, and importing torch takes seconds

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "gpu":
        if not gpus:
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible; give a number, or 'cpu'")
        return gpus
    if text == "cpu":
        return os.cpu_count() or 1
    if text == "auto":
        return gpus or os.cpu_count() or 1
    raise ConfigError(f"--nproc-per-node {value!r}: give a number, 'gpu', 'cpu' or 'auto'")


def nnodes(value: str) -> int:
    """``--nnodes``: N, or torchrun's MIN:MAX with MIN = MAX (elastic ranges are not supported)."""
    text = str(value).strip()
    low, _, high = text.partition(":")
    if low.isdigit() and (not high or high == low):
        return int(low)
    raise ConfigError(
        f"--nnodes {value!r}: give a number of nodes (an elastic MIN:MAX range is not supported; "
        "TrainMover replaces failed nodes with standbys instead)"
    )


def torchrun_compat(args: argparse.Namespace) -> None:
    """Fold torchrun's --standalone, --rdzv-endpoint, --rdzv-id, --local-addr and backend names into ours;
    refuse the torchrun flags that have no counterpart, with the reason."""
    if args.rdzv_conf is not None:
        raise ConfigError(
            f"--rdzv-conf {args.rdzv_conf!r}: torchrun's rendezvous options have no counterpart here; name etcd "
            "with --tm-etcd-endpoints (or let the launcher start one) and set the membership timeout with the "
            "script's --tm-lease-ttl. Drop --rdzv-conf."
        )
    if args.module:
        raise ConfigError(
            f"-m/--module: give the script's path instead of a module name (ranks and standbys run it by path), "
            f"e.g. `trainmover launch ... {args.script}.py` or the path `python -c 'import {args.script} as m; "
            "print(m.__file__)'` prints"
        )
    if args.no_python:
        raise ConfigError(
            "--no-python: the agent forks its ranks from its own warm Python process (or starts `python SCRIPT`), "
            "so the script must be a Python file; do the environment set-up in the shell that runs "
            "`trainmover launch` and pass the Python script"
        )
    if args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval {args.monitor_interval}: give a positive number of seconds")
    args.nproc_per_node = nproc_per_node(args.nproc_per_node)
    args.nnodes = nnodes(args.nnodes)
    if args.node_rank is None:
        if args.nnodes > 1 and args.tm_role == "worker":
            raise ConfigError(
                f"--nnodes {args.nnodes} needs --node-rank on every node (0 on the --master-addr node, then "
                f"1..{args.nnodes - 1}); without it every node would claim rank 0. Under Slurm, "
                "scripts/slurm/trainmover.sbatch passes $SLURM_NODEID"
            )
        args.node_rank = 0
    if args.local_addr and not args.recordings_host:
        args.recordings_host = args.local_addr
    if args.rdzv_backend in ("c10d", "static"):
        args.rdzv_backend = "tcp"
    if args.standalone:
        if args.nnodes != 1:
            raise ConfigError("--standalone runs one node: drop --nnodes or --standalone")
        args.master_addr, args.master_port = "127.0.0.1", 0
    elif args.rdzv_endpoint:
        host, _, port = (
            args.rdzv_endpoint.rpartition(":") if ":" in args.rdzv_endpoint else (args.rdzv_endpoint, "", "")
        )
        args.master_addr = host or args.master_addr
        if port:
            if not port.isdigit():
                raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: the port must be a number")
            args.master_port = int(port)
    if args.rdzv_id and not args.tm_job:
        args.tm_job = args.rdzv_id


def _cuda_visible() -> bool:
    """Whether this node has a CUDA device (torch is imported only when asked)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    import torch

    return torch.cuda.is_available()


def parse_ranks_filter(text: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,3`` -> {0, 3}; None shows every rank."""
    if text is None:
        return None
    try:
        ranks = frozenset(int(part) for part in str(text).split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(
            f"--local-ranks-filter {text!r}: give local ranks separated by commas, e.g. 0 or 0,3"
        ) from exc
    if not ranks or min(ranks) < 0:
        raise ConfigError(f"--local-ranks-filter {text!r}: give local ranks (>= 0) separated by commas, e.g. 0,3")
    return ranks


def build(args: argparse.Namespace) -> tuple[LaunchConfig, MetricsEndpoint]:
    """The agent's configuration from the parsed flags; raises :class:`ConfigError` before anything starts
    (no etcd, no process): torchrun's spellings, the script's layout (``args.preflight``, which ``trainmover``
    sets for a TrainMover script) and every combination of flags."""
    given_backend = args.rdzv_backend
    torchrun_compat(args)
    tm = peek_trainmover_flags(list(args.script_args))
    if tm["trainmover"] and args.rdzv_backend != "etcd":
        raise ConfigError(
            f"--trainmover needs the etcd rendezvous (no rank may host a store the job depends on): drop "
            f"--rdzv-backend {given_backend}"
        )
    if tm["tm_standbys"] > 0 and args.nnodes > 1 and _cuda_visible():
        raise ConfigError(
            f"--tm-standbys {tm['tm_standbys']} on a GPU job of {args.nnodes} nodes: a standby beside a node's ranks "
            "has no GPU of its own (it warms on device 0, which a rank uses) and may be promoted into a rank of "
            "another node, whose GPU index is busy here. Keep standby machines instead: --tm-standbys 0 on the "
            "active nodes, and `trainmover launch --tm-role standby` on spare nodes (one standby per GPU, each "
            "on the device of its slot; scripts/slurm/trainmover.sbatch --standby-nodes N)"
        )
    endpoints = [e.strip() for e in (args.tm_etcd_endpoints or "").split(",") if e.strip()]
    plan = RendezvousPlan(
        backend=args.rdzv_backend,
        endpoints=endpoints,
        job=args.tm_job or tm["tm_job"] or "trainmover",
        token=job_token(args),
        tls={
            "ca_cert": args.tm_etcd_ca,
            "client_cert": args.tm_etcd_cert,
            "client_key": args.tm_etcd_key,
            "user": args.tm_etcd_user,
            "password": args.tm_etcd_password,
        },
    )
    config = LaunchConfig(
        rendezvous=plan,
        trainmover=tm["trainmover"],
        standbys=tm["tm_standbys"],
        lease_ttl_s=tm["tm_lease_ttl"],
        hang_timeout_s=tm["tm_hang_timeout"],
        progress_timeout_s=tm["tm_progress_timeout"],
        leaver_becomes_standby=tm["tm_leaver_becomes_standby"],
        straggler=StragglerPolicy(
            action=tm["tm_straggler_action"],
            threshold=tm["tm_straggler_threshold"],
            window=tm["tm_straggler_window"],
        ).check(),
        rebalance=RebalancePolicy(interval_s=tm["tm_rebalance_interval"] * 60).check(),
        standby_nice=tm["tm_standby_nice"],
        refill_nice=tm["tm_standby_nice"] if tm["tm_refill_nice"] is None else tm["tm_refill_nice"],
        standby_reserves=tm["tm_standby_reserves"],
        sandbox=not tm["tm_no_sandbox"],
        record_dir=tm["tm_record_dir"],
        etcd_tls=args.tm_etcd_tls,
        run_dir=args.run_dir,
        recordings_host=args.recordings_host,
        recordings_port=args.recordings_port,
        role=args.tm_role,
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        start_method=args.start_method,
        restart_start_method=args.restart_start_method,
        term_timeout_s=args.term_timeout,
        monitor_interval_s=args.monitor_interval,
        logs=LogConfig(
            log_dir=args.log_dir,
            redirects=parse_std_spec(args.redirects, "--redirects"),
            tee=parse_std_spec(args.tee, "--tee"),
            console_ranks=parse_ranks_filter(args.local_ranks_filter),
        ),
    )
    metrics = MetricsEndpoint(
        port=args.metrics_port,
        host=args.metrics_host,
        metrics_file=tm["tm_metrics_file"],
        tokens_per_iteration=tm["seq_length"] * tm["global_batch_size"],
        linger_s=args.metrics_linger,
    )
    if args.preflight is not None:  # last: the launcher's own flags are reported first
        args.preflight(config.script, list(config.script_args), config.world_size)
    return config, metrics


def run(args: argparse.Namespace) -> int:
    config, metrics = build(args)
    return Agent(config, write_token_file=not args.tm_job_token, metrics=metrics).run()
