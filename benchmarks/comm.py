"""Communicator benchmark: nccl_delta against torch's gloo, side by side in one run.

Sections (each a function registered in ``SECTIONS``; add one to extend the report):
- ``allreduce``: all-reduce time of nccl_delta vs torch gloo on the same ranks, same tensors,
  alternating the two so that machine noise hits both. ``ratio = delta_s / gloo_s``.
- ``switch``: phase-2 switch time and links touched when one rank of a megatron TP2.PP2.DPk
  world is replaced, at several world sizes. ``switch_s`` is the slowest stayer's phase 2;
  ``links_touched`` sums over stayers.
- ``training``: steady time per iteration of the demo job (``pretrain_gpt.py``, TP2.PP2.DP2 on
  8 ranks) with every group on nccl_delta (``--tm-comm nccl_delta``) against plain gloo
  (``--tm-comm native``). The two jobs alternate, ``--training-rounds`` times each, so that
  machine noise hits both; ``ratio = delta_it_s / gloo_it_s`` of the medians over every round's
  steady iterations (the first ``--training-warmup`` of each job are dropped).

Ranks are forked from this process (torch already imported), one thread each, on loopback.

    python benchmarks/comm.py --json out.json                 # the full issue matrix
    python benchmarks/comm.py --quick --json out.json         # ~1 minute on 2 cores
    python benchmarks/comm.py --sizes-mb 64 --ranks 4 --sections allreduce
    python benchmarks/comm.py --sections training --training-iters 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
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


# Set (before forking a world) when CUDA is present but has fewer devices than ranks: NCCL refuses
# two ranks on one device, so such a world runs on CPU with gloo links and says so in its row.
_FORCE_CPU = False


def _on_cuda(world_size: int | None = None) -> bool:
    if not torch.cuda.is_available():
        return False
    return world_size is None or torch.cuda.device_count() >= world_size


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and not _FORCE_CPU
        else torch.device("cpu")
    )


def _config() -> nccl_delta.DeltaConfig:
    overrides = dict(transport="gloo") if _FORCE_CPU else {}
    return nccl_delta.DeltaConfig.from_env(link_host=os.environ.get("NCCL_DELTA_LINK_HOST", "127.0.0.1"), **overrides)


def _for_world(world_size: int) -> str:
    """Pick the device for a world about to be forked; returns its name for the result rows."""
    global _FORCE_CPU
    _FORCE_CPU = torch.cuda.is_available() and not _on_cuda(world_size)
    return str(_device().type)


# --- process plumbing ----------------------------------------------------------------------
def _child(rank, world_size, port, fn, args, queue, join_epoch):
    code = 0
    try:
        torch.set_num_threads(1)
        if torch.cuda.is_available() and not _FORCE_CPU:
            torch.cuda.set_device(rank)
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
    for rank in range(world_size) if ranks is None else ranks:
        proc = CTX.Process(target=_child, args=(rank, world_size, store.port, fn, args, queue, join_epoch), daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def _host_store():
    # The server runs in a process of its own: ranks fork from this one (see host_store_in_own_process).
    from harness.stores import host_store_in_own_process

    return host_store_in_own_process(timeout_s=300.0)


# --- all-reduce -------------------------------------------------------------------------------
def _allreduce_rank(rank, world_size, store, sizes_mb, iters):
    ref = dist.new_group(backend="nccl" if _device().type == "cuda" else "gloo")
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
        device = _for_world(world_size)
        store, queue = _host_store(), CTX.Queue()
        procs = _spawn(store, world_size, _allreduce_rank, (args.sizes_mb, args.iters), queue)
        per_rank = _collect(procs, queue, world_size, args.timeout)
        for k, size_mb in enumerate(args.sizes_mb):
            # An all-reduce ends when its slowest rank ends: take the max over ranks per iteration.
            timing = {}
            for name in ("delta", "gloo"):
                per_iter = zip(*(per_rank[r][k][1][name] for r in range(world_size)), strict=False)
                timing[name] = statistics.median(max(v) for v in per_iter)
            # Bus bandwidth as nccl-tests defines it for all-reduce: bytes * 2(n-1)/n / time.
            busbw = int(size_mb * MB) * 2 * (world_size - 1) / world_size
            rows.append(
                dict(
                    ranks=world_size,
                    bytes=int(size_mb * MB),
                    delta_s=round(timing["delta"], 6),
                    gloo_s=round(timing["gloo"], 6),
                    ratio=round(timing["delta"] / timing["gloo"], 3),
                    delta_busbw_gbps=round(busbw / timing["delta"] / 1e9, 3),
                    baseline_busbw_gbps=round(busbw / timing["gloo"] / 1e9, 3),
                    device=device,
                    baseline="nccl" if device == "cuda" else "gloo",
                )
            )
            print(
                f"  allreduce ranks={world_size} {size_mb} MB: delta {timing['delta']:.4f}s gloo {timing['gloo']:.4f}s",
                flush=True,
            )
    return rows


# --- switch -------------------------------------------------------------------------------------
SWAP_EPOCH = 1


def _megatron_groups():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
    )


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
    return dict(
        switch_s=report.switch_s,
        links_touched=report.links_touched,
        prepare_s=prepare_s,
        ok=bool((x == world_size).all()),
    )


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
        _for_world(world_size)
        leaver = world_size // 2 + 1  # a middle-of-the-world rank: neighbours on every side
        store, queue = _host_store(), CTX.Queue()
        stayers = [r for r in range(world_size) if r != leaver]
        procs = _spawn(store, world_size, _switch_stayer, (leaver,), queue, ranks=stayers)
        procs += _spawn(store, world_size, _switch_leaver, (leaver,), queue, ranks=[leaver])
        store.wait([f"ready/{r}" for r in range(world_size)])
        store.set("go", "1")
        procs += _spawn(store, world_size, _switch_joiner, (leaver,), queue, ranks=[leaver], join_epoch=SWAP_EPOCH)
        out = _collect(procs[: len(stayers)] + procs[-1:], queue, len(stayers) + 1, args.timeout)
        store.set("left", "1")
        _collect(procs[len(stayers) : -1], queue, 1, 30)
        results = [out[r] for r in stayers]
        if not all(r["ok"] for r in results) or not out["joiner"]["ok"]:
            raise RuntimeError(f"wrong all-reduce after the switch at {world_size} ranks")
        row = dict(
            ranks=world_size,
            device=str(_device().type),
            switch_s=round(max(r["switch_s"] for r in results), 6),
            links_touched=sum(r["links_touched"] for r in results),
            stayers_touched=sum(1 for r in results if r["links_touched"]),
            prepare_s=round(max(r["prepare_s"] for r in results), 4),
        )
        rows.append(row)
        print(f"  switch ranks={world_size}: {row}", flush=True)
    return rows


# --- training ---------------------------------------------------------------------------------
def _train_once(comm: str, args, workdir: str, tag: str) -> list[float]:
    """Run the demo job once on ``comm``; returns the steady iterations' ``iteration_s``."""
    from harness.jobs import demo_args, ensure_corpus

    corpus = ensure_corpus(os.path.join(workdir, "corpus"))
    metrics = os.path.join(workdir, f"{tag}.metrics.jsonl")
    job_args = demo_args(corpus, iters=args.training_iters)
    if args.training_layout == "tiny":  # a smaller model for --quick: same layout, 4 layers of 32
        from harness.jobs import model_args

        job_args = model_args(layers=4, hidden=32, heads=4, seq=32, mbs=1, gbs=8, iters=args.training_iters) + [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--data-path",
            corpus + "_text_document",
            "--tokenizer-type",
            "ByteLevelTokenizer",
        ]
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "launch",
        "--nproc-per-node",
        "8",
        "--run-dir",
        os.path.join(workdir, tag + ".run"),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *job_args,
        "--tm-comm",
        comm,
        "--tm-metrics-file",
        metrics,
    ]
    with open(os.path.join(workdir, tag + ".log"), "w") as log:
        code = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        ).returncode
    if code != 0:
        raise RuntimeError(f"training job on {comm} exited {code}; see {workdir}/{tag}.log")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = {r["iteration"]: r["iteration_s"] for r in records if r.get("event") == "iteration"}
    return [times[it] for it in sorted(times) if it > args.training_warmup]


