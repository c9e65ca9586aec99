"""Communicator benchmark: nccl_delta against torch's gloo, side by side in one run.

Sections (each a function registered in ``SECTIONS``; add one to extend the report):
- ``allreduce``: all-reduce time of nccl_delta vs torch gloo on the same ranks, same tensors,
  alternating the two so that machine noise hits both. ``ratio = delta_s / gloo_s``.
- ``switch``: phase-2 switch time and links touched when one rank of a megatron TP2.PP2.DPk
  world is replaced, at several world sizes. ``switch_s`` is the slowest stayer's phase 2;
  ``links_touched`` sums over stayers.
- ``training``: reserved for the trainer's steady iteration time (added by the lead).

Ranks are forked from this process (torch already imported), one thread each, on loopback.

    python benchmarks/comm.py --json out.json                 # the full issue matrix
    python benchmarks/comm.py --quick --json out.json         # ~1 minute on 2 cores
    python benchmarks/comm.py --sizes-mb 64 --ranks 4 --sections allreduce
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

import nccl_delta  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402

CTX = mp.get_context("fork")
MB = 1 << 20


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _config() -> nccl_delta.DeltaConfig:
    return nccl_delta.DeltaConfig.from_env(link_host=os.environ.get("NCCL_DELTA_LINK_HOST", "127.0.0.1"))


# --- process plumbing ----------------------------------------------------------------------
def _child(rank, world_size, port, fn, args, queue, join_epoch):
    code = 0
    try:
        torch.set_num_threads(1)
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
        nccl_delta.register(_config())
        if join_epoch is not None:
            nccl_delta.expect_join(join_epoch)
        dist.init_process_group(backend="nccl_delta", store=store, rank=rank, world_size=world_size)
        queue.put((rank if join_epoch is None else "joiner", True, fn(rank, world_size, store, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        queue.close()
        queue.join_thread()
        os._exit(code)  # skip gloo/NCCL teardown at exit: nothing is left to flush


def _collect(procs, queue, expect, timeout):
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout}s")
            try:
                key, ok, value = queue.get(timeout=min(left, 1.0))
            except Exception:
                continue
            if not ok:
                raise RuntimeError(f"rank {key} failed:\n{value}")
            out[key] = value
    finally:
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()) if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
    return out


def _spawn(store, world_size, fn, args, queue, ranks=None, join_epoch=None):
    procs = []
    for rank in (range(world_size) if ranks is None else ranks):
        proc = CTX.Process(target=_child, args=(rank, world_size, store.port, fn, args, queue, join_epoch),
                           daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def _host_store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))


# --- all-reduce -------------------------------------------------------------------------------
def _allreduce_rank(rank, world_size, store, sizes_mb, iters):
    ref = dist.new_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    device = _device()
    rows = []
    for size_mb in sizes_mb:
        x = torch.ones(int(size_mb * MB) // 4, device=device)
        times = {"delta": [], "gloo": []}
        for it in range(iters + 1):  # the first round warms allocators and links up
            for name, group in (("delta", None), ("gloo", ref)):
                dist.barrier(group=ref)
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if it:
                    times[name].append(time.perf_counter() - t0)
                x.fill_(1.0)
        rows.append((size_mb, times))
        del x
    return rows


def section_allreduce(args) -> list[dict]:
    rows = []
    for world_size in args.ranks:
        store, queue = _host_store(), CTX.Queue()
        procs = _spawn(store, world_size, _allreduce_rank, (args.sizes_mb, args.iters), queue)
        per_rank = _collect(procs, queue, world_size, args.timeout)
        for k, size_mb in enumerate(args.sizes_mb):
            # An all-reduce ends when its slowest rank ends: take the max over ranks per iteration.
            timing = {}
            for name in ("delta", "gloo"):
                per_iter = zip(*(per_rank[r][k][1][name] for r in range(world_size)))
                timing[name] = statistics.median(max(v) for v in per_iter)
            rows.append(dict(ranks=world_size, bytes=int(size_mb * MB), delta_s=round(timing["delta"], 6),
                             gloo_s=round(timing["gloo"], 6), ratio=round(timing["delta"] / timing["gloo"], 3)))
            print(f"  allreduce ranks={world_size} {size_mb} MB: delta {timing['delta']:.4f}s "
                  f"gloo {timing['gloo']:.4f}s", flush=True)
    return rows


# --- switch -------------------------------------------------------------------------------------
SWAP_EPOCH = 1


def _megatron_groups():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False)


def _switch_stayer(rank, world_size, store, leaver):
    _megatron_groups()
    world = nccl_delta.current_world()
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])
    t0 = time.perf_counter()
    swap = world.prepare(leaver, SWAP_EPOCH)
    swap.wait(300)
    prepare_s = time.perf_counter() - t0
    report = world.switch(SWAP_EPOCH)
    x = torch.ones(1000, device=_device())
    dist.all_reduce(x)  # the world works after the switch
    return dict(switch_s=report.switch_s, links_touched=report.links_touched, prepare_s=prepare_s,
                ok=bool((x == world_size).all()))


def _switch_leaver(rank, world_size, store, leaver):
    _megatron_groups()
    store.set(f"ready/{rank}", "1")
    store.wait(["left"])
    return {}


def _switch_joiner(rank, world_size, store, leaver):
    _megatron_groups()
    nccl_delta.current_world().join(SWAP_EPOCH)
    x = torch.ones(1000, device=_device())
    dist.all_reduce(x)
    return dict(ok=bool((x == world_size).all()))


def section_switch(args) -> list[dict]:
    rows = []
    for world_size in args.switch_ranks:
        if world_size % 4:
            raise SystemExit(f"--switch-ranks {world_size}: TP2.PP2 needs a multiple of 4 ranks")
        leaver = world_size // 2 + 1  # a middle-of-the-world rank: neighbours on every side
        store, queue = _host_store(), CTX.Queue()
        stayers = [r for r in range(world_size) if r != leaver]
        procs = _spawn(store, world_size, _switch_stayer, (leaver,), queue, ranks=stayers)
        procs += _spawn(store, world_size, _switch_leaver, (leaver,), queue, ranks=[leaver])
        store.wait([f"ready/{r}" for r in range(world_size)])
        store.set("go", "1")
        procs += _spawn(store, world_size, _switch_joiner, (leaver,), queue, ranks=[leaver], join_epoch=SWAP_EPOCH)
        out = _collect(procs[:len(stayers)] + procs[-1:], queue, len(stayers) + 1, args.timeout)
        store.set("left", "1")
        _collect(procs[len(stayers):-1], queue, 1, 30)
        results = [out[r] for r in stayers]
        if not all(r["ok"] for r in results) or not out["joiner"]["ok"]:
            raise RuntimeError(f"wrong all-reduce after the switch at {world_size} ranks")
        row = dict(ranks=world_size, switch_s=round(max(r["switch_s"] for r in results), 6),
                   links_touched=sum(r["links_touched"] for r in results),
                   stayers_touched=sum(1 for r in results if r["links_touched"]),
                   prepare_s=round(max(r["prepare_s"] for r in results), 4))
        rows.append(row)
        print(f"  switch ranks={world_size}: {row}", flush=True)
    return rows


SECTIONS = {"allreduce": section_allreduce, "switch": section_switch}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--sections", default="allreduce,switch", help="comma list of " + ", ".join(SECTIONS))
    p.add_argument("--sizes-mb", type=_floats, default=None, help="all-reduce sizes in MB (default 1,16,64,256)")
    p.add_argument("--ranks", type=_ints, default=None, help="all-reduce world sizes (default 2,4,8)")
    p.add_argument("--switch-ranks", type=_ints, default=None, help="switch world sizes (default 4,8,16)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per point (default 5)")
    p.add_argument("--quick", action="store_true", help="small matrix: 1,16 MB at 2,4 ranks; switch at 4,8")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline per world, seconds")
    args = p.parse_args(argv)
    args.sizes_mb = args.sizes_mb or ([1, 16] if args.quick else [1, 16, 64, 256])
    args.ranks = args.ranks or ([2, 4] if args.quick else [2, 4, 8])
    args.switch_ranks = args.switch_ranks or ([4, 8] if args.quick else [4, 8, 16])
    args.iters = args.iters or (3 if args.quick else 5)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown --sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    payload = {"meta": dict(device=str(_device()), torch=torch.__version__, cpus=os.cpu_count(),
                            transport=_config().resolved_transport(), iters=args.iters)}
    for name in args.sections:
        print(f"[{name}]", flush=True)
        payload[name] = SECTIONS[name](args)
    payload["meta"]["wall_s"] = round(time.time() - started, 1)
    if "allreduce" in payload:
        print_table("all-reduce: nccl_delta vs torch gloo (median of per-iteration max over ranks)",
                    [(r["ranks"], r["bytes"] // MB, f"{r['delta_s']:.4f}", f"{r['gloo_s']:.4f}", r["ratio"])
                     for r in payload["allreduce"]], ("ranks", "MB", "delta_s", "gloo_s", "ratio"))
    if "switch" in payload:
        print_table("phase-2 switch (TP2.PP2, one middle rank replaced)",
                    [(r["ranks"], f"{r['switch_s'] * 1e3:.3f} ms", r["links_touched"], r["stayers_touched"],
                      f"{r['prepare_s']:.3f}") for r in payload["switch"]],
                    ("ranks", "switch", "links_touched", "stayers_touched", "prepare_s"))
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
