"""What ``pretrain_gpt.py`` does with each flag of Megatron-LM that it does not implement: accept it
without effect (the result is the same: a GPU performance setting, a logger, a feature pretraining does
not read) or refuse it by name (it would change the numerics or the job, and cannot be honoured here).

Rules are matched in order, first match wins: :data:`FLAG_RULES` by flag (``fnmatch`` patterns), then
:data:`GROUP_RULES` by the Megatron-LM argument group the generated list records. A flag of the list
that no rule covers is a test failure (``tests/training/test_megatron_lm_surface.py``), so a regenerated
list with new flags asks for a decision instead of silently refusing or accepting them."""

from __future__ import annotations

NO_EFFECT = "no effect"
REFUSED = "refused"

# Reasons shared by many flags.
MOE = (
    "a mixture-of-experts option this layer does not implement yet (it does: --num-experts, "
    "--expert-model-parallel-size, --moe-router-topk, --moe-router-load-balancing-type, --moe-aux-loss-coeff, "
    "--moe-token-dispatcher-type, --moe-grouped-gemm, --moe-ffn-hidden-size)"
)
CP = (
    "a context-parallel option this layer does not implement: --context-parallel-size is megatron-core's "
    "plain context parallelism (TransformerEngine's ring attention)"
)
FP8 = "fp8/fp4 training needs TransformerEngine's low-precision recipes, which this layer does not pass on: use --bf16"
GPU_PERF = "a GPU performance setting; the result is the same"
TE_COMM = "TransformerEngine's tensor-parallel communication overlap, a GPU performance setting; the result is the same"
CUDA_GRAPH = "CUDA graphs are a GPU launch optimisation; the result is the same"
FUSION_OFF = "kernel fusion is off here already (megatron-core's unfused path), as this flag asks"
OFFLOAD = "activations and the optimizer stay where megatron-core puts them; the result is the same"
ARCH = "an architecture option megatron-core has but this layer does not pass on; it would change the model"
LOG = "not logged here; the iteration line, metrics and TensorBoard/W&B carry what is"
INFERENCE = "an inference-serving setting; pretraining does not read it"
OTHER_TASK = "not a GPT pretraining flag (another model or task): this layer pretrains GPT models only"
CKPT = "a checkpointing mode this layer does not implement (docs/checkpoints.md lists the supported ones)"
DATA = "a dataset option this layer does not implement; it would change the samples"
TOKENIZER = "a tokenizer option this layer does not pass on; it would change the tokens"
OPTIMIZER = "the optimizer is Adam (megatron-core's, fp32 main parameters); its other optimizers are not supported"
FAULTS = "TrainMover replaces it: failures, hangs and stragglers are handled by its agents (docs/recovery.md)"
PARALLEL = "a parallel layout this layer does not implement: use TP, PP, DP and the distributed optimizer"

IMPLEMENTED = frozenset(
    """
    --adam-beta1 --adam-beta2 --adam-eps --attention-dropout --bf16 --ckpt-format --clip-grad --context-parallel-size
    --data-path --disable-bias-linear --distributed-backend --distributed-timeout-minutes --eval-interval --eval-iters
    --exit-duration-in-mins --exit-interval --exit-on-missing-checkpoint --exit-signal-handler --ffn-hidden-size --fp16
    --global-batch-size --group-query-attention --hidden-dropout --hidden-size --hysteresis --init-method-std
    --initial-loss-scale --kv-channels --load --log-interval --log-validation-ppl-to-tensorboard --loss-scale
    --loss-scale-window --lr --lr-decay-iters --lr-decay-samples --lr-decay-style --lr-warmup-fraction
    --lr-warmup-iters --lr-warmup-samples --make-vocab-size-divisible-by --max-position-embeddings --merge-file
    --micro-batch-size --min-loss-scale --min-lr --mock-data --no-load-optim --no-load-rng --no-save-optim
    --norm-epsilon --normalization --num-attention-heads --num-layers --num-layers-per-virtual-pipeline-stage
    --num-query-groups --optimizer --overlap-grad-reduce --persistent-save-interval --pipeline-model-parallel-size
    --position-embedding-type --recompute-activations --recompute-granularity --recompute-method
    --recompute-num-layers --rotary-base --rotary-percent --save --seed --seq-length --sequence-parallel --split
    --swiglu --tensor-model-parallel-size --tensorboard-dir --tensorboard-log-interval --tokenizer-model
    --tokenizer-type --train-iters --train-samples --transformer-impl --untie-embeddings-and-output-weights
    --use-distributed-optimizer --use-tp-pp-dp-mapping --vocab-file --vocab-size --wandb-exp-name --wandb-project
    --wandb-save-dir --weight-decay
    --num-experts --expert-model-parallel-size --expert-tensor-parallel-size --moe-router-topk
    --moe-router-load-balancing-type --moe-aux-loss-coeff --moe-token-dispatcher-type --moe-grouped-gemm
    --moe-ffn-hidden-size
    """.split()
)
"""The Megatron-LM flags ``pretrain_gpt.py`` implements (some with a narrower range of values, each
checked with its reason: ``--context-parallel-size 1``, ``--optimizer adam``,
``--expert-tensor-parallel-size`` equal to TP). The parser must have each,
and nothing else of the list outside the rules below."""

