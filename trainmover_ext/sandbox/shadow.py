"""Shadow iterations: warm a role in this process against its recording.

Who calls it: a standby process (``--tm-role standby``) before it joins the
job, with the job's own flags. :func:`warm_up` builds the role's model with
``trainmover_training``'s builders (``get_model``, ``setup_optimizer``, the
role's real data iterator), runs shadow iterations through the very
``train_step`` the job runs, and tears the replay world down so the process
can later init the real world. :func:`warm_standby` does that for first,
middle and last in turn; asked to keep one role, it warms that role last and
keeps its parts (model, optimizer, scheduler, dataset) for a promotion into
that role's recorded rank (``sandbox/adopt.py``).

What it warms: imports, model build, the allocator, autograd, the data loader
and dataset index, ``torch.compile`` (``--tm-compile``); on GPU also the CUDA
context and kernels. What it guarantees: on CPU, shadow iteration k of a role
gives bit-identical loss and gradients to the rank that recorded iteration k,
provided the job recorded from its initial weights (iteration 0).

Failure: :class:`ConfigMismatch` before anything is built when the standby's
flags or library versions differ from the job's; :class:`RecordingCorrupt`
for a bad recording; :class:`ReplayMismatch` when a call differs from the
recording. The replay world is destroyed on every exit path.
"""

from __future__ import annotations

import gc
import importlib.util
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainmover_ext.errors import ConfigError

from .adopt import KeptRole, kept_from
from .fingerprint import check_compatible, job_fingerprint
from .parts import build_parts
from .recording import Recording
from .replay import replay_world

if TYPE_CHECKING:
    from .pacing import Pacer


@dataclass(kw_only=True)
class ShadowProgram:
    """The user's training program: the three callables ``pretrain_gpt.py`` hands to ``pretrain``."""

    model_provider: Callable
    """``model_provider(pre_process, post_process, vp_stage)`` -> one model chunk."""
    forward_step_func: Callable
    """``forward_step(data_iterator, model)`` -> (output, loss function)."""
    dataset_provider: Callable
    """``train_valid_test_datasets_provider(num_samples)`` -> (train, valid, test)."""


def program_from_providers(providers: tuple) -> ShadowProgram:
    """From ``pretrain``'s ``(model_provider, dataset_provider, forward_step_func)`` tuple."""
    model_provider, dataset_provider, forward_step_func = providers
    return ShadowProgram(
        model_provider=model_provider, forward_step_func=forward_step_func, dataset_provider=dataset_provider
    )


def default_program() -> ShadowProgram:
    """The providers of the installed ``pretrain_gpt.py`` (what a standby of this job runs)."""
    found = importlib.util.find_spec("pretrain_gpt")
    if found is None or found.origin is None:
        raise ConfigError("pretrain_gpt.py is not installed: run `pip install -e .` from the TrainMover checkout")
    spec = importlib.util.spec_from_file_location("trainmover_pretrain_gpt", found.origin)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return ShadowProgram(
        model_provider=module.model_provider,
        forward_step_func=module.forward_step,
        dataset_provider=module.train_valid_test_datasets_provider,
    )


@dataclass(kw_only=True)
class ShadowProgress:
    """Passed to ``on_progress`` after each shadow iteration."""

    role: str
    iteration: int
    """The recorded job iteration this shadow iteration replayed."""
    loss: float | None
    """DP-averaged loss (last stage only), exactly as the job's ``train_step`` returns it."""
    iteration_s: float
    model: list = field(repr=False)
    """The DDP-wrapped chunks, for inspection (gradients stay in ``param.main_grad``)."""
    optimizer: Any = field(repr=False)


@dataclass(kw_only=True)
class WarmResult:
    """What one role's warm-up did and cost."""

    role: str
    rank: int
    """The job rank this standby played (the recording's rank)."""
    build_s: float
    """Replay world + model + optimizer + data iterator build."""
    iteration_s: list[float]
    """Each shadow iteration's wall time; the first one carries the lazy initialisation."""
    losses: list[float | None]
    total_s: float
    setup_calls: int
    """Collectives answered locally while building (not recorded by the job)."""
    replayed_calls: int
    replayed_bytes: int
    compiled: bool
    peak_rss_bytes: int
    """This process's peak resident set size so far."""
    kept: KeptRole | None = field(default=None, repr=False)
    """The role's parts, when kept (they hold the destroyed replay groups until :func:`~.adopt.adopt`)."""

    def to_dict(self) -> dict:
        """JSON-able summary (without the kept parts), e.g. for the member record in etcd."""
        return {**{k: v for k, v in self.__dict__.items() if k != "kept"}, "kept": self.kept is not None}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ensure_globals(args) -> None:
    """The providers read ``get_args()`` / ``get_tokenizer()``; a bare standby may not have set them."""
    from trainmover_training import global_vars
    from trainmover_training.tokenizer import build_tokenizer

    if global_vars._ARGS is not args or global_vars._TOKENIZER is None:
        tokenizer = build_tokenizer(args)
        global_vars.set_global_variables(args, tokenizer)
    elif getattr(args, "padded_vocab_size", None) is None:
        build_tokenizer(args)


