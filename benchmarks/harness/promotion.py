"""A job whose ranks can be handed to a new process, for ``benchmarks/warmup.py``.

Every process is forked from the benchmark's parent (torch and megatron
already imported) and runs real megatron-core on nccl_delta over gloo pair
links, rendezvousing on a TCPStore the parent hosts. The parent steers it
through keys under ``ctl/`` in that store:

``plan/<e>``           ``{"rank": r, "switch_at": k}``: at the boundary after iteration k, rank r's
                       process leaves and a newcomer serves r (nccl_delta's planned swap, epoch e)
``ready/<e>``          set by the newcomer once its model is built and it waits in ``join``
``switched/<e>/<q>``   set by stayer q after ``switch(e)``
``received/<e>``       set by the newcomer once it holds the leaver's state; stayers start
                       their next (timed) iteration only then
``release/<e>``        set by the parent after the measured iterations: the leaver may tear down
``stop_at``            every member stops after this iteration
``progress``           the last iteration a member completed

A newcomer is *cold* (it builds its model and joins) or *warm* (it first runs
the general standby's sandbox warm-up of every role, alone, then joins).

The hand-over is the real planned one, minus its timing: at the boundary the
leaver streams its state with ``migration.transfer.send_state`` over a
temporary link and the newcomer takes it with ``recv_state`` exactly as a
promoted standby does (``migration.standby.serve_rank``): its optimizer state
is materialised before its first iteration (not lazily inside the first
step), and it continues the leaver's training bit for bit. The transfer's
duration is left out on purpose: stayers wait for ``received/<e>`` before
they start the timed iteration, so only iteration times are compared. The
leaver then sleeps until ``release/<e>``: its teardown would otherwise run on
the same cores inside the measured iterations, which a leaver on its own
machine (or a dead one) does not do.

Every wait has a deadline; the parent kills children that miss theirs.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import time

CTL = "ctl"
TIMEOUT_S = 600.0


def _stores(port: int):
    from torch.distributed import PrefixStore, TCPStore

    base = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return PrefixStore("job", base), PrefixStore(CTL, base)


def _get(ctl, key: str) -> str | None:
    return ctl.get(key).decode() if ctl.check([key]) else None


def init_delta_world(args, rank: int, world_size: int, store, join_epoch: int | None = None):
    """WORLD and megatron's groups on nccl_delta (as a joiner of ``join_epoch`` if given); the layout."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    import nccl_delta
    import trainmover_ext.patches as patches
    from trainmover_training import global_vars
    from trainmover_training.initialize import layout_from_groups
    from trainmover_training.tokenizer import build_tokenizer

    patches.install()
    global_vars.set_global_variables(args, build_tokenizer(args))
    nccl_delta.register(nccl_delta.DeltaConfig(link_host="127.0.0.1", op_timeout_s=TIMEOUT_S))
    if join_epoch is not None:
        nccl_delta.expect_join(join_epoch)
    dist.init_process_group(
        nccl_delta.BACKEND_NAME,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        create_gloo_process_groups=False,
    )
    return layout_from_groups(
        args,
        rank=rank,
        world_size=world_size,
        local_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
        comm="nccl_delta",
    )


def serve(session, ctl, epoch: int, store=None) -> dict:
    """Train, following the parent's plans, until ``stop_at`` or until this process is replaced.

    ``store`` (the job's store) carries the state-transfer link when this process is replaced."""
    import nccl_delta
    from trainmover_training.training import train_step

    args, rank = session.args, session.layout.rank
    world = nccl_delta.current_world()
    steps: list[dict] = []
    prepared: set[int] = set()
    stop_at: int | None = None
    while True:
        k = args.iteration
        stop_at = stop_at if stop_at is not None else _int(_get(ctl, "stop_at"))
        if stop_at is not None and k >= stop_at:
            return {"left": False, "steps": steps, "epoch": epoch}
        raw = _get(ctl, f"plan/{epoch + 1}")
        if raw is not None:
            plan = json.loads(raw)
            if plan["rank"] != rank and epoch + 1 not in prepared:
                world.prepare(plan["rank"], epoch + 1, joiner=f"newcomer-{epoch + 1}")
                prepared.add(epoch + 1)
            if k == plan["switch_at"]:
                epoch += 1
                if plan["rank"] == rank:  # the leaver: hand the state over, wait for the measurements, go
                    ctl.wait(
                        [f"switched/{epoch}/{q}" for q in range(session.layout.world_size) if q != rank],
                        datetime.timedelta(seconds=TIMEOUT_S),
                    )
                    sent = hand_state_over(session, store, epoch)
                    ctl.wait([f"release/{epoch}"], datetime.timedelta(seconds=TIMEOUT_S))
                    return {"left": True, "steps": steps, "epoch": epoch, "sent_bytes": sent}
                world.switch(epoch, timeout_s=TIMEOUT_S)
                ctl.set(f"switched/{epoch}/{rank}", "1")
                ctl.wait([f"received/{epoch}"], datetime.timedelta(seconds=TIMEOUT_S))  # transfer not timed
        t0, gc0 = time.time(), _GC_CLOCK.total_s
        train_step(session)
        steps.append(
            {"iteration": args.iteration, "t0": t0, "t1": time.time(), "epoch": epoch, "gc_s": _GC_CLOCK.total_s - gc0}
        )
        ctl.set("progress", str(args.iteration))


