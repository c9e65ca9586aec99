"""Local etcd servers: the embedded default, multi-member clusters for tests, test certificates.

``from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig`` is all the
launcher needs; see :mod:`trainmover_ext.etcd.server` for the contract.
"""

from trainmover_ext.etcd.cluster import LocalEtcdCluster
from trainmover_ext.etcd.server import EmbeddedEtcd, EmbeddedEtcdConfig, find_etcd_binary
from trainmover_ext.netutil import free_port

__all__ = ["EmbeddedEtcd", "EmbeddedEtcdConfig", "LocalEtcdCluster", "find_etcd_binary", "free_port"]
