"""Who this process is in the job, from the launcher's environment, and its etcd namespace.

The agent gives every process it starts ``TRAINMOVER_MEMBER_ID`` plus the
rendezvous variables (see :mod:`trainmover_ext.launch.rendezvous`). The job
namespace is opened with ``JobSpace.create`` (idempotent for the same token),
so no process depends on another having registered the job first.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError
from trainmover_ext.launch import rendezvous

ENV_MEMBER_ID = "TRAINMOVER_MEMBER_ID"

ENV_SLOT = "TRAINMOVER_SLOT"
"""Set by the agent of a standby machine on each of its standbys: the slot (device index) it serves a rank in."""


def slot_from_env(environ=None) -> int | None:
    """This standby's slot on a standby machine (``TRAINMOVER_SLOT``), or None beside an active node's ranks."""
    value = (os.environ if environ is None else environ).get(ENV_SLOT, "")
    return int(value) if value.isdigit() else None


ENV_NODE_NAME = "TRAINMOVER_NODE_NAME"


def node_name(environ=None) -> str:
    """This node's name in member records: ``TRAINMOVER_NODE_NAME``, else Slurm's ``SLURMD_NODENAME``, else the
    host name.

    Under Slurm several slurmd may share one machine (emulated nodes), so the
    Slurm node name, not ``hostname``, tells the controller which members share
    a node; ``TRAINMOVER_NODE_NAME`` overrides both outside Slurm.
    """
    environ = os.environ if environ is None else environ
    return environ.get(ENV_NODE_NAME) or environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(kw_only=True)
class Identity:
    """This process's ids."""

    member_id: str
    job: str
    token: str
    host: str
    pid: int


def leaver_standby_id(leaver: str, epoch: int) -> str:
    """The member id a planned leaver of ``epoch`` takes when it rejoins the pool
    (``--tm-leaver-becomes-standby``); its agent derives the same id to adopt it as a standby.

    ``standby-<its first id>-e<epoch>``: a process that rotates through the pool again and again (scheduled
    rebalancing) keeps an id of one length, the epoch (one per job) keeping it unique."""
    first = re.sub(r"^standby-(.+)-e\d+$", r"\1", leaver)
    return f"standby-{first.removeprefix('standby-')}-e{epoch}"


def identity_from_env() -> Identity:
    """Read the ids the launcher set; :class:`ConfigError` outside ``trainmover launch``."""
    if os.environ.get(rendezvous.ENV_BACKEND) != "etcd" or not os.environ.get(rendezvous.ENV_ENDPOINTS):
        raise ConfigError(
            "--trainmover needs its launcher: run the script under `trainmover launch`, which starts an "
            "embedded etcd or connects to the --tm-etcd-endpoints you give it (before or after the script)"
        )
    return Identity(
        member_id=os.environ.get(ENV_MEMBER_ID) or f"{socket.gethostname()}-{os.getpid()}",
        job=os.environ.get(rendezvous.ENV_JOB, "trainmover"),
        token=os.environ.get(rendezvous.ENV_TOKEN, ""),
        host=node_name(),
        pid=os.getpid(),
    )


def open_space(ident: Identity, timeout_s: float = 30.0):
    """The job's :class:`JobSpace`, retried until etcd answers or ``timeout_s`` passes."""
    from trainmover_ext.errors import StoreError
    from trainmover_ext.kv.etcd import EtcdKV
    from trainmover_ext.kv.job import JobSpace

    deadline = Deadline(timeout_s)
    while True:
        try:
            return JobSpace.create(EtcdKV(rendezvous.etcd_config_from_env()), ident.job, ident.token or None)
        except StoreError:
            if deadline.expired:
                raise
            time.sleep(0.2)
