"""Let megatron-core 0.16 and 0.19 train on CPU with gloo.

Applied only when CUDA is absent (see :func:`patches.install`). Each listed
function has its CUDA-only snippets (``device="cuda"``,
``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, CUDA type
strings, ``.cuda()``) rewritten to their CPU equivalents. The list was found by
reading megatron-core 0.16.1 and by tracing TP/PP/DP training with DDP and the
distributed optimizer; a listed function whose source no longer matches fails
loudly at install time. 0.19 moved none of them and adds CUDA-only code to one
more function on that path (``CPU_TARGETS_SINCE_0_19``), found the same way on
0.19.2.
"""

from __future__ import annotations

from ._rewrite import rewrite_all

CPU_REPLACEMENTS = [
    ('device="cuda"', 'device="cpu"'),
    ("device='cuda'", "device='cpu'"),
    ("device=torch.cuda.current_device()", "device='cpu'"),
    (".cuda(torch.cuda.current_device())", ".cpu()"),
    ("torch.cuda.current_device()", "'cpu'"),
    ("torch.cuda.synchronize()", "None"),
    ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
    # bf16/fp16 parameters are recognised by their type string when the optimizer wraps them.
    ("['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", "['torch.HalfTensor', 'torch.BFloat16Tensor']"),
    (".cuda()", ""),
    # 0.19: waits for CUDA graph replays (none on CPU) on the current stream before the grad reduce.
    ("current_stream = torch.cuda.current_stream()", "current_stream = None"),
]

# module -> functions (or Class.method) that reach CUDA-only code on the CPU path.
CPU_TARGETS: dict[str, list[str]] = {
    "megatron.core.pipeline_parallel.schedules": [
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving",
    ],
    "megatron.core.pipeline_parallel.p2p_communication": [
        "P2PCommunicator._communicate_shapes",
        "P2PCommunicator._communicate",
    ],
    "megatron.core.transformer.utils": [
        "get_default_causal_mask",
        "get_sliding_window_causal_mask",
    ],
    "megatron.core.optimizer.clip_grads": [
        "get_grad_norm_fp32",
        "clip_grad_by_total_norm_fp32",
        "count_zeros_fp32",
    ],
    "megatron.core.optimizer.optimizer": [
        "MixedPrecisionOptimizer.__init__",
        "Float16OptimizerWithFloat16Params.__init__",
        "FP32Optimizer.__init__",
        "ChainedOptimizer.get_loss_scale",
    ],
    "megatron.core.optimizer.grad_scaler": [
        "MegatronGradScaler.__init__",
        "DynamicGradScaler.__init__",
        "DynamicGradScaler.load_state_dict",
    ],
    "megatron.core.optimizer.distrib_optimizer": [
        "DistributedOptimizer._build_model_and_main_param_groups",
        "DistributedOptimizer.__init__",
    ],
    "megatron.core.distributed.param_and_grad_buffer": [
        "_ParamAndGradBuffer.__init__",
    ],
    "megatron.core.models.common.language_module.language_module": [
        "LanguageModule.setup_embeddings_and_output_layer",
    ],
    "megatron.core.utils": [
        "GlobalMemoryBuffer.get_tensor",
        "local_multi_tensor_l2_norm",
    ],
    "megatron.core.tensor_parallel.layers": [
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
    ],
    # The MoE token dispatchers' gathers, scatters and all-to-all allocate their outputs on the GPU
    # (--num-experts; the TP/sequence-parallel paths use the global buffer, patched above).
    "megatron.core.tensor_parallel.mappings": [
        "_gather_along_last_dim",
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_AllToAll.forward",
    ],
    # --position-embedding-type rope: the frequencies move "to the GPU" at the first forward.
    "megatron.core.models.common.embeddings.rotary_pos_embedding": [
        "RotaryEmbedding.get_emb",
    ],
}

# What megatron-core 0.19 adds to CPU_TARGETS (the function exists in 0.16 without CUDA-only code).
CPU_TARGETS_SINCE_0_19: dict[str, list[str]] = {
    "megatron.core.distributed.param_and_grad_buffer": [
        "_ParamAndGradBucketGroup.start_grad_sync",
    ],
    "megatron.core.optimizer.optimizer": [
        "MegatronOptimizer.has_grad_norm_group",
    ],
}


def install(version: str) -> list[str]:
    """Rewrite every CUDA-only snippet on the CPU training path of megatron-core ``version``; returns what
    was patched."""
    patched = rewrite_all(CPU_TARGETS, CPU_REPLACEMENTS)
    if not version.startswith("0.16."):
        patched += rewrite_all(CPU_TARGETS_SINCE_0_19, CPU_REPLACEMENTS)
    return patched
