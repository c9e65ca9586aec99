"""An abandoned schedule's ``no_sync`` context, freed by the garbage collector during the re-run.

Run as a script, on one process::

    python tests/support/abandoned_no_sync.py tracked|plain

It wraps a small module in megatron-core's ``DistributedDataParallel`` (``--overlap-grad-reduce``, the
distributed optimizer's buffers), wires ``config.no_sync_func`` as the training layer does
(``tracked``: :func:`trainmover_training.grad_sync.wire_no_sync`) or as megatron's DDP gives it
(``plain``: ``ddp.no_sync``), and then does what a failure mid-schedule does: a schedule enters
``no_sync`` by hand and raises, its frame kept in a reference cycle with its exception; the recovery
calls :func:`~trainmover_training.grad_sync.forget_pending_grad_sync`; the re-run zeroes the buffers and
enters ``no_sync`` for its first micro-batch; then the garbage collector runs. Before all that, a
forward-only schedule that ends normally with its context entered (as megatron's does). It prints one
JSON line: ``after_forward_only``, each bucket group's ``is_last_microbatch`` once that schedule
returned; ``flipped``, whether one turned true during the re-run's micro-batch (the backward hooks
would then start the data-parallel reduction before the gradients are all there); ``left``, how many
contexts the recovery left.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch


def main(mode: str) -> None:
    import patches

    patches.install()  # megatron-core's DDP buffers on the CPU
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from trainmover_training.grad_sync import forget_pending_grad_sync, wire_no_sync

    init_file = os.path.join(tempfile.mkdtemp(), "pg")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{init_file}")
    mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=64),
        Tiny(),
    )
    wired = SimpleNamespace()
    if mode == "tracked":
        wire_no_sync(wired, [ddp])
    else:
        wired.no_sync_func = ddp.no_sync

    def abandoned_schedule() -> None:
        no_sync_context = wired.no_sync_func()
        no_sync_context.__enter__()  # megatron's schedules enter it by hand (disable_grad_sync)
        try:
            raise RuntimeError("a peer was lost mid-schedule")
        except RuntimeError as exc:
            failure = exc  # the frame holds its own exception: a cycle through the traceback
            raise failure from None

    def forward_only_schedule() -> None:
        no_sync_context = wired.no_sync_func()
        no_sync_context.__enter__()  # megatron's forward-only pipeline schedule never leaves it

    gc.disable()  # the collector runs when the test says, not at an allocation threshold
    forward_only_schedule()
    after_forward_only = [g.is_last_microbatch for g in ddp.bucket_groups]  # its frame freed on return
    try:
        abandoned_schedule()
    except RuntimeError:
        pass
    left = forget_pending_grad_sync([ddp])  # the recovery
    ddp.zero_grad_buffer()  # the re-run
    rerun = wired.no_sync_func()
    rerun.__enter__()  # its first micro-batch: not the last
    groups = ddp.bucket_groups
    before = [g.is_last_microbatch for g in groups]
    gc.collect()
    after = [g.is_last_microbatch for g in groups]
    rerun.__exit__(None, None, None)
    print(
        json.dumps(
            {
                "groups": len(groups),
                "after_forward_only": after_forward_only,
                "before": before,
                "flipped": any(after),
                "left": left,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
