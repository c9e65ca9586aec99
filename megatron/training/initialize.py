"""Process start-up: patches, torch.distributed, model-parallel groups, seeds.

Called once per rank by ``pretrain``. Rank and world come from the launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); rendezvous goes through
etcd when the launcher says so (see ``trainmover_ext.launch.rendezvous``), else
through torch's env:// TCPStore (``MASTER_ADDR``, ``MASTER_PORT``). The backend is NCCL with CUDA, gloo without; CPU
compatibility patches are installed only when CUDA is absent.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
from dataclasses import dataclass

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
    """'nccl_delta' when every group runs on the delta communicator, else the backend name."""

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
            from trainmover_ext.errors import ConfigError

            raise ConfigError("--distributed-backend nccl needs CUDA; use gloo (or auto) on CPU")
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_model_parallel(args) -> None:
    """megatron-core's parallel groups for the flags, on the current default process group."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=int(max(1, args.distributed_timeout_minutes)),
        create_gloo_process_groups=False,
    )


def initialize_distributed(args, use_delta_comm: bool = False, join_epoch=None, join: bool = True) -> ParallelLayout:
    """Install patches, init torch.distributed and megatron's parallel state.

    With ``use_delta_comm`` every group (WORLD included) runs on nccl_delta, whose
    links can be swapped while training runs. ``join_epoch`` makes this process
    a joiner that takes over its rank at that membership epoch (it builds its
    links only in ``nccl_delta.current_world().join``, called here unless
    ``join`` is false: then the caller must call it before any collective, e.g.
    on a thread while it builds its model).
    """
    import trainmover_ext.patches as patches
    from megatron.core import parallel_state as mpu

    patches.install()
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
    if not torch.distributed.is_initialized():
        from trainmover_ext.launch.rendezvous import rank_store

        store = rank_store(timeout)  # etcd under `trainmover launch`; None = env:// TCPStore
        # torch keeps only the C++ side of a Python store: if the Python object is collected,
        # later calls through it (links rebuilt after a failure) fail with "Not implemented".
        _LIVE_STORES.append(store)
        if store is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        pg_backend = backend
        if use_delta_comm:
            import nccl_delta

            nccl_delta.register(nccl_delta.DeltaConfig.from_env(op_timeout_s=timeout.total_seconds()))
            if join_epoch is not None:
                nccl_delta.expect_join(join_epoch)
            pg_backend = nccl_delta.BACKEND_NAME
        torch.distributed.init_process_group(
            backend=pg_backend, rank=rank, world_size=world_size, timeout=timeout, store=store
        )
    initialize_model_parallel(args)
    if use_delta_comm and join_epoch is not None and join:
        import nccl_delta

        nccl_delta.current_world().join(join_epoch)  # blocks until this rank's links are up
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
        comm="nccl_delta" if use_delta_comm else backend,
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
