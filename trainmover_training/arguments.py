"""Megatron-LM style command-line arguments for ``pretrain_gpt.py``.

The flags keep Megatron-LM's names so an existing launch script ports with
``--trainmover`` added. Extra flag groups come from one ``extra_args_provider``
(TrainMover's is :func:`trainmover_ext.config.add_trainmover_args`).
:func:`parse_args` validates the combination against the world size and
raises :class:`ConfigError` with a message naming the flag that fixes it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from trainmover_training.arguments_logging import add_eval_logging_args, validate_eval_logging
from trainmover_training.errors import ConfigError
from trainmover_training.megatron_lm_flags import add_no_effect_args, refusal
from trainmover_training.model import use_transformer_engine
from trainmover_training.moe import add_moe_args, validate_moe
from trainmover_training.tokenizer import add_tokenizer_args, validate_tokenizer_args


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors say how to get help, and why a Megatron-LM flag it knows of is refused."""

    def error(self, message: str):  # noqa: D401 - argparse API
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = [(w, refusal(w)) for w in message[len(prefix) :].split()]
            refused = [(w.split("=", 1)[0], why) for w, why in words if why is not None]
            if refused:  # the words after a refused flag are its values
                unknown = [w for w, why in words if w.startswith("-") and why is None]
                message = "; ".join(f"{name} is not supported: {why}" for name, why in refused)
                message += f"; {prefix}{' '.join(unknown)}" if unknown else ""
        self.print_usage()
        self.exit(2, f"{self.prog}: error: {message}\nRun `{self.prog} --help` for the list of flags.\n")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, required=True, help="Number of attention heads.")
    g.add_argument("--seq-length", type=int, required=True, help="Sequence length of each training sample.")
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Maximum sequence length for position embeddings (default: --seq-length).",
    )
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight initialisation.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weight instead of sharing the word embedding.",
    )
    g.add_argument(
        "--normalization",
        choices=["LayerNorm", "RMSNorm"],
        default="LayerNorm",
        help="Normalization layer of every block and of the final norm (Llama uses RMSNorm).",
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the normalization layers.")
    g.add_argument(
        "--swiglu",
        action="store_true",
        help="SwiGLU MLP (a gated linear unit with SiLU), as in Llama; set --ffn-hidden-size to match.",
    )
    g.add_argument(
        "--disable-bias-linear", action="store_true", help="No bias in the linear layers (attention and MLP)."
    )
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope", "none"],
        default="learned_absolute",
        help="Position embedding: learned absolute positions (GPT-2) or rotary embeddings (rope, Llama).",
    )
    g.add_argument(
        "--rotary-percent", type=float, default=1.0, help="rope only: share of each head's channels rotated."
    )
    g.add_argument("--rotary-base", type=int, default=10000, help="rope only: base of the rotary frequencies.")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Grouped-query attention: --num-query-groups key/value heads shared by the query heads.",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="With --group-query-attention: the number of key/value head groups (must divide "
        "--num-attention-heads and be a multiple of TP).",
    )
    g.add_argument(
        "--kv-channels", type=int, default=None, help="Channels per attention head (default hidden / heads)."
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this (must be a multiple of the TP size). "
        "The padding does not depend on TP, so layouts stay comparable.",
    )
    g.add_argument(
        "--transformer-impl",
        choices=["auto", "local", "transformer_engine"],
        default="auto",
        help="Layer implementation: 'auto' uses TransformerEngine when it and CUDA are present, "
        "else megatron-core's local spec.",
    )


def _add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recomputation (megatron-core's, as in Megatron-LM)")
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Recompute the core attention in the backward pass instead of keeping its activations "
        "(the same as --recompute-granularity selective).",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="'full': recompute whole transformer layers (with --recompute-method and --recompute-num-layers); "
        "'selective': only the core attention. Default: keep every activation.",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="With --recompute-granularity full: 'uniform' recomputes every chunk of --recompute-num-layers "
        "layers; 'block' the first --recompute-num-layers layers of each pipeline stage.",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="With --recompute-granularity full: layers per recomputed chunk ('uniform') or per stage ('block').",
    )