def section_training(args) -> dict:
    workdir = tempfile.mkdtemp(prefix="comm_bench_training_")
    times: dict[str, list[float]] = {"nccl_delta": [], "native": []}
    per_round = []
    for rnd in range(args.training_rounds):
        medians = {}
        for comm in ("nccl_delta", "native"):
            steady = _train_once(comm, args, workdir, f"{comm}_{rnd}")
            times[comm] += steady
            medians[comm] = statistics.median(steady)
        per_round.append(dict(delta_it_s=round(medians["nccl_delta"], 4), gloo_it_s=round(medians["native"], 4)))
        print(f"  training round {rnd}: {per_round[-1]}", flush=True)
    delta, gloo = statistics.median(times["nccl_delta"]), statistics.median(times["native"])
    return dict(
        delta_it_s=round(delta, 4),
        gloo_it_s=round(gloo, 4),
        ratio=round(delta / gloo, 3),
        layout="TP2.PP2.DP2 (8 ranks)",
        model=args.training_layout,
        iters=args.training_iters,
        warmup=args.training_warmup,
        rounds=per_round,
        workdir=workdir,
    )


SECTIONS = {"allreduce": section_allreduce, "switch": section_switch, "training": section_training}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--sections", default="allreduce,switch,training", help="comma list of " + ", ".join(SECTIONS))
    p.add_argument("--sizes-mb", type=_floats, default=None, help="all-reduce sizes in MB (default 1,16,64,256)")
    p.add_argument("--ranks", type=_ints, default=None, help="all-reduce world sizes (default 2,4,8)")
    p.add_argument("--switch-ranks", type=_ints, default=None, help="switch world sizes (default 4,8,16)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per point (default 5)")
    p.add_argument("--quick", action="store_true", help="small matrix: 1,16 MB at 2,4 ranks; switch at 4,8")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline per world (or training job), seconds")
    p.add_argument("--training-iters", type=int, default=None, help="iterations per training job (default 20)")
    p.add_argument("--training-warmup", type=int, default=3, help="first iterations of a job left out of timing")
    p.add_argument("--training-rounds", type=int, default=None, help="delta/gloo job pairs (default 2)")
    p.add_argument(
        "--training-layout",
        choices=["demo", "tiny"],
        default=None,
        help="demo: the demo job's model (default); tiny: 4x32 layers (--quick)",
    )
    args = p.parse_args(argv)
    args.sizes_mb = args.sizes_mb or ([1, 16] if args.quick else [1, 16, 64, 256])
    args.ranks = args.ranks or ([2, 4] if args.quick else [2, 4, 8])
    args.switch_ranks = args.switch_ranks or ([4, 8] if args.quick else [4, 8, 16])
    args.iters = args.iters or (3 if args.quick else 5)
    args.training_iters = args.training_iters or (10 if args.quick else 20)
    args.training_rounds = args.training_rounds or (1 if args.quick else 2)
    args.training_layout = args.training_layout or ("tiny" if args.quick else "demo")
    if args.training_iters <= args.training_warmup:
        p.error("--training-iters must exceed --training-warmup")
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown --sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    payload = {
        "meta": dict(
            device=str(_device()),
            torch=torch.__version__,
            cpus=os.cpu_count(),
            transport=_config().resolved_transport(),
            iters=args.iters,
        )
    }
    for name in args.sections:
        print(f"[{name}]", flush=True)
        payload[name] = SECTIONS[name](args)
    payload["meta"]["wall_s"] = round(time.time() - started, 1)
    if "allreduce" in payload:
        print_table(
            "all-reduce: nccl_delta vs the native backend (median of per-iteration max over ranks)",
            [
                (
                    r["ranks"],
                    r["bytes"] // MB,
                    r["device"],
                    f"{r['delta_s']:.4f}",
                    f"{r['gloo_s']:.4f}",
                    r["ratio"],
                    r["delta_busbw_gbps"],
                    r["baseline_busbw_gbps"],
                )
                for r in payload["allreduce"]
            ],
            ("ranks", "MB", "device", "delta_s", "native_s", "ratio", "delta_busbw_GB/s", "native_busbw_GB/s"),
        )
    if "switch" in payload:
        print_table(
            "phase-2 switch (TP2.PP2, one middle rank replaced)",
            [
                (
                    r["ranks"],
                    f"{r['switch_s'] * 1e3:.3f} ms",
                    r["links_touched"],
                    r["stayers_touched"],
                    f"{r['prepare_s']:.3f}",
                )
                for r in payload["switch"]
            ],
            ("ranks", "switch", "links_touched", "stayers_touched", "prepare_s"),
        )
    if "training" in payload:
        t = payload["training"]
        print_table(
            f"training: {t['layout']}, {t['model']} model, steady s/iteration (median)",
            [(t["delta_it_s"], t["gloo_it_s"], t["ratio"])],
            ("delta_it_s", "gloo_it_s", "ratio"),
        )
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
