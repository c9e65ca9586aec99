"""A small in-process job for the sandbox's tests and ``benchmarks/warmup.py``.

Ranks are forked from a parent that already imported torch and megatron
(seconds saved per rank on few cores), rendezvous on a TCPStore the parent
hosts, and train with the real ``train_step`` on gloo, with the recorder
hooked in where the training loop will call it (see ``docs/sandbox.md``).
Standbys are forked the same way and never see the store's address.

Every wait has a deadline; on a deadline every child still alive is
SIGKILLed. Children always end with ``os._exit`` (gloo pairs with abandoned
ops must not hang the exit).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CTX = mp.get_context("fork")
_KEEP_ALIVE: list = []


@dataclass
class Children:
    """Forked children reporting ``(key, ok, value)`` on one queue."""

    procs: dict[Any, Any]
    queue: Any

    def results(self, timeout: float) -> dict[Any, Any]:
        """Every child's value; raises with the children's tracebacks on error, or on the deadline."""
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while set(self.procs) - set(out) - set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimeoutError(
                    f"children {sorted(set(self.procs) - set(out) - set(errors), key=str)} did not "
                    f"report within {timeout}s"
                )
            try:
                key, ok, value = self.queue.get(timeout=min(left, 1.0))
            except Exception as empty:  # queue.Empty: poll again until the deadline
                if not any(p.is_alive() for k, p in self.procs.items() if k not in out and k not in errors):
                    if self.queue.empty():
                        self.kill()
                        raise RuntimeError("a child died without reporting (killed or crashed)") from empty
                continue
            (out if ok else errors)[key] = value
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
        self.kill()
        if errors:
            raise RuntimeError("child errors:\n" + "\n".join(f"[{k}] {v}" for k, v in errors.items()))
        return out

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


def _child(key, fn: Callable, args: tuple, queue, nice: int) -> None:
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        if nice:
            os.nice(nice)
        queue.put((key, True, fn(*args)))
    except BaseException:
        # Keep the traceback (and every frame it holds) alive until os._exit: freeing a frame that
        # holds the parent's TCPStore master would join its server thread, which a forked child
        # does not have, and hang forever instead of reporting the error.
        _KEEP_ALIVE.append(sys.exc_info())
        queue.put((key, False, traceback.format_exc()))
        code = 1
    finally:
        # os._exit skips the queue's feeder thread: flush it first or the report is lost.
        queue.close()
        queue.join_thread()
        os._exit(code)


def fork_children(calls: dict[Any, tuple], nice: dict | None = None) -> Children:
    """Fork one child per ``key: (fn, *args)``; ``nice`` optionally maps key -> niceness."""
    queue = CTX.Queue()
    procs = {}
    for key, (fn, *args) in calls.items():
        proc = CTX.Process(target=_child, args=(key, fn, tuple(args), queue, (nice or {}).get(key, 0)), daemon=True)
        proc.start()
        procs[key] = proc
    return Children(procs=procs, queue=queue)


def host_store():
    """The rank store of a forked job: a TCPStore server in a process of its own (never in the
    process the ranks are forked from), and a client of it for the caller."""
    from harness.stores import host_store_in_own_process

    return host_store_in_own_process(timeout_s=120.0)


def parse_job_args(argv: list[str], world_size: int):
    """The job's flags, parsed and validated as ``pretrain_gpt.py`` does (TrainMover flags included)."""
    from trainmover_ext.config import add_trainmover_args
    from trainmover_training.arguments import parse_args

    return parse_args(add_trainmover_args, argv, world_size=world_size)


