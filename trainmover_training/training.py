"""``pretrain``: the training entry used by ``pretrain_gpt.py``.

Shape and signature follow Megatron-LM so a user's script ports unchanged:
``pretrain(train_valid_test_dataset_provider, model_provider, model_type,
forward_step_func, extra_args_provider=...)``. Every rank runs it. On exit,
normal or not, the process group and model-parallel state are torn down.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainmover_training import checkpointing, evaluation, global_vars, iteration_start
from trainmover_training.arguments import parse_args
from trainmover_training.data import BatchPlan, GPTBatchIterator
from trainmover_training.exits import ExitConditions
from trainmover_training.grad_sync import forget_pending_grad_sync, wire_no_sync
from trainmover_training.initialize import (
    DistributedSetup,
    ParallelLayout,
    initialize_distributed,
    set_random_seeds,
    shutdown,
)
from trainmover_training.loggers import ScalarLoggers
from trainmover_training.megatron_lm_flags import no_effect_given
from trainmover_training.model import get_model, transformer_config_from_args
from trainmover_training.moe import moe_no_effect
from trainmover_training.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


def process_start_time() -> float:
    """Wall-clock time at which this OS process started (fork or exec), to a clock tick (10 ms).

    ``/proc/self/stat`` gives the start in clock ticks since boot, on the clock ``CLOCK_BOOTTIME``
    reads. It is placed on the wall clock by the offset between the two clocks now, not by
    ``/proc/stat``'s ``btime``: that is whole seconds, so start times (and the restart phases
    computed from them) were up to a second early, which made a phase negative."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class MetricsLog:
    """Appends JSON lines (one per event) when ``--tm-metrics-file`` is given; logging rank only."""

    TAIL_BYTES = 1 << 16
    """How much of the file's end :meth:`last_iteration` reads (many iteration records)."""

    def __init__(self, path: str | None, enabled: bool):
        self.path = path if (path and enabled) else None
        self.file = open(path, "a", buffering=1) if self.path else None
        # TensorBoard / W&B, from the job's flags (set by pretrain before any MetricsLog is made)
        args = global_vars._ARGS
        self.scalars = ScalarLoggers(args, enabled) if args is not None else None

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
        if self.scalars is not None and self.scalars.active:
            if record.get("event") == "iteration":
                self.scalars.iteration(record)
            elif record.get("event") == "evaluation":
                self.scalars.evaluation(record)

    def last_iteration(self) -> int | None:
        """The highest ``iteration`` event among the file's last records; ``None`` if there is none."""
        if self.path is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - self.TAIL_BYTES))
            tail = f.read().decode(errors="replace").splitlines()
        best = None
        for line in tail:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the first line of the tail is usually cut
            if isinstance(rec, dict) and rec.get("event") == "iteration":
                best = rec["iteration"] if best is None else max(best, rec["iteration"])
        return best

    def restore(self, record: dict | None, source_rank: int) -> bool:
        """Write ``record`` (an iteration's record, from another rank) unless the file already has it.

        A logging rank killed after its optimizer step but before writing that iteration's record
        loses the line, while the job resumes after the iteration; its replacement writes the record
        the state source (a data-parallel replica: same loss, learning rate and sample count) kept.
        Returns whether it wrote."""
        if self.file is None or not record:
            return False
        last = self.last_iteration()
        if last is not None and last >= record["iteration"]:
            return False
        self.write(**record, restored_from_rank=source_rank)
        return True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.scalars is not None:
            self.scalars.close()


