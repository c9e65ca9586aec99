"""Process start-up: torch.distributed, model-parallel groups, seeds.

Called once per rank by ``pretrain``. Rank and world come from the launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``). A runtime changes how the
process joins torch.distributed through a :class:`DistributedSetup` (TrainMover's,
``trainmover_ext.launch.distributed``, installs its megatron-core patches, meets through
etcd and runs the groups on the swappable communicator); without one, rendezvous is
torch's env:// TCPStore (``MASTER_ADDR``, ``MASTER_PORT``). The backend is NCCL with
CUDA, gloo without.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LIVE_STORES: list = []


@dataclass(kw_only=True)
class ParallelLayout:
    """This rank's place in the TP x PP x DP grid; passed around instead of globals."""

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    comm: str = ""
    """The process-group backend the groups run on ('nccl_delta' for TrainMover's swappable
    communicator), else the device backend."""
    pp_before_dp: bool = False
    """Rank order tp, pp, dp (``--use-tp-pp-dp-mapping``) instead of tp, dp, pp."""
    ep_size: int = 1
    """Expert parallelism (``--expert-model-parallel-size``): the EP rank is ``dp_rank % ep_size``."""
    cp_size: int = 1
    """Context parallelism (``--context-parallel-size``): the ranks of one context-parallel group split
    each sequence and hold the same parameters."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def role(self) -> str:
        """Pipeline role kind: 'first', 'middle', 'last' (or 'only' when PP=1)."""
        if self.pp_size == 1:
            return "only"
        return "first" if self.is_first_stage else ("last" if self.is_last_stage else "middle")

    @property
    def is_logging_rank(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


def select_backend(requested: str) -> str:
    """``auto`` -> ``nccl`` with CUDA, ``gloo`` without."""
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            from trainmover_training.errors import ConfigError

            raise ConfigError("--distributed-backend nccl needs CUDA; use gloo (or auto) on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_order(args) -> str:
    """megatron-core's rank order for the flags: ``--use-tp-pp-dp-mapping`` puts pp before dp."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def initialize_model_parallel(args) -> None:
    """megatron-core's parallel groups for the flags, on the current default process group."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(
        order=rank_order(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        distributed_timeout_minutes=int(max(1, args.distributed_timeout_minutes)),
        create_gloo_process_groups=False,
    )


class DistributedSetup(Protocol):
    """How a runtime brings this process into torch.distributed (see the module docstring)."""

    def prepare(self) -> None:
        """Called first, before torch.distributed or megatron's parallel state is touched."""

    def store(self, timeout: datetime.timedelta) -> torch.distributed.Store | None:
        """The rendezvous store (None: torch's env:// TCPStore)."""

    def process_group_backend(self, backend: str, timeout: datetime.timedelta) -> str:
        """The backend name for ``init_process_group`` given the selected device backend."""

    def after_groups(self) -> None:
        """Called once megatron's parallel groups exist (a joiner may build its links here)."""


def initialize_distributed(args, setup: DistributedSetup | None = None) -> ParallelLayout:
    """Init torch.distributed (through ``setup`` when given) and megatron's parallel state."""

    if setup is not None:
        setup.prepare()
    torch.set_num_threads(args.threads_per_rank)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = select_backend(args.distributed_backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    comm = backend
    if not torch.distributed.is_initialized():
        store = setup.store(timeout) if setup is not None else None
        # torch keeps only the C++ side of a Python store: if the Python object is collected,
        # later calls through it (links rebuilt after a failure) fail with "Not implemented".
        _LIVE_STORES.append(store)
        if store is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        pg_backend = setup.process_group_backend(backend, timeout) if setup is not None else backend
        comm = pg_backend
        torch.distributed.init_process_group(
            backend=pg_backend, rank=rank, world_size=world_size, timeout=timeout, store=store
        )
    initialize_model_parallel(args)
    if setup is not None:
        setup.after_groups()
    return layout_from_groups(
        args, rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend, comm=comm
    )


def layout_from_groups(
    args, *, rank: int, world_size: int, local_rank: int, device: torch.device, backend: str, comm: str = ""
) -> ParallelLayout:
    """This rank's :class:`ParallelLayout`, its grid coordinates read from megatron's parallel state
    (which must be initialised)."""
    from megatron.core import parallel_state as mpu

    return ParallelLayout(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tp_size=args.tensor_model_parallel_size,
        pp_size=args.pipeline_model_parallel_size,
        dp_size=args.data_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        device=device,
        backend=backend,
        comm=comm,
        pp_before_dp=getattr(args, "use_tp_pp_dp_mapping", False),
        ep_size=getattr(args, "expert_model_parallel_size", 1) if getattr(args, "moe_layer", False) else 1,
        cp_size=getattr(args, "context_parallel_size", 1),
    )


def set_random_seeds(seed: int, layout: ParallelLayout) -> None:
    """Seed every generator. Dropout differs per pipeline stage, as in Megatron;
    weights do not depend on seeds here (see ``model.layout_independent_init_``)."""
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * layout.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2**32))
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def shutdown() -> None:
    """Destroy model-parallel state and the process group; safe to call twice."""
    from megatron.core import parallel_state as mpu

    try:
        mpu.destroy_model_parallel()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
