"""Evaluation on the validation and test splits (``--eval-iters``, ``--eval-interval``, ``--split``).

When: after every ``--eval-interval``-th iteration and after the last one, on
the validation split; after the last iteration also on the test split. Each
evaluation runs ``--eval-iters`` forward-only iterations of
``--global-batch-size`` samples with dropout off, and logs the mean loss and
its perplexity.

Which samples: the ``n``-th evaluation of a run reads the validation samples
``(n - 1) * eval_iters * gbs ...``, so an evaluation's samples, like the
training samples, follow from the iteration alone. An evaluation repeated
after a recovery (see :func:`due`) therefore gives the same values, and a
job resumed from a checkpoint goes on with the samples it would have read.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from trainmover_training.data import BatchPlan, GPTBatchIterator

if TYPE_CHECKING:
    from trainmover_training.training import Session


def due(session: Session) -> bool:
    """Whether the evaluation at this boundary (``args.iteration`` completed) is still to run on this rank.

    ``session.evaluated_iteration`` is the boundary this rank last evaluated at; ``None`` after a
    recovery, so that every rank of the job runs the evaluation at the resume boundary again (some
    may have finished it before the failure, others not: all must take part in its collectives)."""
    args = session.args
    k = args.iteration
    if k < 1 or session.valid_dataset is None or args.eval_iters < 1 or k == session.evaluated_iteration:
        return False
    return k % args.eval_interval == 0 or k == args.train_iters


def evaluate_due(session: Session) -> list[dict]:
    """Run the evaluations due at this boundary; returns their records (on the last pipeline stage;
    other ranks get records with ``loss`` None). The logging rank prints them and appends them to
    the metrics log."""
    args = session.args
    k = args.iteration
    number = (k - 1) // args.eval_interval + 1  # the n-th evaluation of the run ends at this boundary
    records = [_record(session, "valid", session.valid_dataset, (number - 1) * args.eval_iters)]
    if k == args.train_iters and session.test_dataset is not None:
        records.append(_record(session, "test", session.test_dataset, 0))
    session.evaluated_iteration = k
    return records


def _record(session: Session, split: str, dataset, first_iteration: int) -> dict:
    args, layout = session.args, session.layout
    loss = evaluate(session, dataset, first_iteration * args.global_batch_size, args.eval_iters)
    record = {"event": "evaluation", "split": split, "iteration": args.iteration, "loss": loss}
    if loss is not None:
        record["ppl"] = math.exp(min(20.0, loss))
    if layout.is_logging_rank and loss is not None:
        name = "validation" if split == "valid" else "test"
        print(
            f"{name} loss at iteration {args.iteration} | lm loss value: {loss:.6E} | lm loss PPL: {record['ppl']:.6E}",
            flush=True,
        )
        session.metrics.write(**record)
    return record


def evaluate(session: Session, dataset, first_sample: int, iters: int) -> float | None:
    """Mean loss of ``iters`` forward-only iterations from global sample ``first_sample`` (dropout off);
    the value on the last pipeline stage (averaged over data-parallel replicas), None elsewhere."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args, layout, model = session.args, session.layout, session.model
    plan = BatchPlan(
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=layout.dp_size,
        data_parallel_rank=layout.dp_rank,
    )
    iterators = [GPTBatchIterator(dataset, plan, first_sample) for _ in model]
    forward_backward = get_forward_backward_func()
    losses: list[torch.Tensor] = []
    for chunk in model:
        chunk.eval()
    try:
        with torch.no_grad():
            for _ in range(iters):
                out = forward_backward(
                    forward_step_func=session.forward_step_func,
                    data_iterator=iterators if len(model) > 1 else iterators[0],
                    model=model if len(model) > 1 else model[0],
                    num_microbatches=args.num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    forward_only=True,
                )
                if layout.is_last_stage:
                    losses.extend(entry["lm loss"].float() for entry in out)
    finally:
        for chunk in model:
            chunk.train()
    if not layout.is_last_stage:
        return None
    mean = torch.stack(losses).mean()
    if layout.dp_size > 1:
        torch.distributed.all_reduce(mean, group=mpu.get_data_parallel_group())
        mean /= layout.dp_size
    return float(mean.item())
