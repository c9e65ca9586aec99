"""Model construction: transformer config, layer spec, DDP wrap, layout-independent init.

``get_model`` calls the user's ``model_provider`` once per (virtual) pipeline
stage, re-initialises every weight with :func:`layout_independent_init_`, moves
the chunks to the rank's device and wraps them in megatron-core's DDP.

Layout-independent initialisation: every parameter is drawn in full from a
generator seeded by ``(seed, its global name)`` and sliced to this rank's TP
shard (with ``--swiglu`` a shard of ``linear_fc1`` is its slice of the gate
rows followed by its slice of the up rows, as megatron-core lays it out;
grouped-query attention's ``linear_qkv`` is group-major, so a plain slice).
The global name numbers layers globally (and experts by their global index under
expert parallelism), so TP1-PP1 and TP2-PP2, or EP1 and EP2, start from identical
weights and their losses can be compared.
"""

from __future__ import annotations

import argparse
import math
import re
import zlib
from collections.abc import Callable
from typing import Any

import torch

from trainmover_training.moe import global_expert_name, grouped_gemm, moe_config_kwargs


def transformer_config_from_args(args, layout):
    """megatron-core ``TransformerConfig`` for the flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        use_cpu_initialization=True,
        # get_model's layout_independent_init_ overwrites every weight megatron-core draws here, but the
        # draw cannot be skipped: megatron-core 0.16 gives a weight its tensor-parallel attributes
        # (partition_dim, ...) inside it, and the layout-independent draw, the gradient norm and the
        # checkpoints all read them.
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # gloo matches both directions of a batched exchange with the same peer
        # and tag in posting order: with interleaved PP=2 that silently swaps
        # activations and gradients. Never batch on gloo. Nor on TrainMover's
        # communicator: batch_isend_irecv coalesces only on torch's own group
        # class, and separate NCCL sends posted before their receives on both
        # ends would wait for each other; megatron's unbatched exchange orders
        # each pair's sends and receives by rank parity instead.
        batch_p2p_comm=not ((layout.backend == "gloo" and interleaved) or getattr(layout, "comm", "") == "nccl_delta"),
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        cuda_graph_scope=[],
        **moe_config_kwargs(args),
    )


def use_transformer_engine(args) -> bool:
    """TE spec when requested/auto and both TE and CUDA are present."""
    if args.transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if args.transformer_impl == "transformer_engine" and not available:
        from trainmover_training.errors import ConfigError

        raise ConfigError("--transformer-impl transformer_engine needs TransformerEngine and CUDA; use auto or local")
    return available


def gpt_layer_spec(args: argparse.Namespace) -> Any:
    """The TransformerEngine spec on GPU with TE, megatron-core's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe = (
        {"num_experts": args.num_experts, "moe_grouped_gemm": grouped_gemm(args)}
        if getattr(args, "moe_layer", False)
        else {}
    )
    if use_transformer_engine(args):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=args.normalization, **moe)


_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")


def _global_name(name: str, chunk) -> str:
    """Parameter name with the layer index replaced by its global layer number."""
    module = getattr(chunk, "module", chunk)
    match = _LAYER_RE.search(name)
    if match:
        layer = module.decoder.layers[int(match.group(1))]
        name = name.replace(match.group(0), f"decoder.layers.{layer.layer_number - 1}.", 1)
    if name.startswith("output_layer.") and getattr(module, "share_embeddings_and_output_weights", False):
        # the last stage's copy of the tied embedding starts equal to the first stage's
        name = "embedding.word_embeddings.weight"
    return name


def layout_independent_init_(
    chunk,
    seed: int,
    init_std: float,
    num_layers: int,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    num_local_experts: int = 0,
) -> None:
    """Overwrite every parameter of ``chunk`` from a name-seeded full tensor (see module doc); an expert's
    parameters are named by its global expert index (``ep_rank`` x ``num_local_experts`` + local index)."""
    scaled_std = init_std / math.sqrt(2.0 * num_layers)
    gated = bool(getattr(getattr(getattr(chunk, "module", chunk), "config", None), "gated_linear_unit", False))
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            key = global_expert_name(_global_name(name, chunk), num_local_experts, ep_rank)
            full_shape = list(param.shape)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if dim >= 0:
                full_shape[dim] *= tp_size
            leaf = key.rsplit(".", 1)[-1]
            if "norm" in key and leaf in ("weight", "layer_norm_weight"):
                full = torch.ones(full_shape, dtype=torch.float32)
            elif leaf.endswith("bias"):
                full = torch.zeros(full_shape, dtype=torch.float32)
            else:
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
                std = scaled_std if ("linear_proj" in key or "linear_fc2" in key) else init_std
                full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            if dim >= 0 and gated and "linear_fc1." in key:
                # SwiGLU: a TP shard of fc1 is [its gate rows; its up rows], the full tensor [gate; up]
                full = torch.cat([half.chunk(tp_size, dim=dim)[tp_rank] for half in full.chunk(2, dim=dim)], dim=dim)
            elif dim >= 0:
                full = full.chunk(tp_size, dim=dim)[tp_rank]
            param.copy_(full.to(param.dtype))


def poison_(chunk) -> None:
    """Set every floating-point parameter of ``chunk`` to NaN: for a model whose state a transfer is about
    to overwrite, a value the transfer misses then shows as NaN in the first loss, never as a plausible
    number (and the layout-independent draw, a full tensor per parameter, is not made in vain)."""
    with torch.no_grad():
        for param in chunk.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))


def get_model(
    model_provider: Callable,
    args,
    layout,
    transformer_config,
    prepare_chunk: Callable | None = None,
    *,
    initialize: bool = True,
) -> list:
    """Build, initialise and DDP-wrap this rank's model chunks; ``initialize=False`` leaves every
    parameter NaN (:func:`poison_`) for a state transfer to fill."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage if vpp else None)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage if vpp else None)
        chunk = model_provider(pre_process=pre, post_process=post, vp_stage=vp_stage if vpp else None)
        if not initialize:
            poison_(chunk)
        else:
            layout_independent_init_(
                chunk,
                args.seed,
                args.init_method_std,
                args.num_layers,
                layout.tp_rank,
                layout.tp_size,
                ep_rank=mpu.get_expert_model_parallel_rank() if getattr(args, "moe_layer", False) else 0,
                num_local_experts=(args.num_experts // args.expert_model_parallel_size)
                if getattr(args, "moe_layer", False)
                else 0,
            )
        chunk.to(layout.device)
        if prepare_chunk is not None:
            prepare_chunk(chunk)  # e.g. TrainMover's --tm-compile, in place
        chunks.append(chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        # As in Megatron-LM: the first stage casts its inputs to the model's precision and the
        # last stage returns fp32 logits/losses; the parameters stay bf16/fp16 (fp32 master copies
        # live in the optimizer).
        chunks = [Float16Module(transformer_config, chunk) for chunk in chunks]
    return [
        DistributedDataParallel(
            config=transformer_config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=(i > 0),
        )
        for i, chunk in enumerate(chunks)
    ]
