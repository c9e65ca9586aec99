"""Pretrain a GPT model with megatron-core, optionally under TrainMover (``--trainmover``).

Same shape as Megatron-LM's ``pretrain_gpt.py``: ``model_provider``,
``train_valid_test_datasets_provider`` and ``forward_step`` are handed to
``pretrain``. Run one process per rank, e.g.::

    trainmover launch --nproc-per-node 8 pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 \\
        --data-path data/corpus_text_document --trainmover
"""

from __future__ import annotations

import os
import sys
from functools import partial

from trainmover_training import get_args, get_tokenizer, pretrain  # first: quiets CPU fallback warnings

# isort: split
import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel

from trainmover_ext.config import add_trainmover_args
from trainmover_ext.errors import exit_on_error
from trainmover_ext.hooks import TrainMoverHooks
from trainmover_training.data import build_dataset
from trainmover_training.model import gpt_layer_spec, transformer_config_from_args


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None) -> GPTModel:
    """Build this pipeline stage's GPT model chunk."""
    from trainmover_training.initialize import select_backend

    args = get_args()

    class _Layout:  # only the backend and the communicator matter for the config here
        backend = select_backend(args.distributed_backend)
        # The job's communicator, also in a standby's sandbox (whose groups replay it): the p2p
        # pattern it picks must be the one that was recorded.
        comm = (
            "nccl_delta"
            if getattr(args, "tm_comm", "auto") == "nccl_delta"
            or (getattr(args, "tm_comm", "auto") in ("auto", None) and getattr(args, "trainmover", False))
            else ""
        )

    config = transformer_config_from_args(args, _Layout)
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Train, validation and test datasets from ``--data-path`` or ``--mock-data`` and ``--split`` (None for a
    split with no share)."""
    args, tokenizer = get_args(), get_tokenizer()
    return tuple(build_dataset(args, tokenizer, split) for split in range(3))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss; the logged value is a copy (the schedule scales the loss in place).

    With context parallelism this rank holds two chunks of each sequence: its loss is its chunks' sum
    over the whole sequence's token count, so that the context-parallel group's losses add up to the
    sequence's mean (megatron's schedule multiplies it by the CP size, which the gradient average over
    DP x CP divides out again); the logged value is the whole sequence's mean."""
    from megatron.core import parallel_state as mpu

    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    local = torch.sum(losses.view(-1) * loss_mask)
    if mpu.get_context_parallel_world_size() == 1:
        loss = local / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}
    total = torch.stack([local.detach(), loss_mask.sum()])
    torch.distributed.all_reduce(total, group=mpu.get_context_parallel_group())
    return local / total[1], {"lm loss": total[0] / total[1]}


def forward_step(data_iterator, model: GPTModel):
    """One micro-batch forward; returns the output and the loss function."""
    from megatron.core import parallel_state as mpu

    vp_stage = getattr(getattr(model, "module", model), "vp_stage", None)
    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    batch = next(data_iterator) if (first or last) else None
    if batch is not None and mpu.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)  # two chunks of each sequence, balanced for the causal mask
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device) if first else None
    position_ids = batch["position_ids"].to(device) if first else None
    labels = batch["labels"].to(device) if last else None
    loss_mask = batch["loss_mask"].to(device) if last else None
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


if __name__ == "__main__":
    with exit_on_error("pretrain_gpt.py"):
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            extra_args_provider=add_trainmover_args,
            runtime_hooks=TrainMoverHooks(),
        )
    # Everything is closed and flushed here. A process that abandoned gloo ops during a recovery
    # (any rank that survived one, or a standby started as a fresh interpreter and promoted) would
    # abort in the interpreter's teardown, where gloo's threads are destroyed: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
