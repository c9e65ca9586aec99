"""How a rank started by TrainMover joins torch.distributed: the training layer's
:class:`~trainmover_training.initialize.DistributedSetup` for the runtime.

It installs the megatron-core patches, meets through etcd when ``trainmover launch`` started the
process (:func:`~trainmover_ext.launch.rendezvous.rank_store`; torch's env:// TCPStore otherwise),
and with ``delta`` runs every group on nccl_delta, whose links can be swapped while training runs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from trainmover_ext.launch.rendezvous import rank_store


@dataclass(kw_only=True)
class TrainMoverDistributed:
    """``delta``: the groups use nccl_delta. ``join_epoch``: this process is a joiner that takes over
    its rank at that membership epoch; it builds its links in ``nccl_delta.current_world().join``,
    called once the groups exist unless ``join`` is false (then the caller must call it before any
    collective, e.g. on a thread while it builds its model)."""

    delta: bool = False
    join_epoch: int | None = None
    join: bool = True

    def prepare(self) -> None:
        # Imported here, not at the top: ``pretrain_gpt.py --help`` run from a source checkout that is
        # not installed editable finds the checkout's trainmover_ext, which has no ``patches``.
        import trainmover_ext.patches as patches

        patches.install()

    def store(self, timeout: datetime.timedelta) -> torch.distributed.Store | None:
        return rank_store(timeout)  # etcd under `trainmover launch`; None = env:// TCPStore

    def process_group_backend(self, backend: str, timeout: datetime.timedelta) -> str:
        if not self.delta:
            return backend
        import nccl_delta

        nccl_delta.register(nccl_delta.DeltaConfig.from_env(op_timeout_s=timeout.total_seconds()))
        if self.join_epoch is not None:
            nccl_delta.expect_join(self.join_epoch)
        return nccl_delta.BACKEND_NAME

    def after_groups(self) -> None:
        if self.delta and self.join_epoch is not None and self.join:
            import nccl_delta

            nccl_delta.current_world().join(self.join_epoch)  # blocks until this rank's links are up
