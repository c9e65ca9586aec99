"""The evaluation, logging and early-exit flags of ``pretrain_gpt.py`` (Megatron-LM's names)."""

from __future__ import annotations

import argparse

from trainmover_training.errors import ConfigError


def add_eval_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation, logging and exit")
    g.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="Iterations (of --global-batch-size samples, forward only) of each evaluation on the validation split.",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=1000,
        help="Evaluate on the validation split every N iterations and after the last one (needs a validation "
        "share in --split).",
    )
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars (losses, lr, timing) here.")
    g.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Write TensorBoard training scalars every N iterations."
    )
    g.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Also write the validation perplexity to TensorBoard.",
    )
    g.add_argument(
        "--wandb-project",
        default=None,
        help="Log to this Weights & Biases project (needs `pip install wandb`; WANDB_MODE=offline keeps it local).",
    )
    g.add_argument("--wandb-exp-name", default=None, help="The Weights & Biases run name.")
    g.add_argument(
        "--wandb-save-dir", default=None, help="Directory of the Weights & Biases run files (default: the current one)."
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM to any rank, every rank saves a checkpoint at the next iteration boundary (with --save) "
        "and exits 0.",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="Save a checkpoint (with --save) and exit 0 at the first iteration boundary after this many minutes "
        "of training.",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Save a checkpoint (with --save) and exit 0 after the first iteration divisible by N.",
    )


def validate_eval_logging(args: argparse.Namespace) -> None:
    """Raise :class:`ConfigError` naming the flag to fix."""
    import importlib.util

    if args.eval_iters < 0 or args.eval_interval < 1:
        raise ConfigError("--eval-iters must be >= 0 and --eval-interval >= 1")
    if args.tensorboard_log_interval < 1:
        raise ConfigError("--tensorboard-log-interval must be >= 1")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ConfigError("--exit-duration-in-mins must be positive")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ConfigError("--exit-interval must be >= 1")
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install tensorboard")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb (or drop the flag)")