def shadow_device(backend: str) -> torch.device:
    """Where shadow iterations of a job on ``backend`` run: where the job's ranks do. A job on NCCL
    trains on CUDA (its bf16/fp16 optimizer takes CUDA parameters only), so the standby's shadow model
    is built on this process's current CUDA device; a job on gloo trains on the CPU."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("the recording is of a job on NCCL (CUDA), and this standby sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _layout_from_mpu(args, recording: Recording):
    from trainmover_training.initialize import layout_from_groups

    # The job's backend decides megatron's p2p batching and the device; replay the job's choice, not ours.
    backend = recording.index["layout"]["backend"]
    device = shadow_device(backend)
    return layout_from_groups(
        args,
        rank=recording.rank,
        world_size=recording.world_size,
        local_rank=device.index or 0,
        device=device,
        backend=backend,
        comm=recording.index["layout"].get("comm") or "",
    )


def warm_up(
    args,
    role: str,
    recording: Recording,
    iters: int | None = None,
    on_progress: Callable[[ShadowProgress], None] | None = None,
    *,
    program: ShadowProgram | None = None,
    keep_model: bool = False,
    interrupt: Callable[[], bool] | None = None,
) -> WarmResult:
    """Run ``iters`` shadow iterations of ``role`` (default: every recorded one) in this process.

    ``args`` are the job's parsed flags (``parse_args``), ``recording`` the
    role's opened recording. With ``args.tm_compile`` the model is compiled
    (``get_model`` does it), exactly as in the job.
    The process must not have a process group; it has none again on return.
    ``interrupt``, asked at every replayed call, ends a shadow iteration mid-way with
    :class:`WarmUpStopped` (the model is dropped).
    """
    import trainmover_ext.patches as patches

    t_start = time.perf_counter()
    _ensure_globals(args)
    check_compatible(recording.fingerprint, job_fingerprint(args), role=role)
    if recording.role != role:
        raise ConfigError(f"the recording opened for role {role!r} is role {recording.role!r}")
    program = program or default_program()
    compile = bool(getattr(args, "tm_compile", False))
    iters = recording.index["iterations"] if iters is None else iters
    if iters < 1:
        raise ConfigError("warm_up needs iters >= 1")
    patches.install()
    saved_position = (getattr(args, "iteration", 0), getattr(args, "consumed_train_samples", 0))
    try:
        return _shadow_iterations(
            args, role, recording, iters, on_progress, program, compile, keep_model, t_start, interrupt
        )
    finally:
        args.iteration, args.consumed_train_samples = saved_position  # train_step advances them


def _shadow_iterations(
    args, role, recording, iters, on_progress, program, compile, keep_model, t_start, interrupt=None
) -> WarmResult:
    from trainmover_training.initialize import initialize_model_parallel
    from trainmover_training.training import train_step

    timeout_s = 60.0 * args.distributed_timeout_minutes
    with replay_world(recording, timeout_s=timeout_s, interrupt=interrupt) as replay:
        initialize_model_parallel(args)
        layout = _layout_from_mpu(args, recording)
        session = build_parts(
            args,
            layout,
            program,
            consumed_samples=recording.index["consumed_samples"],
            iteration=recording.index["start_iteration"],
        )
        model, optimizer = session.model, session.optimizer
        build_s = time.perf_counter() - t_start
        times: list[float] = []
        losses: list[float | None] = []
        for step in range(iters):
            # Beyond the recording, repeat it: same shapes and call order, values no longer the job's.
            iteration = replay.iterations[step % len(replay.iterations)]
            if step and step % len(replay.iterations) == 0:
                replay.rewind()
            replay.begin_iteration(iteration)
            t0 = time.perf_counter()
            try:
                loss = train_step(session)
            except Exception as exc:
                if replay.interrupted:  # raised by a replayed call, maybe wrapped by autograd or the schedule
                    raise WarmUpStopped(f"{role} shadow iteration {iteration}: the standby was promoted") from exc
                raise
            dt = time.perf_counter() - t0
            replay.end_iteration(iteration)
            times.append(dt)
            losses.append(loss)
            if on_progress is not None:
                on_progress(
                    ShadowProgress(
                        role=role, iteration=iteration, loss=loss, iteration_s=dt, model=model, optimizer=optimizer
                    )
                )
        result = WarmResult(
            role=role,
            rank=recording.rank,
            build_s=build_s,
            iteration_s=times,
            losses=losses,
            total_s=0.0,
            setup_calls=replay.setup_calls,
            replayed_calls=replay.replayed_calls,
            replayed_bytes=replay.replayed_bytes,
            compiled=compile,
            peak_rss_bytes=0,
            kept=kept_from(session, role, recording.rank, replay.groups, replay.members) if keep_model else None,
        )
        del session, optimizer, model
    gc.collect()
    result.total_s = time.perf_counter() - t_start
    result.peak_rss_bytes = peak_rss_bytes()
    return result


def release_free_memory() -> bool:
    """Give the allocator's free pages back to the OS (glibc ``malloc_trim(0)``); False where unavailable.

    Between two roles a standby frees one role's model and builds the next: without this, the freed
    holes the next build cannot reuse stay resident and raise the standby's peak RSS above a rank's.

    The symbol is looked up in the process itself (``dlopen(NULL)``), not through
    ``ctypes.util.find_library``, which runs ``ldconfig`` in a child process: with that lookup the
    launched standby of ``test_launch.py`` lost its etcd lease while warming (3 runs of 3), without
    it it kept it."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False  # not glibc
    return bool(trim(0))


