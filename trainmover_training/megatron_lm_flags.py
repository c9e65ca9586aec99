"""The flags of Megatron-LM's GPT and Llama example launch scripts, and what this training layer
does with each: ``docs/flags.md`` renders the table (``scripts/gen_flag_reference.py``), reading
support from the parser itself, so the table cannot claim a flag the parser refuses."""

from __future__ import annotations

import argparse

NO_EFFECT_FLAGS = {
    "use_mcore_models": "megatron-core's models are the only ones",
    "attention_backend": "attention is megatron-core's local or TransformerEngine implementation (--transformer-impl)",
    "no_create_attention_mask_in_dataloader": "the causal mask is built by the attention layer",
    "num_workers": "samples are read in the training process",
    "data_cache_path": "dataset indices are computed in memory",
    "no_mmap_bin_files": "the .bin files are memory-mapped",
    "cross_entropy_loss_fusion": "a fusion kernel for GPUs; the loss is the same",
    "manual_gc": "Python's garbage collector runs as usual",
    "empty_unused_memory_level": "a CUDA caching-allocator setting",
    "log_throughput": "the iteration line always shows tokens/s",
    "overlap_param_gather": "a GPU overlap setting; the result is the same",
    "log_timers_to_tensorboard": "iteration time goes to TensorBoard anyway",
    "use_flash_attn": "flash attention comes with TransformerEngine's attention (--transformer-impl)",
}
"""Megatron-LM flags accepted so that its launch scripts run unchanged, but with no effect here (each
says why; the logging rank names the ones given, once, at start)."""


def add_no_effect_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "accepted for Megatron-LM launch scripts, without effect here (named once in the log when given)"
    )
    g.add_argument("--use-mcore-models", action="store_true", help=NO_EFFECT_FLAGS["use_mcore_models"] + ".")
    g.add_argument("--attention-backend", default=None, help=NO_EFFECT_FLAGS["attention_backend"] + ".")
    g.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_true",
        help=NO_EFFECT_FLAGS["no_create_attention_mask_in_dataloader"] + ".",
    )
    g.add_argument("--num-workers", type=int, default=None, help=NO_EFFECT_FLAGS["num_workers"] + ".")
    g.add_argument("--data-cache-path", default=None, help=NO_EFFECT_FLAGS["data_cache_path"] + ".")
    g.add_argument("--no-mmap-bin-files", action="store_true", help=NO_EFFECT_FLAGS["no_mmap_bin_files"] + ".")
    g.add_argument(
        "--cross-entropy-loss-fusion", action="store_true", help=NO_EFFECT_FLAGS["cross_entropy_loss_fusion"] + "."
    )
    g.add_argument("--manual-gc", action="store_true", help=NO_EFFECT_FLAGS["manual_gc"] + ".")
    g.add_argument(
        "--empty-unused-memory-level", type=int, default=None, help=NO_EFFECT_FLAGS["empty_unused_memory_level"] + "."
    )
    g.add_argument("--log-throughput", action="store_true", help=NO_EFFECT_FLAGS["log_throughput"] + ".")
    g.add_argument("--overlap-param-gather", action="store_true", help=NO_EFFECT_FLAGS["overlap_param_gather"] + ".")
    g.add_argument(
        "--log-timers-to-tensorboard", action="store_true", help=NO_EFFECT_FLAGS["log_timers_to_tensorboard"] + "."
    )
    g.add_argument("--use-flash-attn", action="store_true", help=NO_EFFECT_FLAGS["use_flash_attn"] + ".")


def no_effect_given(args: argparse.Namespace) -> list[str]:
    """The flags of :data:`NO_EFFECT_FLAGS` this run was given, as ``--flag (why)``."""
    given = []
    for dest, why in NO_EFFECT_FLAGS.items():
        value = getattr(args, dest, None)
        if value not in (None, False):
            given.append(f"--{dest.replace('_', '-')} ({why})")
    return given