def setup_optimizer(model, args):
    """megatron-core optimizer and LR/WD scheduler for the flags."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model, use_gloo_process_groups=False)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


@dataclass
class Session:
    """Everything one rank trains with; the TrainMover runtime reads and resets it during migrations."""

    args: argparse.Namespace
    layout: ParallelLayout
    model: list
    optimizer: Any  # megatron-core's MegatronOptimizer (or a ChainedOptimizer); megatron-core has no type stubs
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    dataset: Any  # the training dataset from the dataset provider (megatron-core's GPTDataset)
    forward_step_func: Callable
    metrics: MetricsLog
    valid_dataset: Any = None
    """The validation split (None: ``--split`` gives it no share, and nothing is evaluated)."""
    test_dataset: Any = None
    """The test split, evaluated once after the last iteration (None: no share)."""
    evaluated_iteration: int | None = None
    """The boundary this rank last evaluated at (:func:`~trainmover_training.evaluation.due`); None after
    a recovery, so every rank runs the evaluation at the resume boundary."""
    iterators: list = field(default_factory=list)
    last_record: dict | None = None
    """The last completed iteration's metrics record, kept on every last-stage rank (the logging rank
    writes it); a state transfer carries it so that a replacement can restore a record its
    predecessor died before writing (:meth:`MetricsLog.restore`)."""
    started: iteration_start.IterationStart | None = None
    """The start of the iteration in progress (or last run): its counters and random state, so that
    an abandoned iteration re-runs exactly (:meth:`rewind`) and a state transfer sends the random
    state of the iteration the target resumes with (:meth:`resume_rng`)."""

    saved_iteration: int = 0
    """The iteration of the latest complete checkpoint (``train_loop`` keeps it)."""
    save_hooks: list = field(default_factory=list)
    """Called on this rank after it wrote its checkpoint file and before the ranks agree the
    checkpoint is complete (fault drills kill a rank there)."""

    def rewind(self) -> bool:
        """After an abandoned iteration: restore the random state it started from and point the data
        at ``consumed_train_samples`` again. Returns whether the random state was rewound (False when
        the rank had completed that iteration: its state is its next iteration's start already)."""
        rewound = iteration_start.rewind(self.started, self.args)
        self.reset_data()
        return rewound

    def resume_rng(self) -> dict:
        """The random state the iteration after ``args.iteration`` starts from on this rank."""
        return iteration_start.resume_rng(self.started, self.args)

    def reset_data(self) -> None:
        """Point the data iterators at ``args.consumed_train_samples`` (exact resume)."""
        plan = BatchPlan(
            micro_batch_size=self.args.micro_batch_size,
            data_parallel_size=self.layout.dp_size,
            data_parallel_rank=self.layout.dp_rank,
        )
        # Interleaved schedules take one iterator per model chunk; all read the same samples.
        self.iterators = [
            GPTBatchIterator(self.dataset, plan, self.args.consumed_train_samples) for _ in range(len(self.model))
        ]


class Runtime:
    """Hooks of the training loop; this base class is plain Megatron behaviour (no TrainMover)."""

    recoverable: tuple = ()
    """Exception types :meth:`recover` can handle; others propagate."""

    def before_iteration(self, session: Session) -> bool:
        """Called at each iteration boundary; return False to leave the loop (this process hands its rank over)."""
        return True

    def recover(self, session: Session, exc: BaseException) -> None:
        """Bring the job back to a consistent iteration after ``exc``; raise if impossible."""
        raise exc

    def after_checkpoint(self, session: Session) -> None:
        """Called after this rank saved the checkpoint of ``session.args.iteration``."""

    def evaluating(self, session: Session) -> contextlib.AbstractContextManager:
        """Wraps an evaluation at an iteration boundary (forward-only work that is not an iteration)."""
        return contextlib.nullcontext()

    def saving(self, session: Session) -> contextlib.AbstractContextManager:
        """Wraps a checkpoint save."""
        return contextlib.nullcontext()

    def finishing(self, session: Session) -> contextlib.AbstractContextManager:
        """Wraps an iteration's last collectives (loss reduction, optimizer step): the block whose
        collectives decide whether this rank completes the iteration."""
        return contextlib.nullcontext()

    def after_step(self, session: Session) -> None:
        """Called right after each completed optimizer step, where a failure still abandons the
        iteration's work (the distributed optimizer's mirror copies the new shard here)."""

    def after_iteration(self, session: Session, loss: float | None) -> None:
        """Called after each completed iteration."""

    def after_training(self, session: Session) -> None:
        """Called once when ``--train-iters`` is reached (not when the process hands its rank over)."""

    def close(self) -> None:
        """Release the runtime's resources; safe to call twice."""


def train_step(session: Session, finishing: contextlib.AbstractContextManager | None = None) -> float | None:
    """One iteration. Increments ``args.iteration`` right after the optimizer step, so after an
    abandoned iteration ``args.iteration`` is exactly the number of completed steps. After the step
    every last-stage rank keeps the iteration's record in ``session.last_record`` and the logging rank
    writes it (a re-run after an abandon writes the same values).

    ``finishing`` wraps the iteration's last collectives (the loss reduction and the optimizer step;
    :meth:`Runtime.finishing`)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args, layout, model, optimizer = session.args, session.layout, session.model, session.optimizer
    t0 = time.time()
    session.started = iteration_start.capture(args)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=session.forward_step_func,
        data_iterator=session.iterators if len(model) > 1 else session.iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    loss = None
    lr = optimizer.param_groups[0]["lr"]
    with finishing or contextlib.nullcontext():
        if layout.is_last_stage:
            loss_t = torch.stack([entry["lm loss"] for entry in losses]).mean().detach().clone()
            if layout.dp_size > 1:
                torch.distributed.all_reduce(loss_t, group=mpu.get_data_parallel_group())
                loss_t /= layout.dp_size
            loss = loss_t.item()
        optimizer.step()
    session.scheduler.step(increment=args.global_batch_size)
    if layout.is_last_stage:  # after the step: iteration_s covers the whole iteration
        t_end = time.time()
        session.last_record = dict(
            event="iteration",
            iteration=args.iteration + 1,
            loss=loss,
            iteration_s=t_end - t0,
            t_end=t_end,
            consumed_samples=args.consumed_train_samples + args.global_batch_size,
            lr=lr,
        )
        if args.fp16:  # the dynamic scale after this step's update: part of what must resume exactly
            session.last_record["loss_scale"] = float(optimizer.get_loss_scale().item())
        if layout.is_logging_rank:
            session.metrics.write(**session.last_record)
    args.iteration += 1
    args.consumed_train_samples += args.global_batch_size
    return loss


def build_session(
    args,
    layout,
    model_provider,
    dataset_provider,
    forward_step_func,
    metrics,
    prepare_chunk: Callable | None = None,
    *,
    initialize: bool = True,
) -> Session:
    """Seeds, model, optimizer, scheduler and dataset for this rank (no checkpoint loaded).
    ``initialize=False``: the parameters are left NaN for a state transfer to fill (``model.get_model``)."""
    set_random_seeds(args.seed, layout)
    config = transformer_config_from_args(args, layout)
    model = get_model(model_provider, args, layout, config, prepare_chunk, initialize=initialize)
    optimizer, scheduler = setup_optimizer(model, args)
    _wire_config(config, model, optimizer)
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size
    datasets = list(dataset_provider([args.train_iters * args.global_batch_size, evals, evals])) + [None, None]
    return Session(
        args=args,
        layout=layout,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=datasets[0],
        valid_dataset=datasets[1],
        test_dataset=datasets[2],
        forward_step_func=forward_step_func,
        metrics=metrics,
    )


class RuntimeHooks(Protocol):
    """What ``pretrain`` asks of a runtime such as TrainMover's (``trainmover_ext.hooks``); without
    hooks it trains as plain Megatron. The training layer imports nothing of the runtime."""

    metrics_file: str | None
    """Where the logging rank appends one JSON line per iteration (None: nowhere)."""

    def distributed_setup(self) -> DistributedSetup | None:
        """How this process joins torch.distributed (None: torch's env:// defaults); called after
        :meth:`start`."""

    def prepare_chunk(self, chunk) -> None:
        """Called on each model chunk once it is on its device, before DDP wraps it (e.g. to compile
        it in place)."""

    def start(self, args) -> None:
        """Called once the flags are parsed, before anything is built."""

    def serve_other_role(self, args, providers, t_process: float) -> dict | None:
        """Run this process's whole life when it is not a worker (e.g. a standby) and return its
        summary; None for a worker."""

    def runtime_for(self, session: Session) -> Runtime:
        """The training loop's hooks for this worker."""

    def after_exit(self, args, providers, t_process: float) -> Callable[[], dict] | None:
        """What to run once training ended and everything was torn down (None: nothing)."""


def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type,
    forward_step_func: Callable,
    extra_args_provider: Callable | None = None,
    args_defaults: dict | None = None,
    argv: Sequence[str] | None = None,
    runtime_hooks: RuntimeHooks | None = None,
) -> dict:
    """Parse flags, initialise, build, train, and tear down; returns a summary dict."""
    t_process = process_start_time()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every thread's stack
    faulthandler.enable(all_threads=True)  # a crash in C++ (SIGSEGV, SIGABRT) prints every thread's stack too
    args = parse_args(extra_args_provider, argv)
    for key, value in (args_defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    hooks = runtime_hooks
    if hooks is not None:
        hooks.start(args)
    tokenizer = build_tokenizer(args)
    global_vars.set_global_variables(args, tokenizer)
    providers = (model_provider, train_valid_test_dataset_provider, forward_step_func)
    if hooks is not None:
        summary = hooks.serve_other_role(args, providers, t_process)
        if summary is not None:
            return summary
    t_args = time.time()
    layout = initialize_distributed(args, hooks.distributed_setup() if hooks is not None else None)
    t_rendezvous = time.time()
    metrics = MetricsLog(hooks.metrics_file if hooks else None, layout.is_logging_rank)
    runtime: Runtime = Runtime()
    try:
        checkpointing.check_save_format(args)  # before training, not at the first save
        session = build_session(args, layout, *providers, metrics, hooks.prepare_chunk if hooks is not None else None)
        t_model = time.time()
        iteration, consumed = 0, 0
        if args.load:
            iteration, consumed = checkpointing.load_checkpoint(
                args.load, session.model, session.optimizer, session.scheduler, args, layout
            )
        t_loaded = time.time()
        args.iteration, args.consumed_train_samples = iteration, consumed
        session.evaluated_iteration = iteration  # a resumed job evaluated at its checkpoint's boundary already
        session.reset_data()
        metrics.write(
            event="startup",
            process_start=t_process,
            args_parsed=t_args,
            rendezvous=t_rendezvous,
            model_built=t_model,
            checkpoint_loaded=t_loaded,
            resumed_iteration=iteration,
        )
        if layout.is_logging_rank:
            ignored = no_effect_given(args) + moe_no_effect(args)
            if ignored:
                print(f"[trainmover] accepted without effect here: {'; '.join(ignored)}", flush=True)
            print(
                f"[trainmover] world {layout.world_size} = TP{layout.tp_size} x PP{layout.pp_size} x "
                f"DP{layout.dp_size}{f' x CP{layout.cp_size}' if layout.cp_size > 1 else ''} | comm {layout.comm} | "
                f"start iteration {iteration} | "
                f"consumed samples {consumed}",
                flush=True,
            )
        if hooks is not None:
            runtime = hooks.runtime_for(session)
        summary = train_loop(session, runtime)
    finally:
        runtime.close()
        metrics.close()
        shutdown()
    then = hooks.after_exit(args, providers, t_process) if hooks is not None else None
    if then is not None:
        del session, runtime  # the model and optimizer go before whatever comes next
        return then()
    return summary


def _wire_config(config, model, optimizer) -> None:
    """Hooks the schedules call: grad finalisation, loss scaling, no_sync."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    wire_no_sync(config, model)


def _checkpointed_iteration(args) -> int:
    """The iteration of the latest complete checkpoint under ``--save`` (0 when there is none).

    Read from the file system, not remembered, so that every rank, a joiner too, agrees after a
    failure whether a save that was under way completed (rank 0 writes the pointer only after
    every rank wrote its file)."""
    latest = checkpointing.read_latest_iteration(args.save) if args.save else None
    return latest if latest is not None else 0


def _save_due(session: Session) -> bool:
    args = session.args
    return bool(
        args.save
        and args.save_interval
        and args.iteration % args.save_interval == 0
        and args.iteration != session.saved_iteration
    )


def save(session: Session, runtime: Runtime) -> None:
    """Save the checkpoint of ``args.iteration`` (every rank) and tell the runtime."""
    args = session.args
    with runtime.saving(session):
        checkpointing.save_checkpoint(
            args.save,
            args.iteration,
            session.model,
            session.optimizer,
            session.scheduler,
            args.consumed_train_samples,
            args,
            session.layout,
            after_write=session.save_hooks,
        )
    session.saved_iteration = args.iteration
    session.metrics.write(event="checkpoint", iteration=args.iteration, t=time.time())
    runtime.after_checkpoint(session)


def train_loop(session: Session, runtime: Runtime) -> dict:
    """Train until ``--train-iters``; the runtime may migrate ranks at boundaries or after failures.

    A failure the runtime can recover from, during an iteration or during a checkpoint save,
    abandons that work; after :meth:`Runtime.recover` the loop goes on from the iteration the job
    resumed at, saving again a checkpoint that was due and not completed."""
    args, layout, model = session.args, session.layout, session.model
    tokens_per_iter = args.global_batch_size * args.seq_length
    times: list[float] = []
    losses: list[float] = []
    start_iter = args.iteration
    session.saved_iteration = _checkpointed_iteration(args)
    exits = ExitConditions(args)
    exit_reason = None
    for chunk in model:
        chunk.train()
    while True:
        try:
            if evaluation.due(session):
                with runtime.evaluating(session):
                    evaluation.evaluate_due(session)
            if _save_due(session):
                save(session, runtime)
            exit_reason = exits.reached(session)
            if exit_reason is not None:
                if args.save and session.saved_iteration != args.iteration:
                    save(session, runtime)
                break
            if args.iteration >= args.train_iters or not runtime.before_iteration(session):
                break
            t0 = time.time()
            loss = train_step(session, runtime.finishing(session))
            runtime.after_step(session)
        except runtime.recoverable as exc:
            forget_pending_grad_sync(session.model)
            runtime.recover(session, exc)
            session.saved_iteration = _checkpointed_iteration(args)
            session.evaluated_iteration = None  # every rank evaluates again at the resume boundary
            continue
        dt = time.time() - t0
        times.append(dt)
        if loss is not None:
            losses.append(loss)
        runtime.after_iteration(session, loss)
        if layout.is_logging_rank and (args.iteration % args.log_interval == 0 or args.iteration == args.train_iters):
            print(
                f"iteration {args.iteration:6d}/{args.train_iters} | loss {loss:.6f} | "
                f"ms/iter {dt * 1000:8.1f} | tokens/s {tokens_per_iter / dt:9.1f} | "
                f"consumed samples {args.consumed_train_samples}",
                flush=True,
            )
    exits.close()
    if exit_reason is not None and layout.is_logging_rank:
        print(f"[trainmover] exiting at iteration {args.iteration}: {exit_reason}", flush=True)
    if args.iteration >= args.train_iters:
        runtime.after_training(session)
    steady = sorted(times[1:]) if len(times) > 1 else times
    summary = {
        "iterations": args.iteration - start_iter,
        "final_loss": losses[-1] if losses else None,
        "median_iteration_s": steady[len(steady) // 2] if steady else None,
        "tokens_per_s": (tokens_per_iter / steady[len(steady) // 2]) if steady else None,
        "exit_reason": exit_reason,
    }
    if layout.is_logging_rank and summary["iterations"] and summary["final_loss"] is not None:
        print(
            f"[trainmover] done: {summary['iterations']} iterations | final loss {summary['final_loss']:.6f} | "
            f"median {summary['median_iteration_s'] * 1000:.1f} ms/iter | {summary['tokens_per_s']:.1f} tokens/s",
            flush=True,
        )
        sys.stdout.flush()
    return summary