def warm_standby(
    args,
    recordings: dict[str, Recording],
    *,
    keep_role: str | None = None,
    iters: int | None = None,
    program: ShadowProgram | None = None,
    on_progress: Callable[[ShadowProgress], None] | None = None,
    on_role_done: Callable[[WarmResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pacer: Pacer | None = None,
) -> list[WarmResult]:
    """The general standby: warm every recorded role (first, middle, last order) in turn.

    Each role's model is dropped before the next is built, and the freed
    pages go back to the OS (:func:`release_free_memory`) before the next
    role, so peak memory is one role's, not three; after the last role they
    stay with the allocator, for the promoted rank's build. After each role
    what is left alive is frozen (:func:`freeze_warm_objects`). ``keep_role``
    (default: none) is warmed last and its parts are kept in its result
    (``WarmResult.kept``), so the peak is still one role's; they are not frozen,
    so that freeing them collects only them. Every
    config is checked against every
    recording before anything is built. ``should_stop`` is asked before each
    role, after each shadow iteration and at each replayed call inside one (a standby promoted
    mid-way stops warming at its next collective; the interrupted role is dropped, not reported,
    and its kept parts too); ``on_role_done`` is
    called after each. ``pacer`` (``--tm-standby-duty``, see :mod:`.pacing`)
    pauses after every shadow iteration and every role as its budget needs.
    """
    order = [r for r in ("only", "first", "middle", "last") if r in recordings]
    if not order:
        raise ConfigError("no recordings to warm up from: the job has not recorded any role yet")
    if keep_role is not None:
        if keep_role not in order:
            raise ConfigError(f"cannot keep the {keep_role!r} role: this job's roles are {order}")
        order = [r for r in order if r != keep_role] + [keep_role]  # warmed last: never beside another model
    _ensure_globals(args)
    mine = job_fingerprint(args)
    for role in order:
        check_compatible(recordings[role].fingerprint, mine, role=role)
    program = program or default_program()
    if pacer is not None or should_stop is not None:

        def on_progress(progress: ShadowProgress, _user=on_progress) -> None:
            if _user is not None:
                _user(progress)
            if should_stop is not None and should_stop():
                raise WarmUpStopped  # unwinds the replay world; the role's model is dropped
            if pacer is not None:
                pacer.pace()

    results = []
    for i, role in enumerate(order):
        if should_stop is not None and should_stop():
            break
        if i:
            release_free_memory()  # the previous role's model is gone (warm_up collected it)
        keep = role == keep_role
        if keep:
            # Freeze everything alive now, but not the kept parts built next: a promotion into another
            # rank frees them with one collection over what is not frozen (a few ms), instead of
            # thawing the whole warm-up (0.1-1 s holding the GIL, on the critical path).
            gc.collect()
            freeze_warm_objects()
        try:
            results.append(
                warm_up(
                    args,
                    role,
                    recordings[role],
                    iters,
                    on_progress,
                    program=program,
                    keep_model=keep,
                    interrupt=should_stop,
                )
            )
        except WarmUpStopped:
            gc.collect()  # the interrupted role's model and optimizer
            break
        if not keep:
            freeze_warm_objects()
        if pacer is not None:
            pacer.pace()
        if on_role_done is not None:
            on_role_done(results[-1])
    return results


class WarmUpStopped(Exception):
    """Raised when ``should_stop`` says the standby was promoted: between two shadow iterations, or at a
    replayed call inside one."""


def freeze_warm_objects() -> int:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``); call it right
    after a collection (``warm_up`` ends with one), so that no garbage is frozen.

    The warm-up leaves a few hundred thousand long-lived objects (modules, compiled code, caches). A
    full collection walks all of them, holding the GIL: on the 2-core machine 0.1-1 s, which a
    promoted rank would pay inside whichever iteration triggers it (and which can starve a standby's
    lease-refresh thread). Frozen objects are skipped by every later collection; the promoted rank's
    own objects are still collected. Returns the number of frozen objects."""
    gc.freeze()
    return gc.get_freeze_count()
