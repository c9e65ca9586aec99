"""Rendezvous through etcd: no rank hosts a store the job depends on.

The agent decides where rendezvous happens and passes it to its ranks in the
environment (``TRAINMOVER_ETCD_*``, ``TRAINMOVER_JOB``,
``TRAINMOVER_JOB_TOKEN``, ``TRAINMOVER_RDZV_PREFIX``). Each (re)start of the
ranks gets its own key prefix, so a restart never reads an older generation's
addresses. Ranks build their etcd client after fork (see ``EtcdStore``); the
agent itself never opens a gRPC channel before forking.

``TRAINMOVER_RDZV=tcp`` (``--rdzv-backend tcp``) falls back to torch's TCPStore
on ``MASTER_ADDR:MASTER_PORT``, hosted by rank 0.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

from trainmover_ext.errors import ConfigError
from trainmover_ext.kv.job import job_login, store_prefix

ENV_ENDPOINTS = "TRAINMOVER_ETCD_ENDPOINTS"
ENV_JOB = "TRAINMOVER_JOB"
ENV_TOKEN = "TRAINMOVER_JOB_TOKEN"
ENV_PREFIX = "TRAINMOVER_RDZV_PREFIX"
ENV_BACKEND = "TRAINMOVER_RDZV"
_TLS_ENV = {
    "ca_cert": "TRAINMOVER_ETCD_CA",
    "client_cert": "TRAINMOVER_ETCD_CERT",
    "client_key": "TRAINMOVER_ETCD_KEY",
    "user": "TRAINMOVER_ETCD_USER",
    "password": "TRAINMOVER_ETCD_PASSWORD",
}


@dataclass(kw_only=True)
class RendezvousPlan:
    """Where this job's ranks meet; turned into environment variables for each rank."""

    backend: str = "etcd"
    """'etcd' (default) or 'tcp' (rank 0 hosts a TCPStore: a single point of failure)."""
    endpoints: list[str] = field(default_factory=list)
    """etcd client endpoints (``host:port``)."""
    job: str = "trainmover"
    """Job name: keys live under ``/trainmover/<job>/``."""
    token: str | None = None
    """The job token."""
    tls: dict = field(default_factory=dict)
    """``EtcdClientConfig`` TLS/auth fields (ca_cert, client_cert, client_key, user, password)."""

    def __post_init__(self) -> None:
        if self.backend not in ("etcd", "tcp"):
            raise ConfigError("--rdzv-backend must be 'etcd' or 'tcp'")

    def env(self, generation: int) -> dict[str, str]:
        """Environment for the ranks of start number ``generation``."""
        env = {ENV_BACKEND: self.backend, ENV_JOB: self.job}
        if self.backend == "etcd":
            env[ENV_ENDPOINTS] = ",".join(self.endpoints)
            # inside the job's namespace, after its control keys (see kv.job.STORE_DIR)
            env[ENV_PREFIX] = store_prefix(self.job, generation)
            if self.token:
                env[ENV_TOKEN] = self.token
            for name, var in _TLS_ENV.items():
                if self.tls.get(name):
                    env[var] = str(self.tls[name])
        return env


def etcd_config_from_env(environ=None):
    """``EtcdClientConfig`` from the ``TRAINMOVER_ETCD_*`` variables."""
    from trainmover_ext.kv.etcd import EtcdClientConfig

    environ = os.environ if environ is None else environ
    config = EtcdClientConfig(
        endpoints=environ[ENV_ENDPOINTS],
        **{name: environ.get(var) or None for name, var in _TLS_ENV.items()},
    )
    return job_login(config, environ.get(ENV_JOB, ""), environ.get(ENV_TOKEN))


def rank_store(timeout: datetime.timedelta):
    """The store a rank should rendezvous on, or None for torch's default (env://)."""
    if os.environ.get(ENV_BACKEND, "tcp") != "etcd" or not os.environ.get(ENV_ENDPOINTS):
        return None
    from trainmover_ext.kv.torch_store import EtcdStore

    # connected here, before the groups' link threads call it from several gloo constructors at once
    return EtcdStore(etcd_config_from_env(), prefix=os.environ[ENV_PREFIX], timeout=timeout).connect()
