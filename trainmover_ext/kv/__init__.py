"""The storage layer of the control plane: a small KV interface, etcd and in-memory implementations,
versioned JSON values, per-job namespaces with token gating, and an etcd-backed torch Store.

The etcd client (which needs ``grpc``) loads on first use of ``EtcdKV``/``EtcdClientConfig``, so
the standard-library parts (keys, records, :mod:`trainmover_ext.etcd.auth`) run on a bare Python.
"""

from typing import TYPE_CHECKING

from trainmover_ext.kv.base import KV, Delete, Entry, Guard, Put, Snapshot, WatchEvent, WatchHandle
from trainmover_ext.kv.memory import MemoryKV

if TYPE_CHECKING:  # loaded lazily at run time by __getattr__ below (they need grpc)
    from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV

__all__ = [
    "KV",
    "Delete",
    "Entry",
    "EtcdClientConfig",
    "EtcdKV",
    "Guard",
    "MemoryKV",
    "Put",
    "Snapshot",
    "WatchEvent",
    "WatchHandle",
]


def __getattr__(name: str) -> object:
    if name in ("EtcdClientConfig", "EtcdKV"):
        from trainmover_ext.kv import etcd

        return getattr(etcd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