def _validate_recompute(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the recompute flags, as errors naming the flag (megatron-core's own
    TransformerConfig would otherwise fail later, on every rank)."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ConfigError("--recompute-activations is selective recomputation: drop --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            raise ConfigError(
                "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N"
            )
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        if not 1 <= args.recompute_num_layers <= per_stage:
            raise ConfigError(
                f"--recompute-num-layers {args.recompute_num_layers}: must be between 1 and the layers of one "
                f"pipeline stage ({per_stage})"
            )
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        flag = "--recompute-method" if args.recompute_method is not None else "--recompute-num-layers"
        raise ConfigError(f"{flag} applies to --recompute-granularity full only")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="Samples per micro-batch per DP rank.")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per iteration across all DP ranks (default: micro-batch x DP). "
        "Must be divisible by micro-batch-size x DP.",
    )
    g.add_argument(
        "--train-iters", type=int, default=None, help="Total number of training iterations (or give --train-samples)."
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Total number of training samples instead of --train-iters (a multiple of --global-batch-size).",
    )
    g.add_argument("--lr", type=float, required=True, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Minimum learning rate of the decay.")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="linear",
        help="Learning-rate decay function.",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Iterations of linear warm-up.")
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="Warm-up in samples (with --train-samples).")
    g.add_argument(
        "--lr-decay-samples", type=int, default=None, help="Decay over this many samples (with --train-samples)."
    )
    g.add_argument(
        "--lr-decay-iters", type=int, default=None, help="Iterations to decay over (default: --train-iters)."
    )
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping by global norm (0 disables).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument(
        "--optimizer",
        choices=["adam"],
        default="adam",
        help="Optimizer: megatron-core's Adam (AdamW-style weight decay), the only one supported "
        "(Megatron-LM's sgd and muon are not).",
    )
    g.add_argument("--seed", type=int, default=1234, help="Random seed (initialisation, data order, dropout).")
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision: bf16 parameters and activations, fp32 master copies in the optimizer.",
    )
    g.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 mixed precision with loss scaling: fp16 parameters, fp32 master copies, and a "
        "dynamic loss scale unless --loss-scale is given.",
    )
    g.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="fp16 only: a constant loss scale (a positive power of 2 is best); default: dynamic.",
    )
    g.add_argument(
        "--initial-loss-scale", type=float, default=2.0**32, help="fp16 only: the dynamic loss scale's starting value."
    )
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16 only: the dynamic loss scale's floor.")
    g.add_argument(
        "--loss-scale-window",
        type=int,
        default=1000,
        help="fp16 only: iterations without overflow before the dynamic loss scale grows.",
    )
    g.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="fp16 only: overflowing iterations tolerated before the dynamic loss scale shrinks.",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state across data-parallel ranks (ZeRO-1).",
    )
    g.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap DP gradient reduction with backward.")
    g.add_argument("--log-interval", type=int, default=1, help="Print a log line every N iterations.")
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="Exit with an error when --load has no checkpoint instead of starting from scratch.",
    )


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size (TP).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size (PP).")
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual stage for the interleaved pipeline schedule.",
    )
    g.add_argument("--sequence-parallel", action="store_true", help="Sequence parallelism inside TP regions.")
    g.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="Rank order tp, then pp, then dp (megatron-core's order 'tp-cp-ep-pp-dp') instead of the default tp, "
        "dp, pp: a node of consecutive ranks then holds whole pipelines, and each data-parallel replica lives on "
        "other nodes.",
    )
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallelism: each sequence is split over this many ranks (two chunks each, balanced for "
        "the causal mask), through megatron-core's context-parallel attention, which is TransformerEngine's: "
        "more than 1 needs TransformerEngine with CUDA (refused on CPU; run only by scripts/gpu_check_multi.sh). "
        "Not with --num-experts or --use-distributed-optimizer yet.",
    )
    g.add_argument(
        "--distributed-backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="torch.distributed backend: 'auto' picks nccl with CUDA, else gloo.",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="Timeout of every collective and of rendezvous, in minutes.",
    )
    g.add_argument(
        "--threads-per-rank",
        type=int,
        default=1,
        help="torch intra-op threads per rank on CPU (keep ranks x threads <= cores).",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true", help="Train on deterministic synthetic tokens.")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="Megatron indexed datasets (PREFIX.bin and PREFIX.idx, e.g. made by scripts/prepare_data.py): one or "
        "more prefixes read as one stream, or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' whose samples come from "
        "each dataset in proportion to its weight.",
    )
    g.add_argument(
        "--split",
        default="100,0,0",
        help="Train/valid/test shares of each dataset's tokens, comma-separated weights (e.g. 949,50,1); the "
        "validation share feeds --eval-iters, the test share one evaluation after the last iteration.",
    )
    add_tokenizer_args(g)


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", default=None, help="Directory to load the latest checkpoint from.")
    g.add_argument("--save-interval", type=int, default=None, help="Save a checkpoint every N iterations.")
    g.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    g.add_argument(
        "--ckpt-format",
        choices=["torch", "torch_dist"],
        default="torch",
        help="Format of the checkpoints --save writes. torch: one file per rank, resumes bit-exactly in the "
        "same TP/PP/DP layout only. torch_dist: megatron-core's dist_checkpointing, as Megatron-LM writes "
        "it; resumes in the same layout bit-exactly or under another TP/PP layout (the distributed "
        "optimizer's state: under another data-parallel size only). --load reads either format, whatever "
        "this flag says.",
    )


