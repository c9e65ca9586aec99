"""Fault injection for failure drills: a rank kills, stops or hangs itself at an exact point.

``--tm-inject-fault RANK:ITERATION:PHASE[:KILL|STOP|HANG]`` makes the process serving
logical rank RANK send itself SIGKILL (default) or SIGSTOP, or block its main thread for good
while its background threads (lease, heartbeat) live on (HANG: what a deadlock, a stuck data
loader or a stuck kernel look like), while running iteration ITERATION (1-based), in PHASE:

- ``forward``: inside the forward pass of the second micro-batch (or the first, if only one);
- ``backward``: when the first parameter gradient of the iteration is produced;
- ``allreduce``: when the data-parallel gradient reduction starts;
- ``clip``: at the start of the optimizer step, before its gradient-norm
  all-reduce: this rank's model-parallel group cannot step, while the other
  data-parallel replicas do, so the replicas of every shard end one step apart;
- ``step``: inside the optimizer step, after the gradient-norm all-reduce and
  before any parameter changes (other data-parallel replicas may finish it);
- ``in-reduce``: inside the data-parallel gradient reduction: right after this rank
  issued its first all-reduce or reduce-scatter on its data-parallel group, so its
  peers are in the same collective when it dies;
- ``in-norm``: inside the gradient-norm all-reduce: right after this rank issued the
  optimizer step's first all-reduce;
- ``in-gather``: inside the distributed optimizer's parameter all-gather: right after
  this rank issued the first all-gather after its optimizer step (the other
  data-parallel ranks have stepped their shards). Needs ``--use-distributed-optimizer``.
- ``mirror``: in the distributed optimizer's mirror copy after the step (its record sent, its shard
  not): the holder never commits this iteration's copy. Needs ``--use-distributed-optimizer``;
- ``log``: after the optimizer and scheduler steps, before the iteration's
  metrics record is written (the iteration is complete everywhere else);
- ``save``: during the checkpoint save after ITERATION (ITERATION counts
  completed steps here), once this rank wrote its file and before the ranks
  agree the checkpoint is complete.

Only the original worker injects these: a standby that later serves the rank does not.

Migration phases: here ITERATION names the membership **epoch** whose migration
the process is in, and any process serving RANK then (a promoted standby too) fires:

- ``join``: the standby promoted into RANK at that epoch dies right after its
  promotion, while the other ranks build their links to it;
- ``recover``: RANK dies in that epoch's recovery before it reports what it
  holds, while the others rebuild their links and wait for the convergence
  (which cannot come: no rank completes that epoch);
- ``send``: RANK dies in that epoch's recovery while it sends its state to a
  rank that needs a copy (after the metadata, before the tensors);
- ``prepare``: the leaver of that planned epoch dies in phase 1 (the plan is
  known, the hand-over has not begun);
- ``handover``: the leaver of that planned epoch dies in phase 2, while it
  sends its state to the joiner (after the metadata, before the tensors).

Several drills are given comma-separated: ``1:6:backward,6:6:backward``.

State-transfer drills, set in the environment of the job (they exercise the checks of
:mod:`trainmover_ext.migration.transfer` against a careless or hostile source):

- :data:`DRILL_EXTRA_COPY_ENV` ``=1``: a state source keeps one extra full copy of the state while
  it sends (what a careless staging would cost); the transfer's memory report must show it.
- :data:`DRILL_FORGED_STATE_ENV` ``=KIND:EPOCH[:MARKER]``: every state source of failure epoch
  EPOCH sends a crafted metadata record. KIND ``pickle`` sends a pickle whose loading would run
  ``touch MARKER``; ``shapes`` announces a first tensor of another shape; ``count`` one tensor
  fewer. The target must refuse it, and the job recovers through the next plan.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainmover_ext.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from trainmover_training.training import Session

TRAINING_PHASES = ("forward", "backward", "allreduce", "clip", "step", "mirror", "log", "save")
IN_COLLECTIVE_PHASES = ("in-reduce", "in-norm", "in-gather")
"""Drills that strike right after this rank issued a collective on TrainMover's communicator."""
MIGRATION_PHASES = ("join", "recover", "send", "prepare", "handover")
PHASES = TRAINING_PHASES + IN_COLLECTIVE_PHASES + MIGRATION_PHASES