def _transfer_name(epoch: int) -> str:
    return f"bench/{epoch}/leaver"


def hand_state_over(session, store, epoch: int) -> int:
    """The leaver's side of the planned hand-over (``migration.worker.hand_over``): send every state tensor."""
    from trainmover_ext.migration.transfer import open_transfer_link, send_state

    pg = open_transfer_link(store, _transfer_name(epoch), 0, TIMEOUT_S)
    return send_state(pg, session)


def take_state_over(session, store, epoch: int) -> int:
    """The newcomer's side (``migration.worker.receive_from_leaver``): model, optimizer state, fp32 masters,
    scheduler, RNG, iteration and consumed samples from the leaver; the data iterators are re-pointed."""
    from trainmover_ext.migration.transfer import open_transfer_link, recv_state

    pg = open_transfer_link(store, _transfer_name(epoch), 1, TIMEOUT_S)
    received = recv_state(pg, session)
    session.reset_data()
    return received


class _GcClock:
    """Wall time this process spent in the cyclic garbage collector (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0


_GC_CLOCK = _GcClock()


def _int(raw: str | None) -> int | None:
    return None if raw is None else int(raw)


def background_priority(nice: int) -> None:
    """A warming standby stands for a machine of its own: on shared cores it takes idle cycles only
    (SCHED_IDLE, plus ``nice`` where that policy is unavailable)."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    if nice > 0 and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def foreground_priority() -> None:
    """Back to normal scheduling before joining the job."""
    if hasattr(os, "SCHED_OTHER"):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, 0)


def _own_inductor_cache(tag: str) -> None:
    # Each process stands for a machine of its own: no compiled code shared through /tmp.
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"tm-inductor-{tag}-")


