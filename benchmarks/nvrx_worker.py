"""One rank of ``benchmarks/nvrx_inprocess.py``: nvrx's in-process Wrapper around the demo job's training.

``nvrx_inprocess.py --worker SPEC`` runs :func:`run_worker` in each rank it starts; ``SPEC`` is the
JSON the parent wrote (timings, ports, where to stamp events).
"""

# No `from __future__ import annotations` here: nvrx finds the parameter of ``train`` that receives its
# CallWrapper by comparing real annotation objects; string annotations make it raise (TypeError in
# ``param_utils.check_type``), and every rank then exits before training.

import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import time

from nvrx_gloo_fixes import finish_torch_teardown, shutdown_tcp_connections


def run_worker(spec_path: str) -> int:
    """One rank: build the nvrx Wrapper and call the wrapped training function."""
    import torch
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import rank_assignment as ra

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    # Where a rank was stuck when nvrx's hard timeout terminates it (SIGTERM): its stacks, in its .err.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    with open(spec_path) as f:
        spec = json.load(f)
    from harness import recorder

    recorder.install_from_env()  # every rank's records, when the benchmark asks (TM_BENCH_RECORDS)
    t = spec["timings"]
    td = lambda s: datetime.timedelta(seconds=s)  # noqa: E731
    world = int(os.environ["WORLD_SIZE"])

    def stamp(event: str, **fields) -> None:
        with open(spec["events"], "a") as out:
            out.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")

    class StampInitialize(inprocess.initialize.Initialize):
        def __call__(self, state):
            stamp("nvrx_initialize", nvrx_iteration=state.iteration, rank=state.rank, initial_rank=state.initial_rank)
            return state

    class StampFinalize(inprocess.finalize.Finalize):
        def __call__(self, state):
            stamp(
                "nvrx_finalize",
                nvrx_iteration=state.iteration,
                rank=state.rank,
                initial_rank=state.initial_rank,
                error=type(state.fn_exception).__name__ if state.fn_exception is not None else "none",
            )
            return state

    class AbortGloo(inprocess.abort.Abort):
        """Abort every gloo backend, so that a main thread blocked in a gloo operation raises.

        nvrx's ``AbortTorchDistributed`` aborts NCCL backends only and then destroys the groups.
        ``ProcessGroupGloo.abort()`` (torch 2.13) does not fail an operation already waiting on a
        peer either, so with ``gloo_abort == "sockets"`` the rank's gloo connections are shut down
        too: its own pending operations fail at once ("Connection closed by peer"), and so do its
        peers' operations on those connections. This is the gloo counterpart of aborting NCCL
        communicators, which is what nvrx's abort does on GPUs."""

        def __call__(self, state):
            from torch.distributed import distributed_c10d as c10d

            stamp("abort_start", rank=state.rank)
            for group in list(c10d._world.pg_names):
                try:
                    backend = group._get_backend(torch.device("cpu"))
                except RuntimeError:
                    continue
                if isinstance(backend, torch.distributed.ProcessGroupGloo):
                    backend.abort()
            if spec["gloo_abort"] == "sockets":
                shut = shutdown_tcp_connections(keep_ports={int(os.environ["MASTER_PORT"]), spec["pg_port"]})
                stamp("gloo_sockets_shut", rank=state.rank, count=shut)
            return state

    # The store of the training process groups (one prefix per nvrx iteration), hosted by the driver
    # like nvrx's own store; it outlives the restarts.
    pg_store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=spec["pg_port"],
        world_size=world,
        is_master=False,
        multi_tenant=True,
        use_libuv=True,
        timeout=td(spec["pg_timeout_s"]),
    )

    # Heavy imports before the wrapper's first barrier: while a rank waits in C++ (the process group's
    # rendezvous) nvrx's progress watchdog sees no progress, so a long start-up spread looks like a hang.
    from megatron.core.enums import ModelType

    import pretrain_gpt
    from trainmover_ext.config import add_trainmover_args
    from trainmover_ext.hooks import TrainMoverHooks
    from trainmover_training import pretrain

    wrapper = inprocess.Wrapper(
        store_kwargs={
            "host_name": os.environ["MASTER_ADDR"],
            "port": int(os.environ["MASTER_PORT"]),
            "timeout": td(spec["pg_timeout_s"]),
        },
        initialize=inprocess.Compose(
            inprocess.initialize.RetryController(max_iterations=spec["max_restarts"] + 1), StampInitialize()
        ),
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), AbortGloo()),  # gloo first
        finalize=StampFinalize(),
        rank_assignment=inprocess.Compose(ra.MaxActiveWorldSize(spec["active"]), ra.FillGaps()),
        monitor_thread_interval=td(t["monitor_thread_interval_s"]),
        monitor_process_interval=td(t["monitor_process_interval_s"]),
        progress_watchdog_interval=td(t["progress_watchdog_interval_s"]),
        last_call_wait=td(t["last_call_wait_s"]),
        heartbeat_interval=td(t["heartbeat_interval_s"]),
        heartbeat_timeout=td(t["heartbeat_timeout_s"]),
        soft_timeout=td(t["soft_timeout_s"]),
        hard_timeout=td(t["hard_timeout_s"]),
        barrier_timeout=td(t["barrier_timeout_s"]),
        completion_timeout=td(t["completion_timeout_s"]),
        termination_grace_time=td(t["termination_grace_s"]),
        monitor_process_logfile=spec["monitor_log"],
    )

    def train(store, call_wrapper: inprocess.CallWrapper | None = None):
        """The restartable unit: a fresh gloo group and ``pretrain`` (which loads the latest checkpoint)."""
        active_rank, active_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        stamp(
            "fn_start",
            nvrx_iteration=call_wrapper.iteration,
            rank=active_rank,
            initial_rank=call_wrapper.state.initial_rank,
            stale_group_count=finish_torch_teardown(),
        )
        torch.distributed.init_process_group(
            "gloo",
            store=torch.distributed.PrefixStore(f"nvrx_pg_{call_wrapper.iteration}", store),
            rank=active_rank,
            world_size=active_world,
            timeout=td(spec["pg_timeout_s"]),
        )
        return pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            extra_args_provider=add_trainmover_args,
            argv=spec["argv"],
            runtime_hooks=TrainMoverHooks(),
        )

    wrapper(train)(pg_store)
    return 0