_armed: list[FaultSpec] = []
"""The migration-phase drills of this process (see :func:`arm` and :func:`at`)."""
_mirror_drills: list[FaultSpec] = []
"""This original worker's ``mirror`` drills (:func:`mirror_point`)."""


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Where and how a rank fails."""

    rank: int
    iteration: int
    phase: str
    sig: signal.Signals = signal.SIGKILL
    hang: bool = False
    """Block the main thread instead of sending ``sig``."""

    @property
    def what(self) -> str:
        return "a main-thread hang" if self.hang else self.sig.name

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        parts = text.split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            how = parts[3].upper() if len(parts) == 4 else "KILL"
            hang = how == "HANG"
            sig = signal.SIGKILL if hang else signal.Signals["SIG" + how.removeprefix("SIG")]
            spec = cls(rank=int(parts[0]), iteration=int(parts[1]), phase=parts[2], sig=sig, hang=hang)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"--tm-inject-fault {text!r}: expected RANK:ITERATION:PHASE[:KILL|STOP|HANG]") from exc
        if spec.phase not in PHASES:
            raise ConfigError(f"--tm-inject-fault phase {spec.phase!r} is not one of {', '.join(PHASES)}")
        if spec.sig not in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError("--tm-inject-fault's last field must be KILL, STOP or HANG")
        return spec

    @classmethod
    def parse_all(cls, text: str) -> list[FaultSpec]:
        """Every comma-separated drill of ``--tm-inject-fault``."""
        return [cls.parse(part.strip()) for part in text.split(",") if part.strip()]


DRILL_EXTRA_COPY_ENV = "TRAINMOVER_DRILL_EXTRA_STATE_COPY"
DRILL_FORGED_STATE_ENV = "TRAINMOVER_DRILL_FORGED_STATE"
FORGED_KINDS = ("pickle", "shapes", "count")


def extra_state_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The extra copy a state source keeps while it sends, under :data:`DRILL_EXTRA_COPY_ENV`; else None."""
    if os.environ.get(DRILL_EXTRA_COPY_ENV) != "1":
        return None
    return [t.detach().clone() for t in tensors]


def forged_kind(epoch: int) -> str | None:
    """The crafted record this process's state source must send at ``epoch`` (:data:`DRILL_FORGED_STATE_ENV`)."""
    parts = os.environ.get(DRILL_FORGED_STATE_ENV, "").split(":")
    if len(parts) < 2 or parts[0] not in FORGED_KINDS or not parts[1].isdigit() or int(parts[1]) != epoch:
        return None
    return parts[0]