def build_parser(extra_args_provider: Callable | None = None, prog: str = "pretrain_gpt.py") -> _Parser:
    """The full parser: Megatron groups plus whatever ``extra_args_provider`` adds."""
    parser = _Parser(prog=prog, description="Pretrain a GPT model with megatron-core.", allow_abbrev=False)
    _add_model_args(parser)
    _add_training_args(parser)
    _add_recompute_args(parser)
    _add_parallel_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    add_eval_logging_args(parser)
    add_moe_args(parser)
    add_no_effect_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(
    extra_args_provider: Callable | None = None,
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
) -> argparse.Namespace:
    """Parse and validate flags; ``world_size`` defaults to ``$WORLD_SIZE`` or 1."""
    args = build_parser(extra_args_provider).parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world_size)
    return args


def _validate_context_parallel(args: argparse.Namespace) -> None:
    """Context parallelism: megatron-core's context-parallel attention is TransformerEngine's."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    if not use_transformer_engine(args):
        raise ConfigError(
            f"--context-parallel-size {cp} needs TransformerEngine's attention (with CUDA): megatron-core's local "
            "attention has no context parallelism. On CPU leave it at 1 (docs/flags.md)."
        )
    if args.use_distributed_optimizer:
        raise ConfigError(
            f"--context-parallel-size {cp} with --use-distributed-optimizer is not supported yet: leave out one of them"
        )
    if args.seq_length % (2 * cp) != 0:
        raise ConfigError(
            f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
            "(each context-parallel rank takes two chunks of every sequence)"
        )


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Check flag combinations and fill derived values (``data_parallel_size`` ...).

    Raises :class:`ConfigError` naming the flag to change.
    """
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(
            "--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be >= 1"
        )
    _validate_context_parallel(args)
    if world_size % (tp * pp * cp) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}: "
            "change --tensor-model-parallel-size / --pipeline-model-parallel-size / --context-parallel-size or "
            "the number of processes (--nproc-per-node x --nnodes)."
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    _validate_recompute(args)
    dp = args.data_parallel_size
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel and not use_transformer_engine(args):
        raise ConfigError(
            "--sequence-parallel needs TransformerEngine's layers (with CUDA): megatron-core's local layers "
            "use torch's norms, which do not support it; leave the flag out"
        )
    validate_moe(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x DP "
            f"= {args.micro_batch_size} x {dp} = {args.micro_batch_size * dp}; pick a multiple of "
            f"{args.micro_batch_size * dp}."
        )
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    _validate_schedule(args)
    if args.num_layers % pp != 0:
        raise ConfigError(f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {pp}")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage must divide the layers per stage "
                f"({per_stage}) and needs --pipeline-model-parallel-size >= 2"
            )
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.num_microbatches % pp != 0:
            raise ConfigError(
                "the interleaved schedule needs a number of micro-batches divisible by PP: raise --global-batch-size"
            )
    else:
        args.virtual_pipeline_model_parallel_size = None
    if args.hidden_size % args.num_attention_heads != 0:
        raise ConfigError("--hidden-size must be divisible by --num-attention-heads")
    if args.num_attention_heads % tp != 0:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} must be divisible by TP {tp}")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups < 1 or args.num_attention_heads % groups != 0:
            raise ConfigError(
                f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads}"
            )
        if groups % tp != 0:
            raise ConfigError(f"--num-query-groups {groups} must be a multiple of TP {tp} (each TP rank holds groups)")
    if args.position_embedding_type == "rope" and not 0 < args.rotary_percent <= 1:
        raise ConfigError("--rotary-percent must be in (0, 1]")
    if args.make_vocab_size_divisible_by % tp != 0:
        raise ConfigError(f"--make-vocab-size-divisible-by must be a multiple of TP {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError("--seq-length is larger than --max-position-embeddings")
    if args.bf16 and args.fp16:
        raise ConfigError("choose one of --bf16 and --fp16")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ConfigError("--loss-scale must be positive (or leave it out for a dynamic scale)")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ConfigError("need 0 < --min-loss-scale <= --initial-loss-scale")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        raise ConfigError("--loss-scale-window and --hysteresis must be >= 1")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:
            raise ConfigError("--lr-warmup-fraction must be in [0, 1)")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"(default --train-iters) {args.lr_decay_iters}"
        )
    if args.min_lr > args.lr:
        raise ConfigError("--min-lr must not exceed --lr")
    if not args.mock_data and not args.data_path:
        raise ConfigError(
            "give --data-path PREFIX (a Megatron .bin/.idx dataset; see scripts/prepare_data.py) or --mock-data"
        )
    args.data_blend = _parse_blend(args.data_path) if args.data_path else None
    args.data_weighted = bool(args.data_path) and len(args.data_blend) * 2 == len(args.data_path)
    args.split_shares = _parse_split(args.split)
    if args.data_blend:
        for _, prefix in args.data_blend:
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    built = prefix.removesuffix("_text_document")
                    raise ConfigError(
                        f"--data-path {prefix}: file {prefix + suffix} does not exist. Build it with "
                        f"`python scripts/prepare_data.py --input YOUR_TEXT_OR_JSONL --output-prefix {built}` "
                        f"(it writes {built}_text_document.bin/.idx) or fix the path."
                    )
    validate_tokenizer_args(args)
    validate_eval_logging(args)
    if args.save_interval is not None and args.save_interval <= 0:
        raise ConfigError("--save-interval must be a positive number of iterations")
    if args.save_interval and not args.save:
        raise ConfigError("--save-interval needs --save DIR")
    if args.threads_per_rank < 1:
        raise ConfigError("--threads-per-rank must be >= 1")


