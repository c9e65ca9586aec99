"""Run a function in N forked rank processes that share a TCPStore hosted by the test process.

Ranks are forked from the pytest process (torch already imported), use one
thread each, and always end with ``os._exit`` so that gloo pairs with
abandoned ops cannot abort or hang the exit. Every wait has a deadline; on a
deadline every child still alive is SIGKILLed and the test fails.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

import nccl_delta
from harness.stores import host_store_in_own_process

CTX = mp.get_context("fork")


def host_store() -> TCPStore:
    """A client of a TCPStore server in a process of its own (see ``host_store_in_own_process``)."""
    return host_store_in_own_process(timeout_s=60.0)


def client_store(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


def test_config(**overrides) -> nccl_delta.DeltaConfig:
    values = dict(link_host="127.0.0.1", transport="gloo", op_timeout_s=30.0, connect_timeout_s=30.0)
    values.update(overrides)
    return nccl_delta.DeltaConfig(**values)


@dataclass
class Ranks:
    """Handles of running rank processes."""

    procs: dict[int, Any]
    queue: Any
    store: TCPStore

    def results(self, timeout: float = 120.0, expect: set[int] | None = None) -> dict[int, Any]:
        """Collect ``(rank, ok, value)`` from every expected rank; raise on an error or a deadline."""
        expect = set(self.procs) if expect is None else set(expect)
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while expect - set(out) - set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                self.dump_stacks()
                self.kill_all()
                raise TimeoutError(f"ranks {sorted(expect - set(out) - set(errors))} did not report in {timeout}s")
            try:
                key, ok, value = self.queue.get(timeout=min(left, 1.0))
            except Exception:
                continue
            (out if ok else errors)[key] = value
        self.join(timeout=max(5.0, deadline - time.monotonic()), only=expect)
        if errors:
            raise AssertionError("rank errors:\n" + "\n".join(f"[{k}] {v}" for k, v in sorted(errors.items())))
        return out

    def join(self, timeout: float = 10.0, only: set | None = None) -> None:
        """Wait for the processes (``only`` these keys) to exit; SIGKILL those still alive after ``timeout``."""
        keys = set(self.procs) if only is None else set(only)
        deadline = time.monotonic() + timeout
        for key in keys:
            self.procs[key].join(max(0.0, deadline - time.monotonic()))
        self.kill_all(keys)

    def dump_stacks(self) -> None:
        """Make every live rank print all its threads' stacks (to the test's stderr) before it is killed."""
        for proc in self.procs.values():
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)

    def kill_all(self, keys: set | None = None) -> None:
        for key, proc in self.procs.items():
            if keys is not None and key not in keys:
                continue
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


def _child(
    key,
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    config,
    init: bool,
    join_epoch: int | None,
) -> None:
    code = 0
    try:
        # `kill -USR1 <pid>` prints every thread's stack: the way to see where a rank is stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        torch.set_num_threads(1)
        store = client_store(port)
        nccl_delta.register(config)
        if join_epoch is not None:
            nccl_delta.expect_join(join_epoch)
        if init:
            dist.init_process_group(
                backend="nccl_delta",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=60),
            )
        queue.put((key, True, fn(rank, world_size, store, *args)))
    except BaseException:
        queue.put((key, False, traceback.format_exc()))
        code = 1
    finally:
        # The queue writes from a feeder thread: flush it before os._exit skips every cleanup.
        queue.close()
        queue.join_thread()
        os._exit(code)


def spawn(
    world_size: int,
    fn: Callable,
    *args,
    ranks: list[int] | None = None,
    store: TCPStore | None = None,
    config: nccl_delta.DeltaConfig | None = None,
    init: bool = True,
    join_epoch: int | None = None,
    queue=None,
    keys: list | None = None,
) -> Ranks:
    """Fork one process per rank running ``fn(rank, world_size, store, *args)`` after init."""
    store = store or host_store()
    queue = queue or CTX.Queue()
    config = config or test_config()
    ranks = list(range(world_size)) if ranks is None else ranks
    keys = keys or ranks
    procs = {}
    for key, rank in zip(keys, ranks, strict=False):
        proc = CTX.Process(
            target=_child,
            args=(key, rank, world_size, store.port, fn, args, queue, config, init, join_epoch),
            daemon=True,
        )
        proc.start()
        procs[key] = proc
    return Ranks(procs=procs, queue=queue, store=store)


def run(world_size: int, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> dict[int, Any]:
    ranks = spawn(world_size, fn, *args, **kwargs)
    return ranks.results(timeout=timeout)


def hang_then_abandon(fn: Callable, *args, hung: int = 2, world_size: int = 4) -> tuple[dict[int, Any], float]:
    """Run ``fn`` on ``world_size`` ranks until each sets ``looping/<rank>``, SIGSTOP rank ``hung`` (hung,
    not dead: gloo alone would wait for its timeout), then set ``abandon``; returns the other ranks'
    results and the wall time of the abandon."""
    ranks = spawn(world_size, fn, *args)
    try:
        ranks.store.wait([f"looping/{r}" for r in range(world_size)])
        time.sleep(0.3)
        os.kill(ranks.procs[hung].pid, signal.SIGSTOP)
        time.sleep(1.0)
        abandoned_at = time.time()
        ranks.store.set("abandon", "1")
        results = ranks.results(timeout=30, expect=set(range(world_size)) - {hung})
    finally:
        os.kill(ranks.procs[hung].pid, signal.SIGKILL)
        ranks.kill_all()
    return results, abandoned_at