class _RunsCode:
    """What a hostile peer pickles: loading it would run a shell command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def forger(kind: str) -> Callable[[dict[str, Any]], dict[str, Any] | bytes]:
    """What turns a state source's true metadata record (with its ``format`` and ``version``) into the
    crafted one of ``kind``."""

    def forge(meta: dict[str, Any]) -> dict[str, Any] | bytes:
        if kind == "pickle":  # the record's own header, so that only the pickle is wrong
            marker = os.environ.get(DRILL_FORGED_STATE_ENV, "").split(":", 2)[2:] or ["/tmp/trainmover_forged_ran"]
            return pickle.dumps({"format": meta["format"], "version": meta["version"], "x": _RunsCode(marker[0])})
        if kind == "shapes":
            meta["manifest"][0][0] = [d + 1 for d in meta["manifest"][0][0]]
        elif kind == "count":
            meta["manifest"] = meta["manifest"][:-1]
        return meta

    return forge


def strike(spec: FaultSpec, where: str) -> None:
    """Say so (with the wall time: benchmarks time detection from it), then send ``spec``'s signal to this
    process, or with ``hang`` block the calling thread for good."""
    print(
        f"[trainmover] fault drill: rank {spec.rank} strikes itself with {spec.what} {where} at t={time.time():.3f}",
        flush=True,
    )
    if not spec.hang:
        os.kill(os.getpid(), spec.sig)
        return
    while True:  # the drill: only a fence (SIGKILL) ends this thread
        time.sleep(3600)


def arm(specs: list[FaultSpec], world_size: int) -> None:
    """Arm the migration-phase drills of ``specs`` in this process (any role; call once)."""
    for spec in specs:
        if spec.phase in MIGRATION_PHASES:
            if not 0 <= spec.rank < world_size:
                raise ConfigError(
                    f"--tm-inject-fault names rank {spec.rank}, but the job has ranks 0..{world_size - 1}"
                )
            if spec.iteration < 1:
                raise ConfigError(
                    f"--tm-inject-fault phase {spec.phase} names epoch {spec.iteration}; epochs start at 1"
                )
            _armed.append(spec)


def at(phase: str, *, rank: int, epoch: int) -> None:
    """A migration-phase point: the process dies here if a drill names it (see the module docstring)."""
    for spec in _armed:
        if spec.phase == phase and spec.rank == rank and spec.iteration == epoch:
            strike(spec, f"({phase}, epoch {epoch})")


def mirror_point(*, rank: int, iteration: int) -> None:
    """The mirror copy of ``iteration`` is under way on ``rank``: it dies here if a drill names it."""
    for spec in _mirror_drills:
        if spec.rank == rank and spec.iteration == iteration:
            strike(spec, f"(mirror, iteration {iteration})")


def install(specs: list[FaultSpec], session: Session) -> None:
    """Arm ``specs`` on this process (call once, on the original worker): the training-phase drills
    that name its rank, and every migration-phase drill (:func:`arm`).

    A rank outside the world or an iteration beyond ``--train-iters`` would never fire: that is a
    :class:`ConfigError` on every rank, not a drill that silently does nothing."""
    arm(specs, session.layout.world_size)
    for spec in specs:
        if spec.phase in TRAINING_PHASES:
            _install_one(spec, session)
        elif spec.phase in IN_COLLECTIVE_PHASES:
            _check_bounds(spec, session)
            if session.layout.rank == spec.rank:
                _install_in_collective(spec, session)


def _check_bounds(spec: FaultSpec, session: Session) -> None:
    world, iters = session.layout.world_size, session.args.train_iters
    if not 0 <= spec.rank < world:
        raise ConfigError(f"--tm-inject-fault names rank {spec.rank}, but the job has ranks 0..{world - 1}")
    if not 1 <= spec.iteration <= iters:
        raise ConfigError(
            f"--tm-inject-fault names iteration {spec.iteration}, but the job trains iterations "
            f"1..{iters} (--train-iters)"
        )
    if spec.phase in ("in-gather", "mirror") and not getattr(session.args, "use_distributed_optimizer", False):
        raise ConfigError(
            f"--tm-inject-fault phase {spec.phase} needs --use-distributed-optimizer (it has no "
            f"{'all-gather' if spec.phase == 'in-gather' else 'mirror'} otherwise)"
        )


def _install_in_collective(spec: FaultSpec, session: Session) -> None:
    """Strike right after this rank issued the named collective (see the module docstring)."""
    from megatron.core import parallel_state as mpu

    from nccl_delta import native_group

    if session.layout.comm != "nccl_delta":
        raise ConfigError(f"--tm-inject-fault phase {spec.phase} needs TrainMover's communicator (--trainmover)")
    args = session.args
    import torch.distributed as dist

    dp_members = list(dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True)))
    stage = {"backward": False, "step": False}

    def mark(name: str) -> Callable[[Any], Any]:
        def hook(value: Any) -> Any:
            if args.iteration + 1 == spec.iteration:
                stage[name] = True
            return value

        return hook

    param = next(p for chunk in session.model for p in chunk.parameters() if p.requires_grad)
    param.register_hook(mark("backward"))
    inner_opt_step = session.optimizer.step

    def opt_step(*a: Any, **kw: Any) -> Any:
        mark("step")(None)
        return inner_opt_step(*a, **kw)

    session.optimizer.step = opt_step

    def observe(group: native_group.NativeGroup, op: str) -> None:
        if args.iteration + 1 != spec.iteration:
            return
        hit = (
            (
                spec.phase == "in-reduce"
                and stage["backward"]
                and not stage["step"]
                and group.members == dp_members
                and op.startswith(("allreduce", "reduce_scatter"))
            )
            or (spec.phase == "in-norm" and stage["step"] and op.startswith("allreduce"))
            or (spec.phase == "in-gather" and stage["step"] and op.startswith("all_gather"))
        )
        if hit:
            native_group.observe_issues(None)
            time.sleep(0.005)  # the op is under way on gloo's worker, and the peers are in it
            strike(spec, f"inside {op} of group {group.members} (iteration {spec.iteration})")

    native_group.observe_issues(observe)


def _install_one(spec: FaultSpec, session: Session) -> None:
    _check_bounds(spec, session)
    if session.layout.rank != spec.rank:
        return
    args = session.args

    def fire(phase: str) -> None:
        running = args.iteration if phase == "save" else args.iteration + 1
        if phase == spec.phase and running == spec.iteration:
            strike(spec, f"({phase}, iteration {running})")

    if spec.phase == "forward":
        inner = session.forward_step_func
        calls = {"n": 0, "iter": -1}

        def forward_step(data_iterator: Any, model: Any) -> Any:
            if calls["iter"] != args.iteration:
                calls["iter"], calls["n"] = args.iteration, 0
            calls["n"] += 1
            if calls["n"] == min(2, args.num_microbatches):
                fire("forward")
            return inner(data_iterator, model)

        session.forward_step_func = forward_step
    elif spec.phase == "backward":
        param = next(p for chunk in session.model for p in chunk.parameters() if p.requires_grad)

        def on_grad(grad: torch.Tensor) -> torch.Tensor:
            fire("backward")
            return grad

        param.register_hook(on_grad)
    elif spec.phase == "allreduce":
        from megatron.core.utils import get_model_config

        config = get_model_config(session.model[0])
        inner_finalize = config.finalize_model_grads_func

        def finalize(*a: Any, **kw: Any) -> Any:
            fire("allreduce")
            return inner_finalize(*a, **kw)

        config.finalize_model_grads_func = finalize
    elif spec.phase == "clip":
        inner_opt_step = session.optimizer.step

        def opt_step(*a: Any, **kw: Any) -> Any:
            fire("clip")
            return inner_opt_step(*a, **kw)

        session.optimizer.step = opt_step
    elif spec.phase == "mirror":
        _mirror_drills.append(spec)
    elif spec.phase == "save":
        session.save_hooks.append(lambda: fire("save"))
    elif spec.phase == "log":
        inner_sched = session.scheduler.step

        def sched_step(*a: Any, **kw: Any) -> Any:
            out = inner_sched(*a, **kw)
            fire("log")
            return out

        session.scheduler.step = sched_step
    else:
        from trainmover_training import rank_state

        for opt in rank_state.optimizers(session):
            inner_step = opt.optimizer.step

            def step(*a: Any, _inner: Callable[..., Any] = inner_step, **kw: Any) -> Any:
                fire("step")
                return _inner(*a, **kw)

            opt.optimizer.step = step
