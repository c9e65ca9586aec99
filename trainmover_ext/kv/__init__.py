"""The storage layer of the control plane: a small KV interface, etcd and in-memory implementations,
versioned JSON values, per-job namespaces with token gating, and an etcd-backed torch Store.
"""

from trainmover_ext.kv.base import KV, Delete, Entry, Guard, Put, Snapshot, WatchEvent, WatchHandle
from trainmover_ext.kv.etcd import EtcdClientConfig, EtcdKV
from trainmover_ext.kv.memory import MemoryKV

__all__ = ["KV", "Delete", "Entry", "EtcdClientConfig", "EtcdKV", "Guard", "MemoryKV", "Put", "Snapshot", "WatchEvent", "WatchHandle"]
