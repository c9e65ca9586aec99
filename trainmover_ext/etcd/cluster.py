"""A multi-member local etcd cluster (tests and demos of surviving a member loss).

Contract: :class:`LocalEtcdCluster` starts ``size`` real etcd members on
loopback, each with its own data dir under ``base_dir``, and returns from
:meth:`start` when every member reports healthy. :meth:`kill_member` SIGKILLs
one; the rest keep quorum while a majority lives. :meth:`stop` stops all by pid.

Example::

    with LocalEtcdCluster(base_dir=tmp, size=3) as cluster:
        kv = EtcdKV(EtcdClientConfig(endpoints=cluster.endpoints))
        cluster.kill_member(0)
        kv.put("/x", b"still works")
"""

from __future__ import annotations

from pathlib import Path

from trainmover_ext.errors import ConfigError
from trainmover_ext.etcd.server import EmbeddedEtcd, EmbeddedEtcdConfig
from trainmover_ext.netutil import free_ports


class LocalEtcdCluster:
    """See the module docstring."""

    def __init__(
        self,
        *,
        base_dir: Path,
        size: int = 3,
        heartbeat_ms: int = 10,
        election_ms: int = 100,
        binary: str | None = None,
    ) -> None:
        if size < 1:
            raise ConfigError("a cluster needs at least one member")
        base_dir = Path(base_dir)
        ports = free_ports(2 * size)  # all at once, so no member's client port is another's peer port
        peers = {f"m{i}": ports[2 * i] for i in range(size)}
        initial = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in peers.items())
        self.members = [
            EmbeddedEtcd(
                EmbeddedEtcdConfig(
                    data_dir=base_dir / name,
                    name=name,
                    peer_port=port,
                    client_port=ports[2 * i + 1],
                    initial_cluster=initial,
                    heartbeat_ms=heartbeat_ms,
                    election_ms=election_ms,
                    binary=binary,
                )
            )
            for i, (name, port) in enumerate(peers.items())
        ]

    @property
    def endpoints(self) -> list[str]:
        return [ep for m in self.members for ep in m.endpoints]

    def start(self, timeout: float = 20.0) -> LocalEtcdCluster:
        # All members must be running before any can elect a leader and report healthy.
        for m in self.members:
            m.launch()
        for m in self.members:
            m.wait_healthy(timeout)
        return self

    def kill_member(self, index: int) -> None:
        self.members[index].kill()

    def restart_member(self, index: int, timeout: float = 20.0) -> None:
        self.members[index].start(timeout)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