FLAG_RULES: tuple[tuple[str, str, str], ...] = (
    # Flags of Megatron-LM's example scripts, each with what to do instead.
    ("--apply-layernorm-1p", REFUSED, "zero-centred norm weights; train with the usual ones"),
    ("--rampup-batch-size", REFUSED, "batch-size ramp-up; give a fixed --global-batch-size"),
    ("--decoupled-lr", REFUSED, "a separate learning rate for the embeddings"),
    ("--decoupled-min-lr", REFUSED, "see --decoupled-lr"),
    ("--grad-reduce-in-bf16", REFUSED, "gradients are reduced in fp32"),
    ("--calculate-per-token-loss", REFUSED, "the loss is the mean over each micro-batch's tokens"),
    ("--tiktoken-*", REFUSED, "no tiktoken tokenizer; use GPT2BPETokenizer or HuggingFaceTokenizer"),
    (
        "--attention-backend",
        NO_EFFECT,
        "attention is megatron-core's local or TransformerEngine one (--transformer-impl)",
    ),
    ("--no-create-attention-mask-in-dataloader", NO_EFFECT, "the causal mask is built by the attention layer"),
    ("--num-workers", NO_EFFECT, "samples are read in the training process"),
    ("--data-cache-path", NO_EFFECT, "dataset indices are computed in memory"),
    ("--no-mmap-bin-files", NO_EFFECT, "the .bin files are memory-mapped"),
    ("--cross-entropy-loss-fusion", NO_EFFECT, "a fusion kernel for GPUs; the loss is the same"),
    ("--cross-entropy-fusion-impl", NO_EFFECT, "a fusion kernel for GPUs; the loss is the same"),
    ("--manual-gc*", NO_EFFECT, "Python's garbage collector runs as usual"),
    ("--disable-manual-gc-eval", NO_EFFECT, "Python's garbage collector runs as usual"),
    ("--empty-unused-memory-level", NO_EFFECT, "a CUDA caching-allocator setting"),
    ("--log-throughput", NO_EFFECT, "the iteration line always shows tokens/s"),
    ("--overlap-param-gather*", NO_EFFECT, GPU_PERF),
    ("--log-timers-to-tensorboard", NO_EFFECT, "iteration time goes to TensorBoard anyway"),
    ("--use-flash-attn", NO_EFFECT, "flash attention comes with TransformerEngine's attention (--transformer-impl)"),
    ("--use-mcore-models", NO_EFFECT, "megatron-core's models are the only ones"),
    ("--profile*", NO_EFFECT, "use `trainmover` timelines (docs/monitoring.md) or torch's profiler"),
    ("--log-*", NO_EFFECT, LOG),
    # Families.
    ("--rl-*", REFUSED, OTHER_TASK),
    ("--no-rl-*", REFUSED, OTHER_TASK),
    ("--grpo-*", REFUSED, OTHER_TASK),
    ("--langrl-*", REFUSED, OTHER_TASK),
    ("--moe-*", REFUSED, MOE),
    ("--num-experts", REFUSED, MOE),
    ("--expert-*", REFUSED, MOE),
    ("--ep-overlap-*", REFUSED, MOE),
    ("--overlap-moe-expert-parallel-comm", REFUSED, MOE),
    ("--*context-parallel*", REFUSED, CP),
    ("--cp-comm-type", REFUSED, CP),
    ("--max-seqlen-per-dp-cp-rank", REFUSED, CP),
    ("--fp8*", REFUSED, FP8),
    ("--fp4*", REFUSED, FP8),
    ("--disable-fp8-wgrad", REFUSED, FP8),
    ("--keep-fp8-transpose-cache", REFUSED, FP8),
    ("--first-last-layers-bf16", REFUSED, FP8),
    ("--num-layers-at-*-in-bf16", REFUSED, FP8),
    ("--reuse-grad-buf-for-mxfp8-param-ag", REFUSED, FP8),
    ("--te-precision-config-file", REFUSED, FP8),
    ("--tp-comm-*", NO_EFFECT, TE_COMM),
    ("--disable-tp-comm-*", NO_EFFECT, TE_COMM),
    ("--*cuda-graph*", NO_EFFECT, CUDA_GRAPH),
    ("--no-*-fusion", NO_EFFECT, FUSION_OFF),
    ("--no-persist-layer-norm", NO_EFFECT, FUSION_OFF),
    ("--disable-jit-fuser", NO_EFFECT, FUSION_OFF),
    ("--cpu-offloading*", NO_EFFECT, OFFLOAD),
    ("--offload-modules", NO_EFFECT, OFFLOAD),
    ("--fine-grained-activation-offloading", NO_EFFECT, OFFLOAD),
    ("--min-offloaded-tensor-size", NO_EFFECT, OFFLOAD),
    ("--distribute-saved-activations", NO_EFFECT, OFFLOAD),
    ("--mamba-*", REFUSED, "Mamba and hybrid models are not supported: GPT models only"),
    ("--disable-mamba-mem-eff-path", REFUSED, "Mamba and hybrid models are not supported: GPT models only"),
    ("--linear-*", REFUSED, "linear attention is not supported"),
    ("--is-hybrid-model", REFUSED, "Mamba and hybrid models are not supported: GPT models only"),
    ("--hybrid-*", REFUSED, "Mamba and hybrid models are not supported: GPT models only"),
    ("--mtp-*", REFUSED, "multi-token prediction is not supported"),
    ("--dsa-*", REFUSED, "DeepSeek sparse attention is not supported"),
    ("--*kitchen*", REFUSED, "NVIDIA Kitchen quantization is not supported"),
    ("--muon-*", REFUSED, OPTIMIZER),
    ("--sgd-momentum", REFUSED, OPTIMIZER),
    ("--optimizer-*", REFUSED, "the optimizer runs where the model is; CPU offloading of it is not supported"),
    ("--use-torch-optimizer-for-cpu-offload", REFUSED, "the optimizer's CPU offloading is not supported"),
    ("--overlap-cpu-optimizer-d2h-h2d", REFUSED, "the optimizer's CPU offloading is not supported"),
    ("--use-precision-aware-optimizer", REFUSED, "the optimizer keeps fp32 main parameters and moments"),
    ("--exp-avg*-dtype", REFUSED, "the optimizer keeps fp32 main parameters and moments"),
    ("--main-*-dtype", REFUSED, "the optimizer keeps fp32 main parameters and moments"),
    ("--inference-*", NO_EFFECT, INFERENCE),
    ("--fim-*", REFUSED, "fill-in-the-middle samples are not supported"),
    ("--*-data-path", REFUSED, "give --data-path (with --split) instead"),
    ("--*inprocess*", NO_EFFECT, FAULTS),
    ("--*straggler*", NO_EFFECT, FAULTS),
    ("--*-ft-*", NO_EFFECT, FAULTS),
    ("--enable-ft-package", NO_EFFECT, FAULTS),
    ("--ddp-*-bucket*", NO_EFFECT, GPU_PERF),
    ("--ddp-bucket-size", NO_EFFECT, GPU_PERF),
    ("--ddp-num-buckets", NO_EFFECT, GPU_PERF),
    ("--*sharp*", NO_EFFECT, GPU_PERF),
    ("--*nccl*", NO_EFFECT, GPU_PERF),
    ("--*fsdp*", REFUSED, PARALLEL),
    ("--*sharding*", REFUSED, PARALLEL),
    ("--non-persistent-*", REFUSED, CKPT),
    ("--ckpt-convert-*", REFUSED, CKPT),
    ("--replication*", REFUSED, CKPT),
    # Flags one by one, where their group's rule would be wrong.
    ("--accumulate-allreduce-grads-in-fp32", NO_EFFECT, "gradients are accumulated and reduced in fp32 already"),
    ("--use-cpu-initialization", NO_EFFECT, "parameters are initialised on the CPU already, independent of the layout"),
    ("--check-for-large-grads", NO_EFFECT, "a diagnostic; TrainMover's own checks run"),
    ("--no-check-for-nan-in-loss-and-grad", NO_EFFECT, "a diagnostic; the result is the same"),
    ("--check-for-spiky-loss", NO_EFFECT, "a diagnostic; the result is the same"),
    ("--rerun-mode", NO_EFFECT, "Megatron-LM's rerun state machine is not used; TrainMover recovers failures"),
    ("--error-injection-*", REFUSED, "it injects errors into results; use TrainMover's drills (--tm-inject-*)"),
    ("--result-rejected-tracker-filename", NO_EFFECT, "Megatron-LM's rerun state machine is not used"),
    ("--high-priority-stream-groups", NO_EFFECT, GPU_PERF),
    ("--no-pin-cpu-*", NO_EFFECT, GPU_PERF),
    ("--check-weight-hash-across-dp-replicas-interval", NO_EFFECT, "a diagnostic; the result is the same"),
    ("--train-sync-interval", NO_EFFECT, GPU_PERF),
    (
        "--disable-gloo-process-groups",
        NO_EFFECT,
        "a host-memory setting; TrainMover's control plane keeps its own groups",
    ),
    ("--batch-size", REFUSED, "deprecated in Megatron-LM: use --micro-batch-size"),
    ("--checkpoint-activations", REFUSED, "deprecated in Megatron-LM: use --recompute-activations"),
    ("--recompute-modules", REFUSED, "selective recomputation recomputes the core attention only"),
    ("--use-legacy-models", REFUSED, "megatron-core's models are the only ones"),
    (
        "--dataloader-type",
        REFUSED,
        "samples are read in one pass in Megatron-LM's order; other orders are not supported",
    ),
    ("--decrease-batch-size-if-needed", REFUSED, "give a fixed --global-batch-size"),
    ("--iterations-to-skip", REFUSED, "skipping iterations is not supported"),
    ("--exit-signal", REFUSED, "--exit-signal-handler handles SIGTERM only"),
    ("--exit-signal-handler-for-dataloader", NO_EFFECT, "samples are read in the training process"),
    ("--dump-param-to-param-group-map", REFUSED, "per-parameter optimizer groups are not supported"),
    (
        "--rope-type",
        REFUSED,
        "rotary embeddings are plain RoPE (--position-embedding-type rope); YaRN is not supported",
    ),
    ("--deterministic-mode", REFUSED, "megatron-core's deterministic mode is not passed on"),
    ("--batch-invariant-mode", REFUSED, "megatron-core's batch-invariant kernels are not passed on"),
    ("--disable-bf16-reduced-precision-matmul", REFUSED, "the matmul precision is torch's default"),
    ("--embedding-init-method-std", REFUSED, "every weight is initialised with --init-method-std"),
    ("--no-initialization", REFUSED, "parameters are always initialised (or loaded)"),
    ("--init-model-with-meta-device", NO_EFFECT, "parameters are built on the CPU; the result is the same"),
    ("--disable-clone-scatter-output-in-embedding", NO_EFFECT, GPU_PERF),
    ("--disable-async-tensor-model-parallel-allreduce", NO_EFFECT, GPU_PERF),
    ("--defer-embedding-wgrad-compute", NO_EFFECT, GPU_PERF),
    ("--delay-wgrad-compute", NO_EFFECT, GPU_PERF),
    ("--wgrad-deferral-limit", NO_EFFECT, GPU_PERF),
    ("--use-ring-exchange-p2p", NO_EFFECT, GPU_PERF),
    ("--overlap-p2p-communication-warmup-flush", NO_EFFECT, GPU_PERF),
    ("--no-overlap-p2p-communication", NO_EFFECT, GPU_PERF),
    ("--symmetric-ar-type", NO_EFFECT, GPU_PERF),
    ("--disable-symmetric-registration", NO_EFFECT, GPU_PERF),
    ("--pipeline-model-parallel-comm-backend", NO_EFFECT, "pipeline sends use the data plane TrainMover chose"),
    ("--create-all-gather-group", NO_EFFECT, GPU_PERF),
    ("--suggested-communication-unit-size", NO_EFFECT, GPU_PERF),
    ("--no-align-grad-reduce", NO_EFFECT, GPU_PERF),
    ("--no-align-param-gather", NO_EFFECT, GPU_PERF),
    ("--no-scatter-gather-tensors-in-pipeline", NO_EFFECT, GPU_PERF),
    ("--distributed-timeout-seconds-after-init", NO_EFFECT, "TrainMover's own timeouts govern a rank that stops"),
    ("--local-rank", NO_EFFECT, "the launcher sets LOCAL_RANK"),
    ("--config-logger-dir", NO_EFFECT, LOG),
    ("--tensorboard-queue-size", NO_EFFECT, LOG),
    ("--timing-log-*", NO_EFFECT, LOG),
    ("--logging-level", NO_EFFECT, "use --log-level of `trainmover launch`"),
    ("--no-barrier-with-level-1-timing", NO_EFFECT, LOG),
    ("--disable-log-loss-scale-to-tensorboard", NO_EFFECT, LOG),
    ("--wandb-entity", NO_EFFECT, "W&B takes the entity from WANDB_ENTITY"),
    ("--async-save", NO_EFFECT, "checkpoints are saved synchronously; the saved state is the same"),
    ("--use-persistent-ckpt-worker", NO_EFFECT, "checkpoints are saved synchronously; the saved state is the same"),
    ("--ckpt-fully-parallel-*", NO_EFFECT, "a checkpoint I/O performance setting; the saved state is the same"),
    (
        "--disable-ckpt-fully-parallel-save",
        NO_EFFECT,
        "a checkpoint I/O performance setting; the saved state is the same",
    ),
    (
        "--ckpt-assume-constant-structure",
        NO_EFFECT,
        "a checkpoint I/O performance setting; the saved state is the same",
    ),
    ("--use-dist-ckpt", REFUSED, "deprecated in Megatron-LM: use --ckpt-format torch_dist"),
    ("--num-distributed-optimizer-instances", REFUSED, PARALLEL),
    ("--num-virtual-stages-per-pipeline-rank", REFUSED, "interleaved (virtual) pipeline stages are not supported"),
    ("--microbatch-group-size-per-virtual-pipeline-stage", REFUSED, "interleaved pipeline stages are not supported"),
    ("--decoder-*-pipeline-num-layers", REFUSED, "uneven pipeline stages are not supported: layers split evenly"),
    ("--account-for-*-in-pipeline-split", REFUSED, "uneven pipeline stages are not supported: layers split evenly"),
    ("--pipeline-model-parallel-layout", REFUSED, "uneven pipeline stages are not supported: layers split evenly"),
    ("--model-parallel-size", REFUSED, "deprecated in Megatron-LM: use --tensor-model-parallel-size"),
    ("--lazy-mpu-init", REFUSED, "parallel state is always initialised at start"),
    ("--fake-process-group", REFUSED, "every rank communicates for real"),
    (
        "--ddp-average-in-collective",
        REFUSED,
        "gradients are summed, then divided (megatron-core's default); it would change the sums",
    ),
    ("--ddp-reduce-scatter-with-fp32-accumulation", REFUSED, "gradients are reduced in fp32 buffers already"),
    ("--flash-decode", NO_EFFECT, INFERENCE),
    ("--mlp-chunks-for-prefill", NO_EFFECT, INFERENCE),
    ("--max-tokens-to-oom", NO_EFFECT, INFERENCE),
    ("--enable-chunked-prefill", NO_EFFECT, INFERENCE),
    ("--disable-chunked-prefill", NO_EFFECT, INFERENCE),
    ("--decode-only-cuda-graphs", NO_EFFECT, INFERENCE),
    ("--use-legacy-static-engine", NO_EFFECT, INFERENCE),
    ("--no-rope-freq", REFUSED, ARCH),
    (
        "--no-position-embedding",
        NO_EFFECT,
        "Megatron-LM 0.16.1 ignores it too: the position embedding follows --position-embedding-type",
    ),
    ("--use-rotary-position-embeddings", REFUSED, "use --position-embedding-type rope"),
    ("--async-tensor-model-parallel-allreduce", NO_EFFECT, GPU_PERF),
    ("--enable-experimental", NO_EFFECT, "Megatron-LM's experimental features are not used"),
    ("--spec", REFUSED, "the layer spec follows --transformer-impl; custom specs are not supported"),
    ("--yaml-cfg", REFUSED, "give the flags on the command line"),
    ("--legacy-tokenizer", REFUSED, "tokenizers are megatron.core.tokenizers' (docs/flags.md)"),
    ("--padded-vocab-size", REFUSED, "the padded vocabulary follows --make-vocab-size-divisible-by"),
    ("--skip-train", REFUSED, "evaluation alone is not supported"),
    ("--test-mode", REFUSED, "Megatron-LM's test mode is not supported"),
    ("--full-validation", REFUSED, "evaluation runs --eval-iters batches"),
    ("--multiple-validation-sets", REFUSED, "one validation set, from --split"),
    ("--use-pytorch-profiler", NO_EFFECT, "use `trainmover` timelines (docs/monitoring.md) or torch's profiler"),
    ("--record-memory-history", NO_EFFECT, "use torch's memory snapshot tools"),
    ("--memory-snapshot-path", NO_EFFECT, "use torch's memory snapshot tools"),
    ("--no-save-rng", REFUSED, "the RNG state is always saved: recovery needs it"),
    ("--dist-ckpt-strictness", REFUSED, "a checkpoint must match the model exactly"),
    ("--auto-detect-ckpt-format", REFUSED, "give --ckpt-format"),
    ("--num-dataset-builder-threads", NO_EFFECT, "dataset indices are computed in memory, in one thread"),
    ("--dataloader-fast-cache-load", NO_EFFECT, "dataset indices are computed in memory"),
    ("--dataloader-defer-npy-index-mmap", NO_EFFECT, "dataset indices are computed in memory"),
    ("--object-storage-cache-path", NO_EFFECT, "the data is read from a local file system"),
)
"""``(pattern, effect, why)`` rules by flag, first match wins."""