def _validate_schedule(args: argparse.Namespace) -> None:
    """``--train-samples`` and the sample-counted schedule flags, in iterations (there is no batch ramp-up,
    so an iteration is always ``--global-batch-size`` samples)."""
    gbs = args.global_batch_size
    if (args.train_iters is None) == (args.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.train_samples < gbs:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one --global-batch-size ({gbs})")
        args.train_iters = args.train_samples // gbs
        if args.lr_decay_samples is not None:
            args.lr_decay_iters = max(1, args.lr_decay_samples // gbs)
        if args.lr_warmup_samples is not None:
            args.lr_warmup_iters = args.lr_warmup_samples // gbs
    elif args.lr_decay_samples is not None or args.lr_warmup_samples is not None:
        raise ConfigError(
            "--lr-decay-samples and --lr-warmup-samples go with --train-samples (or use the -iters flags)"
        )
    if args.train_iters < 1:
        raise ConfigError("--train-iters must be >= 1")


def _parse_split(text: str) -> tuple[float, float, float]:
    """``--split`` as normalised (train, valid, test) shares."""
    try:
        parts = [float(p) for p in text.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {text!r} is not up to three non-negative weights, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    if parts[0] <= 0:
        raise ConfigError(f"--split {text!r} leaves no training share")
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def _parse_blend(items: Sequence[str]) -> list[tuple[float, str]]:
    """``--data-path`` as (weight, prefix) pairs: ``W1 P1 W2 P2 ...``, or ``P1 P2 ...`` (weight 1 each; the
    dataset reads unweighted prefixes as one stream)."""

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if number(items[0]) is None:
        return [(1.0, p) for p in items]
    if len(items) % 2 != 0:
        raise ConfigError("a weighted --data-path takes pairs: W1 PREFIX1 W2 PREFIX2 ...")
    pairs = []
    for w, prefix in zip(items[::2], items[1::2], strict=True):
        weight = number(w)
        if weight is None or weight <= 0:
            raise ConfigError(f"--data-path weight {w!r} (before {prefix}) must be a positive number")
        pairs.append((weight, prefix))
    return pairs
