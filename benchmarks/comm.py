"""Communicator benchmark: TrainMover's communicator against torch's own groups, side by side in one run.

Sections (each a function registered in ``SECTIONS``; add one to extend the report):
- ``allreduce``: all-reduce time on a group of every rank created under nccl_delta (a native group
  behind nccl_delta's handle, as megatron's groups are) vs a plain torch group on the same ranks, same
  tensors, alternating so that machine noise hits both: ``ratio = delta_s / gloo_s``. ``world_ring_s``:
  the same all-reduce on WORLD, which keeps nccl_delta's ring over links (no training collective runs
  on WORLD; see docs/nccl_delta.md).
- ``replacement``: one middle rank of a megatron TP2.PP2.DPk world replaced by a planned move, at
  several world sizes: the groups rebuilt, their members, whether WORLD was (never), phase 1 and 2
  times, and on a GPU the device memory the pending communicators held
  (``replacement[].{ranks, groups_rebuilt, members_rebuilt, world_rebuilt}``).
- ``training``: the steady iteration of a TP2.PP2.DPk job with ``--trainmover`` over the same job
  without it (plain torch gloo groups), ``--overlap-grad-reduce``, for the demo and the tiny model (and
  the demo model as a mixture of experts, TP1.PP2 with EP 2: ``moe``) at
  4, 8 and 16 ranks. The two jobs alternate ``--training-rounds`` times (default 5); the ratio is the
  median of the rounds' ratios, with the range (``training[].{ranks, model, ratio}``). A third job in
  each round runs ``--trainmover --tm-comm native``: everything of TrainMover but its communicator
  (torch's own groups), so ``ratio_native_comm`` is the share of the cost that is not the communicator.

Ranks are forked from this process (torch already imported), one thread each, on loopback.

    python benchmarks/comm.py --json out.json                 # the full matrix (~20 min on 2 cores)
    python benchmarks/comm.py --quick --json out.json         # a few minutes
    python benchmarks/comm.py --sections replacement --switch-ranks 4,8,16
    python benchmarks/comm.py --sections training --training-ranks 8 --training-models tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shlex
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
from benchmarks.common import measured_at, print_table, write_json  # noqa: E402

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
    native = dist.new_group()  # the default backend: nccl_delta's handle over a native communicator
    device = _device()
    rows = []
    for size_mb in sizes_mb:
        x = torch.ones(int(size_mb * MB) // 4, device=device)
        times = {"delta": [], "gloo": [], "world_ring": []}
        for it in range(iters + 1):  # the first round warms allocators and links up
            for name, group in (("delta", native), ("gloo", ref), ("world_ring", None)):
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
            for name in ("delta", "gloo", "world_ring"):
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
                    world_ring_s=round(timing["world_ring"], 6),
                    ratio=round(timing["delta"] / timing["gloo"], 3),
                    delta_busbw_gbps=round(busbw / timing["delta"] / 1e9, 3),
                    baseline_busbw_gbps=round(busbw / timing["gloo"] / 1e9, 3),
                    device=device,
                    baseline="nccl" if device == "cuda" else "gloo",
                )
            )
            print(
                f"  allreduce ranks={world_size} {size_mb} MB: delta {timing['delta']:.4f}s gloo {timing['gloo']:.4f}s "
                f"world ring {timing['world_ring']:.4f}s",
                flush=True,
            )
    return rows


# --- replacement ------------------------------------------------------------------------------
SWAP_EPOCH = 1


def _megatron_groups():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
    )


def _free_device_bytes() -> int | None:
    if _device().type != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _switch_stayer(rank, world_size, store, leaver):
    _megatron_groups()
    world = nccl_delta.current_world()
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])
    free_before = _free_device_bytes()
    t0 = time.perf_counter()
    swap = world.prepare(leaver, SWAP_EPOCH)
    swap.wait(300)
    prepare_s = time.perf_counter() - t0
    free_pending = _free_device_bytes()
    report = world.switch(SWAP_EPOCH)
    x = torch.ones(1000, device=_device())
    dist.all_reduce(x)  # the world works after the switch
    return dict(
        switch_s=report.switch_s,
        groups=report.groups,
        links_touched=report.links_touched,
        prepare_s=prepare_s,
        pending_bytes=None if free_before is None else free_before - free_pending,
        ok=bool((x == world_size).all()),
    )


def _switch_leaver(rank, world_size, store, leaver):
    _megatron_groups()
    store.set(f"ready/{rank}", "1")
    store.wait(["left"])
    return {}


def _switch_joiner(rank, world_size, store, leaver):
    _megatron_groups()
    world = nccl_delta.current_world()
    world.join(SWAP_EPOCH)
    groups = {
        g.name: g.size for g in world.native_groups() if g.comms
    }  # a group of the whole job waits for its first op
    x = torch.ones(1000, device=_device())
    dist.all_reduce(x)
    return dict(ok=bool((x == world_size).all()), groups=groups)


def section_replacement(args) -> list[dict]:
    """A planned replacement of one middle rank of a TP2.PP2.DPk world: which groups are rebuilt."""
    rows = []
    for world_size in args.switch_ranks:
        if world_size % 4:
            raise SystemExit(f"--switch-ranks {world_size}: TP2.PP2 needs a multiple of 4 ranks")
        _for_world(world_size)
        leaver = world_size // 2 + 1  # a middle-of-the-world rank
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
        # Every group the joiner is in was built anew; a stayer switched exactly those it shares with it.
        rebuilt = dict(out["joiner"]["groups"])
        switched = {name: size for r in results for name, size in r["groups"].items()}
        if set(switched) != set(rebuilt):
            raise RuntimeError(f"stayers switched {sorted(switched)}, the joiner built {sorted(rebuilt)}")
        pending = [r["pending_bytes"] for r in results if r["pending_bytes"] is not None]
        row = dict(
            ranks=world_size,
            device=str(_device().type),
            groups_rebuilt=len(rebuilt),
            members_rebuilt=sum(rebuilt.values()),
            group_sizes=sorted(rebuilt.values()),
            world_rebuilt=any(size == world_size for size in rebuilt.values()),
            stayers_touched=sum(1 for r in results if r["groups"]),
            switch_s=round(max(r["switch_s"] for r in results), 6),
            prepare_s=round(max(r["prepare_s"] for r in results), 4),
            pending_comm_bytes_max=max(pending) if pending else None,
        )
        rows.append(row)
        print(f"  replacement ranks={world_size}: {row}", flush=True)
    for ranks in args.scale_ranks:
        rows.append(_simulated_replacement(ranks))
        print(f"  replacement ranks={ranks} (simulated): {rows[-1]}", flush=True)
    return rows


def _simulated_replacement(ranks: int) -> dict:
    """The same counts at a scale these cores cannot run: megatron-core's own groups for the layout
    (``trainmover simulate --scale-check`` counts them with the real decision code too) and the rule
    nccl_delta applies, for a middle rank."""
    from trainmover_ext.simulate.scale_check import megatron_groups, rebuilt_by

    tp, pp = (4, 5) if ranks % 20 == 0 else (2, 2)
    communicators = [(kind, members) for kind, members in megatron_groups(ranks, tp, pp) if len(members) > 1]
    rebuilt = rebuilt_by(communicators, ranks // 2 + tp + 1, ranks)
    return dict(
        ranks=ranks,
        simulated=True,
        layout=f"TP{tp}.PP{pp}.DP{ranks // (tp * pp)}",
        groups_rebuilt=rebuilt.groups,
        members_rebuilt=rebuilt.members,
        world_rebuilt=rebuilt.world,
        groups_in_job=len(communicators),
    )


# --- training ---------------------------------------------------------------------------------


def _tp(model: str) -> int:
    return 1 if model == "moe" else 2  # megatron-core's MoE layer needs sequence parallelism with TP > 1


def _layout(model: str, ranks: int) -> str:
    tp = _tp(model)
    layout = f"TP{tp}.PP2.DP{ranks // (2 * tp)}"
    return layout + (", EP2 (4 experts, top-2, all-to-all)" if model == "moe" else "") + ", --overlap-grad-reduce"


def training_job_args(model: str, ranks: int, corpus: str, iters: int) -> list[str]:
    """TP2.PP2.DP(ranks/4) of the demo model or of the tiny one (4 layers of 32), or TP1.PP2.DP(ranks/2) of
    the demo model made a mixture of experts (``moe``: ``harness.jobs.MOE_ARGS``)."""
    from harness.jobs import MOE_ARGS, model_args

    if model in ("demo", "moe"):
        flags = model_args(iters=iters) + (MOE_ARGS if model == "moe" else [])
    else:
        flags = model_args(layers=4, hidden=32, heads=4, seq=32, mbs=1, gbs=8, iters=iters)
    return flags + [
        "--tensor-model-parallel-size",
        str(_tp(model)),
        "--pipeline-model-parallel-size",
        "2",
        "--data-path",
        corpus + "_text_document",
        "--tokenizer-type",
        "ByteLevelTokenizer",
        "--overlap-grad-reduce",
    ]


def _train_once(
    trainmover: bool, model: str, ranks: int, args, workdir: str, tag: str, extra: tuple[str, ...] = ()
) -> list[float]:
    """Run the job once, with ``--trainmover`` (its communicator, unless ``extra`` says otherwise) or
    without (plain torch gloo groups); returns the steady iterations' ``iteration_s``."""
    from harness.jobs import ensure_corpus

    corpus = ensure_corpus(os.path.join(workdir, "corpus"))
    metrics = os.path.join(workdir, f"{tag}.metrics.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "launch",
        "--nproc-per-node",
        str(ranks),
        "--run-dir",
        os.path.join(workdir, tag + ".run"),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *training_job_args(model, ranks, corpus, args.training_iters),
        *(["--trainmover", "--tm-standbys", "0", *extra] if trainmover else []),
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
        raise RuntimeError(f"training job {tag} exited {code}; see {workdir}/{tag}.log")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = {r["iteration"]: r["iteration_s"] for r in records if r.get("event") == "iteration"}
    return [times[it] for it in sorted(times) if it > args.training_warmup]


TRAINING_JOBS = {
    "trainmover": (True, ()),
    "plain": (False, ()),
    "native_comm": (True, ("--tm-comm", "native")),  # everything of TrainMover but its communicator
}
"""The jobs of each training round, in order: (--trainmover, extra flags)."""


def section_training(args) -> list[dict]:
    """Per (ranks, model): the steady iteration with --trainmover over the same job without it, the two
    alternating ``--training-rounds`` times so that machine noise hits both; the ratio is the median of
    the rounds' ratios (each round: median over its steady iterations), with the range."""
    workdir = tempfile.mkdtemp(prefix="comm_bench_training_")
    rows = []
    for ranks in args.training_ranks:
        for model in args.training_models:
            rounds = []
            for rnd in range(args.training_rounds):
                its = {
                    name: statistics.median(
                        _train_once(tm, model, ranks, args, workdir, f"{name}_{model}_{ranks}_{rnd}", extra)
                    )
                    for name, (tm, extra) in TRAINING_JOBS.items()
                }
                rounds.append({f"{name}_it_s": round(v, 4) for name, v in its.items()})
                for ratio, name in (("ratio", "trainmover"), ("ratio_native_comm", "native_comm")):
                    rounds[-1][ratio] = round(its[name] / its["plain"], 4)
                print(f"  training {model} ranks={ranks} round {rnd}: {rounds[-1]}", flush=True)
            row = dict(ranks=ranks, model=model, runs=len(rounds), rounds=rounds, layout=_layout(model, ranks))
            for key in ("ratio", "ratio_native_comm"):
                values = [r[key] for r in rounds]
                row[key], row[f"{key}_range"] = round(statistics.median(values), 4), [min(values), max(values)]
            for name in TRAINING_JOBS:
                row[f"{name}_it_s"] = round(statistics.median(r[f"{name}_it_s"] for r in rounds), 4)
            rows.append(row)
    return rows


TRAINING_COLUMNS = tuple("ranks model trainmover_it_s plain_it_s ratio ratio_range ratio_native_comm runs".split())
"""The columns of the training table ``main`` prints."""

SECTIONS = {"allreduce": section_allreduce, "replacement": section_replacement, "training": section_training}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--sections", default="allreduce,replacement,training", help="comma list of " + ", ".join(SECTIONS))
    p.add_argument("--sizes-mb", type=_floats, default=None, help="all-reduce sizes in MB (default 1,16,64,256)")
    p.add_argument("--ranks", type=_ints, default=None, help="all-reduce world sizes (default 2,4,8)")
    p.add_argument("--switch-ranks", type=_ints, default=None, help="replacement world sizes (default 4,8,16)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per point (default 5)")
    p.add_argument(
        "--scale-ranks", type=_ints, default=None, help="simulated replacement sizes (default 100,1000,4000)"
    )
    p.add_argument("--quick", action="store_true", help="small matrix: 1,16 MB at 2,4 ranks; switch at 4,8")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline per world (or training job), seconds")
    p.add_argument("--training-iters", type=int, default=None, help="iterations per training job (default 20)")
    p.add_argument("--training-warmup", type=int, default=3, help="first iterations of a job left out of timing")
    p.add_argument("--training-rounds", type=int, default=None, help="job pairs per point (default 5)")
    p.add_argument("--training-ranks", type=_ints, default=None, help="training world sizes (default 4,8,16)")
    p.add_argument(
        "--training-models",
        default=None,
        help="comma list of demo (the demo job's model), tiny (4 layers of 32) and moe (the demo model with "
        "4 experts, EP 2, the all-to-all dispatcher); default all three",
    )
    args = p.parse_args(argv)
    args.sizes_mb = args.sizes_mb or ([1, 16] if args.quick else [1, 16, 64, 256])
    args.ranks = args.ranks or ([2, 4] if args.quick else [2, 4, 8])
    args.switch_ranks = args.switch_ranks or ([4, 8] if args.quick else [4, 8, 16])
    args.scale_ranks = args.scale_ranks or ([100] if args.quick else [100, 1000, 4000])
    args.iters = args.iters or (3 if args.quick else 5)
    args.training_iters = args.training_iters or (10 if args.quick else 30)
    args.training_rounds = args.training_rounds or (1 if args.quick else 5)
    args.training_ranks = args.training_ranks or ([4] if args.quick else [4, 8, 16])
    args.training_models = (args.training_models or ("tiny" if args.quick else "demo,tiny,moe")).split(",")
    if set(args.training_models) - {"demo", "tiny", "moe"}:
        p.error(f"--training-models: {args.training_models}: each is demo, tiny or moe")
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
        "command": shlex.join(["python", "benchmarks/comm.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": measured_at(),
        "meta": dict(
            device=str(_device()),
            torch=torch.__version__,
            cpus=os.cpu_count(),
            transport=_config().resolved_transport(),
            iters=args.iters,
        ),
    }
    for name in args.sections:
        print(f"[{name}]", flush=True)
        payload[name] = SECTIONS[name](args)
    payload["meta"]["wall_s"] = round(time.time() - started, 1)
    if "allreduce" in payload:
        print_table(
            "all-reduce: a group on nccl_delta vs a plain torch group (median of per-iteration max over ranks)",
            [
                (
                    r["ranks"],
                    r["bytes"] // MB,
                    r["device"],
                    f"{r['delta_s']:.4f}",
                    f"{r['gloo_s']:.4f}",
                    f"{r['world_ring_s']:.4f}",
                    r["ratio"],
                    r["delta_busbw_gbps"],
                    r["baseline_busbw_gbps"],
                )
                for r in payload["allreduce"]
            ],
            (
                "ranks",
                "MB",
                "device",
                "delta_s",
                "native_s",
                "world_ring_s",
                "ratio",
                "delta_busbw_GB/s",
                "native_busbw_GB/s",
            ),
        )
    if "replacement" in payload:
        print_table(
            "a planned replacement (TP2.PP2, one middle rank): what is rebuilt",
            [
                (
                    r["ranks"],
                    r["groups_rebuilt"],
                    r["members_rebuilt"],
                    r["world_rebuilt"],
                    "simulated" if r.get("simulated") else f"{r['switch_s'] * 1e3:.3f} ms",
                    "-" if r.get("simulated") else f"{r['prepare_s']:.3f}",
                )
                for r in payload["replacement"]
            ],
            ("ranks", "groups_rebuilt", "members_rebuilt", "world_rebuilt", "switch", "prepare_s"),
        )
    if "training" in payload:
        print_table(
            "training: steady s/iteration with --trainmover over the same job without it",
            [tuple(r.get(key) for key in TRAINING_COLUMNS) for r in payload["training"]],
            TRAINING_COLUMNS,
        )
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