GROUP_RULES: dict[str, tuple[str, str]] = {
    "transformer configuration": (REFUSED, ARCH),
    "network size": (REFUSED, ARCH),
    "mla": (REFUSED, "multi-latent attention is not supported"),
    "experimental_attention_variant": (REFUSED, ARCH),
    "heterogeneous architecture": (REFUSED, "heterogeneous layer configurations are not supported"),
    "experimental": (REFUSED, ARCH),
    "mixed precision": (REFUSED, "a precision option this layer does not pass on; use --bf16 or --fp16"),
    "RNG and initialization": (
        REFUSED,
        "initialisation and RNG are megatron-core's, layout-independent; others are not supported",
    ),
    "regularization": (REFUSED, OPTIMIZER),
    "learning rate and weight decay": (
        REFUSED,
        "a schedule option this layer does not implement; it would change the learning rate",
    ),
    "checkpointing": (REFUSED, CKPT),
    "data and dataloader": (REFUSED, DATA),
    "tokenizer": (REFUSED, TOKENIZER),
    "distributed": (REFUSED, PARALLEL),
    "training": (REFUSED, "a training option this layer does not implement"),
    "validation": (REFUSED, "a validation option this layer does not implement"),
    "rl": (REFUSED, OTHER_TASK),
    "vision": (REFUSED, OTHER_TASK),
    "biencoder": (REFUSED, OTHER_TASK),
    "sft": (REFUSED, OTHER_TASK),
    "inference": (NO_EFFECT, INFERENCE),
    "logging": (NO_EFFECT, LOG),
    "one logger": (NO_EFFECT, "NVIDIA's one-logger telemetry is not used"),
    "profiling": (NO_EFFECT, "use `trainmover` timelines (docs/monitoring.md) or torch's profiler"),
    "straggler": (NO_EFFECT, FAULTS),
    "In-process restart": (NO_EFFECT, FAULTS),
    "ft_package": (NO_EFFECT, FAULTS),
    "rerun engine": (NO_EFFECT, "Megatron-LM's rerun state machine is not used; TrainMover recovers failures"),
    "autoresume": (NO_EFFECT, FAULTS),
    "workload inspector": (NO_EFFECT, "NVIDIA's workload inspector server is not started"),
    "msc": (NO_EFFECT, "the data is read from a local file system"),
    "Transformer-Engine": (REFUSED, FP8),
}
"""``group title -> (effect, why)`` for the flags no :data:`FLAG_RULES` entry covers."""