def init_real_world(args, rank: int, world_size: int, store_port: int, prefix: str = "job"):
    """gloo WORLD through the parent's store, megatron groups, and this rank's layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.distributed import PrefixStore, TCPStore

    import trainmover_ext.patches as patches
    from trainmover_training import global_vars
    from trainmover_training.initialize import layout_from_groups
    from trainmover_training.tokenizer import build_tokenizer

    patches.install()
    global_vars.set_global_variables(args, build_tokenizer(args))
    timeout = datetime.timedelta(seconds=120)
    store = PrefixStore(prefix, TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        create_gloo_process_groups=False,
    )
    return layout_from_groups(
        args, rank=rank, world_size=world_size, local_rank=0, device=__import__("torch").device("cpu"), backend="gloo"
    )


def train_iterations(session, iters: int, *, handle=None, digests: bool = True) -> list[dict]:
    """``iters`` real iterations; per iteration its loss, time and (optionally) state digests."""
    from trainmover_ext.sandbox.parts import state_digest
    from trainmover_training.training import train_step

    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = train_step(session)
        dt = time.perf_counter() - t0
        k = session.args.iteration
        index = handle.after_iteration(k) if handle is not None else None
        entry = {"iteration": k, "loss": loss, "iteration_s": dt, "sealed": index is not None}
        if digests:
            entry.update(state_digest(session.model))
        out.append(entry)
    return out


def job_rank(
    rank: int,
    world_size: int,
    store_port: int,
    argv: list[str],
    record_dir: str | None,
    record_iters: int,
    iters: int,
    digests: bool = True,
    comm: str = "gloo",
) -> dict:
    """One job rank: init, build, record the first ``record_iters`` iterations, train ``iters``.

    ``comm`` is ``gloo`` (torch's own groups) or ``nccl_delta`` (every group on nccl_delta, as under
    ``--trainmover``)."""
    import resource

    from trainmover_ext.sandbox.parts import build_parts
    from trainmover_ext.sandbox.recorder import hooks_installed, maybe_start_recording
    from trainmover_ext.sandbox.shadow import default_program
    from trainmover_training.initialize import shutdown

    args = parse_job_args(argv, world_size)
    program = default_program()
    if comm == "nccl_delta":
        from torch.distributed import PrefixStore, TCPStore

        from harness.promotion import init_delta_world

        store = PrefixStore(
            "job", TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
        )
        layout = init_delta_world(args, rank, world_size, store)
    else:
        layout = init_real_world(args, rank, world_size, store_port)
    try:
        session = build_parts(args, layout, program, consumed_samples=0)
        handle = maybe_start_recording(args, layout, record_dir=record_dir, record_iters=record_iters)
        hooks_while_recording = hooks_installed()
        try:
            steps = train_iterations(session, iters, handle=handle, digests=digests)
        finally:
            handle.close()
        overhead = handle.recorder.overhead_s if handle.recorder is not None else None
        return {
            "rank": rank,
            "role": layout.role,
            "recorded": handle.index is not None,
            "steps": steps,
            "record_overhead_s": overhead,
            "hooks_while_recording": hooks_while_recording,
            "hooks_after": hooks_installed(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        shutdown()


def socket_inodes() -> set[str]:
    """Inodes of the sockets this process holds open (``/proc/self/fd``)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def standby_process(
    argv: list[str],
    world_size: int,
    record_dir: str,
    roles: list[str] | None = None,
    iters: int | None = None,
    promoted_in_call: int | None = None,
) -> dict:
    """A general standby, alone: warm ``roles`` (default all recorded) from ``record_dir``.

    Returns per shadow iteration its role, recorded iteration, loss and state
    digests, each role's :class:`WarmResult` summary, and what isolation
    checks need: every process group alive during the shadow iterations (its
    class, and whether it is one of the replay session's groups) and the
    sockets this process opened while warming. ``promoted_in_call``: the standby
    is promoted (its ``should_stop`` turns true) once that many calls were replayed.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from trainmover_ext.sandbox import replay
    from trainmover_ext.sandbox.parts import state_digest
    from trainmover_ext.sandbox.recording import load_recordings
    from trainmover_ext.sandbox.shadow import warm_standby

    sockets_before = socket_inodes()
    args = parse_job_args(argv, world_size)
    recordings = load_recordings(record_dir, roles)
    shadow, group_classes, sockets_during = [], set(), set()

    def on_progress(p) -> None:
        shadow.append(
            {
                "role": p.role,
                "iteration": p.iteration,
                "loss": p.loss,
                "iteration_s": p.iteration_s,
                **state_digest(p.model),
            }
        )
        group_classes.update((type(pg).__name__, id(pg) in replay._SESSION.members) for pg in c10d._world.pg_map)
        sockets_during.update(socket_inodes())

    stopped_at: list[int] = []

    def promoted() -> bool:
        session = replay._SESSION
        if promoted_in_call is None or session is None or session.replayed_calls < promoted_in_call:
            return False
        stopped_at.append(session.replayed_calls)
        return True

    results = warm_standby(args, recordings, iters=iters, on_progress=on_progress, should_stop=promoted)
    return {
        "shadow": shadow,
        "results": [r.to_dict() for r in results],
        "group_classes": sorted(group_classes),
        "kept_models": sum(r.kept is not None for r in results),
        "new_sockets": sorted((sockets_during | socket_inodes()) - sockets_before),
        "initialized_after": dist.is_initialized(),
        "calls_when_stopped": stopped_at[:1],
    }
