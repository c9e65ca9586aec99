"""Write a ``torch_dist`` checkpoint the way a plain megatron-core user does, and print the model's loss.

Run as a script, on one process::

    python tests/support/mcore_checkpoint.py OUT [--perturb SCALE] -- PRETRAIN_FLAGS...

It builds a megatron-core ``GPTModel`` (megatron-core's own random initialisation, not the training
layer's), saves ``{"model": model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0}``
with megatron-core's ``dist_checkpointing.save`` (its default strategy with CUDA) into Megatron-LM's layout
(``OUT/iter_0000000`` and ``OUT/latest_checkpointed_iteration.txt``), and prints, as one JSON line,
the model's mean loss over the first global batch that ``pretrain_gpt.py`` trains on with the same
flags. ``--perturb SCALE`` multiplies the final layer norm's weight by SCALE after the loss was computed and before
saving: a checkpoint that is not the model whose loss was printed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch


def main(argv: list[str]) -> None:
    out, own = argv[0], argv[1 : argv.index("--")]
    scale = float(own[own.index("--perturb") + 1]) if "--perturb" in own else None
    flags = argv[argv.index("--") + 1 :]
    import patches

    patches.install()  # megatron-core's model-parallel RNG tracker on the CPU generator (no-op with CUDA)
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from trainmover_training import global_vars
    from trainmover_training.arguments import parse_args
    from trainmover_training.data import BatchPlan, GPTBatchIterator, build_dataset
    from trainmover_training.dist_checkpoint import synchronous_save_strategy
    from trainmover_training.model import transformer_config_from_args
    from trainmover_training.tokenizer import build_tokenizer

    args = parse_args(None, flags, world_size=1)
    tokenizer = build_tokenizer(args)
    global_vars.set_global_variables(args, tokenizer)
    torch.set_num_threads(args.threads_per_rank)
    init_file = os.path.join(tempfile.mkdtemp(), "pg")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{init_file}")
    mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)

    config = transformer_config_from_args(args, SimpleNamespace(backend="gloo"))
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    batches = GPTBatchIterator(
        build_dataset(args, tokenizer),
        BatchPlan(micro_batch_size=args.micro_batch_size, data_parallel_size=1, data_parallel_rank=0),
        0,
    )
    losses = []
    with torch.no_grad():
        for _ in range(args.global_batch_size // args.micro_batch_size):
            batch = next(batches)
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
            mask = batch["loss_mask"].view(-1).float()
            losses.append(torch.sum(per_token.view(-1) * mask) / mask.sum())
        if scale is not None:
            model.decoder.final_layernorm.weight.mul_(scale)

    iteration_dir = os.path.join(out, "iter_0000000")
    os.makedirs(iteration_dir)
    state = {"model": model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0}
    # With CUDA, megatron-core's default strategy. Without, its asynchronous writer cannot run (it
    # calls torch.cuda.synchronize() and its forked writer processes never report back): the same
    # translation and planner, written synchronously by torch's DCP.
    strategy = None if torch.cuda.is_available() else synchronous_save_strategy()
    dist_checkpointing.save(state, iteration_dir, sharded_strategy=strategy)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("0")
    print(json.dumps({"loss": torch.stack(losses).mean().item()}), flush=True)
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
