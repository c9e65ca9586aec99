"""Leaving training early, as Megatron-LM does: ``--exit-interval``, ``--exit-duration-in-mins`` and
``--exit-signal-handler``.

Contract: :meth:`ExitConditions.reached` is called by every rank at every
iteration boundary and returns the same answer on all of them. The interval
is a function of the iteration; the time limit and a SIGTERM are seen by one
rank or a few, so when either flag is given the ranks agree through a max
all-reduce over the model-parallel group and then the data-parallel group
(together: every rank, in the groups a migration keeps up to date). The
training loop then saves a checkpoint (with ``--save``) and leaves; the
process exits 0.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainmover_training.training import Session


class ExitConditions:
    """The early-exit flags of one rank; installs the SIGTERM handler with ``--exit-signal-handler``
    (undone by :meth:`close`)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.time()
        self.signalled = False
        self._previous: Any = None
        if getattr(args, "exit_signal_handler", False):
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True
        print(
            "[trainmover] SIGTERM received: saving and exiting at the next iteration boundary",
            flush=True,
        )

    def reached(self, session: Session) -> str | None:
        """Why training stops at this boundary, or None to go on (the same on every rank)."""
        args = self.args
        if args.iteration < 1 or args.iteration >= args.train_iters:
            return None
        if args.exit_interval and args.iteration % args.exit_interval == 0:
            return f"--exit-interval {args.exit_interval}"
        timed = args.exit_duration_in_mins is not None
        if not (timed or args.exit_signal_handler):
            return None
        over = timed and (time.time() - self.started) / 60.0 > args.exit_duration_in_mins
        flags = torch.tensor([int(over), int(self.signalled)], dtype=torch.int32)
        _all_max(flags, session)
        if flags[1]:
            return "SIGTERM (--exit-signal-handler)"
        if flags[0]:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _all_max(flags: torch.Tensor, session: Session) -> None:
    from megatron.core import parallel_state as mpu

    device = next(session.model[0].parameters()).device
    moved = flags.to(device)
    for group in (mpu.get_model_parallel_group(), mpu.get_data_parallel_group()):
        torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.MAX, group=group)
    flags.copy_(moved.cpu())