EXAMPLE_FLAGS = (
    # model
    "--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention "
    "--num-query-groups --kv-channels --seq-length --max-position-embeddings --position-embedding-type "
    "--rotary-base --rotary-percent --attention-dropout --hidden-dropout --swiglu --init-method-std "
    "--attention-backend --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
    "--normalization --norm-epsilon --use-mcore-models "
    # training
    "--micro-batch-size --global-batch-size --rampup-batch-size --train-iters --train-samples "
    "--lr-decay-samples --lr-warmup-samples --lr-warmup-fraction --lr-warmup-iters --lr-decay-iters --lr "
    "--min-lr --decoupled-lr --decoupled-min-lr --lr-decay-style --clip-grad --weight-decay --adam-beta1 "
    "--adam-beta2 --fp16 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss "
    "--manual-gc --empty-unused-memory-level --exit-duration-in-mins --exit-signal-handler --exit-interval "
    # parallelism
    "--tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size --sequence-parallel "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --distributed-timeout-minutes "
    # data
    "--data-path --vocab-file --merge-file --split --tokenizer-type --tokenizer-model --vocab-size "
    "--mock-data --data-cache-path --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers "
    "--tiktoken-pattern "
    # evaluation, logging, checkpoints
    "--log-interval --save-interval --eval-interval --eval-iters --save --load --ckpt-format "
    "--tensorboard-dir --wandb-project --wandb-exp-name --wandb-save-dir --log-throughput --profile "
    "--log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard "
    # memory
    "--recompute-activations --recompute-granularity --recompute-method --recompute-num-layers --use-flash-attn"
).split()
"""Every flag of ``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/llama/train_llama3_8b_h200_bf16.sh`` (and a few common neighbours)."""

NOT_SUPPORTED = {
    "--apply-layernorm-1p": "zero-centred norm weights; train with the usual ones",
    "--rampup-batch-size": "batch-size ramp-up; give a fixed --global-batch-size",
    "--decoupled-lr": "a separate learning rate for the embeddings",
    "--decoupled-min-lr": "see --decoupled-lr",
    "--grad-reduce-in-bf16": "gradients are reduced in fp32",
    "--calculate-per-token-loss": "the loss is the mean over each micro-batch's tokens",
    "--tiktoken-pattern": "no tiktoken tokenizer; use GPT2BPETokenizer or HuggingFaceTokenizer",
    "--profile": "use `trainmover` timelines or torch's profiler",
    "--log-params-norm": "not logged",
    "--log-num-zeros-in-grad": "not logged",
}
"""Example flags the parser refuses, each with what to do instead."""

MOE = "mixture-of-experts is not supported yet (README, 'What is supported'): drop the MoE and expert-parallel flags"
REFUSED_PREFIXES = {"--moe-": MOE}
"""Flag families refused by prefix, with the reason."""
REFUSED = {
    **NOT_SUPPORTED,
    "--num-experts": MOE,
    "--expert-model-parallel-size": MOE,
    "--expert-tensor-parallel-size": MOE,
}
"""Every flag the parser refuses by name, with the reason and what to do instead (never argparse's generic
"unrecognized arguments")."""


def refusal(flag: str) -> str | None:
    """Why ``flag`` (``--name`` or ``--name=value``) is refused, or None when it is simply unknown."""
    name = flag.split("=", 1)[0]
    if name in REFUSED:
        return REFUSED[name]
    return next((why for prefix, why in REFUSED_PREFIXES.items() if name.startswith(prefix)), None)


def support_table(parser: argparse.ArgumentParser, no_effect: dict[str, str]) -> list[tuple[str, str]]:
    """``(flag, status)`` for every flag of :data:`EXAMPLE_FLAGS`, from ``parser`` itself."""
    known = {s for a in parser._actions for s in a.option_strings}  # argparse has no public accessor
    rows = []
    for flag in EXAMPLE_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if flag not in known:
            rows.append((flag, f"not supported: {NOT_SUPPORTED.get(flag, 'refused as an unknown flag')}"))
        elif dest in no_effect:
            rows.append((flag, f"accepted, no effect here: {no_effect[dest]}"))
        else:
            rows.append((flag, "supported"))
    return rows
