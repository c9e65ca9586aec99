"""Scalars for TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Only the logging rank writes (the one that holds the loss: last pipeline stage,
first tensor- and data-parallel rank). Under ``--trainmover`` a rank that takes
over the logging rank opens a new event file in the same directory; TensorBoard
reads every file of a directory, and an iteration re-run after a failure is
written again with the same values.

Tags follow Megatron-LM's: ``lm loss``, ``learning-rate``, ``loss-scale``,
``iteration-time``, ``batch-size``, ``lm loss validation`` (and ``... ppl``),
``lm loss test``.
"""

from __future__ import annotations

import argparse
from typing import Any


class ScalarLoggers:
    """TensorBoard and/or W&B writers of one rank (a no-op where none is configured)."""

    def __init__(self, args: argparse.Namespace, enabled: bool):
        self.args = args
        self.tensorboard: Any = None
        self.wandb: Any = None
        if not enabled:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=10)
        if args.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project,
                name=args.wandb_exp_name,
                dir=args.wandb_save_dir,
                config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
                resume="allow",
            )

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def _write(self, scalars: dict[str, float], step: int) -> None:
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def iteration(self, record: dict) -> None:
        """One training iteration's record (the metrics log's ``iteration`` event)."""
        step = record["iteration"]
        if not self.active or step % self.args.tensorboard_log_interval != 0:
            return
        scalars = {
            "lm loss": record["loss"],
            "learning-rate": record["lr"],
            "iteration-time": record["iteration_s"],
            "batch-size": float(self.args.global_batch_size),
        }
        if "loss_scale" in record:
            scalars["loss-scale"] = record["loss_scale"]
        self._write(scalars, step)

    def evaluation(self, record: dict) -> None:
        """One evaluation's record (``split`` valid or test)."""
        if not self.active or record.get("loss") is None:
            return
        name = "validation" if record["split"] == "valid" else "test"
        scalars = {f"lm loss {name}": record["loss"]}
        if self.args.log_validation_ppl_to_tensorboard:
            scalars[f"lm loss {name} ppl"] = record["ppl"]
        self._write(scalars, record["iteration"])

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