def job_member(rank: int, world_size: int, port: int, argv: list[str], record_dir: str, record_iters: int) -> dict:
    """An original rank: record the first iterations (recorder ranks), then serve until replaced or stopped."""
    from harness.sandbox import parse_job_args
    from trainmover_ext.sandbox.parts import build_parts
    from trainmover_ext.sandbox.recorder import hooks_installed, maybe_start_recording
    from trainmover_ext.sandbox.shadow import default_program
    from trainmover_training.initialize import shutdown

    _own_inductor_cache(f"rank{rank}")
    args = parse_job_args(argv, world_size)
    store, ctl = _stores(port)
    layout = init_delta_world(args, rank, world_size, store)
    try:
        session = build_parts(args, layout, default_program(), consumed_samples=0)
        handle = maybe_start_recording(args, layout, record_dir=record_dir, record_iters=record_iters)
        recorded = _record(session, handle)
        out = serve(session, ctl, epoch=0, store=store)
        out.update(
            rank=rank,
            role=layout.role,
            recorded=recorded,
            hooks_after=hooks_installed(),
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
        return out
    finally:
        shutdown()


def _record(session, handle) -> dict:
    """The recorded iterations (hooks in place), timed; the recorder's own overhead."""
    from trainmover_training.training import train_step

    times = []
    try:
        while handle.active:
            t0 = time.time()
            train_step(session)
            times.append(time.time() - t0)
            handle.after_iteration(session.args.iteration)
    finally:
        handle.close()
    recorder = handle.recorder
    return {
        "iteration_s": times,
        "overhead_s": recorder.overhead_s if recorder else None,
        "role": recorder.role if recorder else None,
        "data_bytes": handle.index["data_bytes"] if handle.index else None,
    }


def warm_only(argv: list[str], world_size: int, record_dir: str, nice: int = 19, duty: float = 1.0) -> dict:
    """A general standby that only warms (all roles, alone) and reports its window: the isolation probe.

    ``duty`` paces it as ``--tm-standby-duty`` does a launched standby (:mod:`.pacing`)."""
    from harness.sandbox import parse_job_args, socket_inodes
    from trainmover_ext.sandbox.pacing import Pacer
    from trainmover_ext.sandbox.recording import load_recordings
    from trainmover_ext.sandbox.shadow import default_program, peak_rss_bytes, warm_standby

    _own_inductor_cache("probe")
    if nice:
        background_priority(nice)
    args = parse_job_args(argv, world_size)
    sockets = socket_inodes()
    pacer = Pacer(duty)
    t0 = time.time()
    warm_standby(args, load_recordings(record_dir), program=default_program(), pacer=pacer)
    return {
        "warm_start": t0,
        "warm_end": time.time(),
        "warm_rss_bytes": peak_rss_bytes(),
        "warm_new_sockets": len(socket_inodes() - sockets),
        "nice": nice,
        "duty": duty,
        "paused_s": pacer.paused_s,
        "steps": [],
    }


def newcomer(
    rank: int,
    world_size: int,
    port: int,
    argv: list[str],
    epoch: int,
    record_dir: str | None,
    warm_nice: int = 19,
    keep_role: str | None = None,
) -> dict:
    """A process that takes over ``rank`` at ``epoch``: warm (sandbox, all roles) when ``record_dir``, else cold.

    A warm one keeps ``keep_role``'s parts (see ``sandbox/adopt.py``): it adopts them when they were
    built as ``rank``, and frees them before it builds the rank's model otherwise."""
    import torch

    from harness.sandbox import parse_job_args, socket_inodes
    from trainmover_ext.runtime.quiet_build import no_collectives
    from trainmover_ext.sandbox.adopt import adopt_or_build, keep_if_fits
    from trainmover_ext.sandbox.parts import build_parts
    from trainmover_ext.sandbox.recording import load_recordings
    from trainmover_ext.sandbox.shadow import default_program, peak_rss_bytes, warm_standby
    from trainmover_training.initialize import shutdown
    from trainmover_training.training import MetricsLog

    _own_inductor_cache(f"newcomer{epoch}")
    args = parse_job_args(argv, world_size)
    program = default_program()
    report: dict = {"rank": rank, "epoch": epoch, "warm": record_dir is not None}
    if record_dir is not None:
        background_priority(warm_nice)
        sockets = socket_inodes()
        t0 = time.time()
        results = warm_standby(args, load_recordings(record_dir), program=program, keep_role=keep_role)
        report.update(
            warm_start=t0,
            warm_end=time.time(),
            warm_rss_bytes=peak_rss_bytes(),
            warm_roles=[r.to_dict() for r in results],
            warm_new_sockets=len(socket_inodes() - sockets),
        )
        kept = next((r.kept for r in results if r.kept is not None), None)
        del results
        foreground_priority()
    else:
        kept = None
    kept, why_not = keep_if_fits(kept, rank)
    store, ctl = _stores(port)
    plan_key = f"plan/{epoch}"
    layout = init_delta_world(args, rank, world_size, store, join_epoch=epoch)
    try:

        def build(why: str):
            with no_collectives():  # nothing to agree on with the job: its state would come by transfer
                return build_parts(args, layout, program, consumed_samples=0)

        session, why_not, report["repointed_groups"] = adopt_or_build(
            kept, layout, MetricsLog(None, False), rank, build, why_not
        )
        report["adopted"] = why_not is None
        args.iteration, args.consumed_train_samples = 0, 0  # the state transfer sets both
        ctl.set(f"ready/{epoch}", "1")
        import nccl_delta

        nccl_delta.current_world().join(epoch)
        ctl.wait([plan_key], datetime.timedelta(seconds=TIMEOUT_S))
        plan = json.loads(ctl.get(plan_key).decode())
        ctl.wait(
            [f"switched/{epoch}/{q}" for q in range(world_size) if q != rank], datetime.timedelta(seconds=TIMEOUT_S)
        )
        report["received_bytes"] = take_state_over(session, store, epoch)
        if session.args.iteration != plan["switch_at"]:
            raise RuntimeError(
                f"newcomer {epoch} took the state of iteration {session.args.iteration}, not {plan['switch_at']}"
            )
        torch.set_num_threads(1)
        ctl.set(f"received/{epoch}", "1")
        report.update(serve(session, ctl, epoch=epoch, store=store))
        report["peak_rss_bytes"] = peak_rss_bytes()
        return report
    finally:
        shutdown()
