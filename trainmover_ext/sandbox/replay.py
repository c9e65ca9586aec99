"""The ``tm_replay`` torch.distributed backend: a process group answered from a recording.

Who uses it: a standby, alone, via :func:`replay_world`::

    with replay_world(recording) as session:
        mpu.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
        ... build the model, then per shadow iteration k:
        session.begin_iteration(k); train_step(...); session.end_iteration(k)

``init_process_group(backend="tm_replay", store=HashStore(), rank=<recorded
rank>, world_size=<job world>)`` makes WORLD a replay group, and every group
megatron creates inherits the backend. No group has any transport: nothing is
sent, nothing is received, no socket is opened.

Replay groups wear the job's group class. For a job on native gloo/NCCL they
are :class:`ReplayProcessGroup`. For a job on nccl_delta (``--trainmover``)
they are bare ``DeltaProcessGroup`` objects without links, whose op methods
are routed to the session while the replay world lives: ``torch.compile``
guards on the type of megatron's groups, so only then does the code compiled
in shadow iterations still fit the groups the promoted process will hold.

Phases of the :class:`ReplaySession`
- ``setup`` (before the first shadow iteration): calls made while megatron
  builds groups, model and optimizer were not recorded. They are answered
  with this rank's own data, as if every peer held the same values
  (all-reduce leaves the buffer as is, gathers repeat the local input). For a
  symmetric setup exchange (megatron's optimizer gathers its param-group keys)
  that is the true answer. The calls are counted in ``setup_calls``.
- ``replay`` (inside begin/end_iteration): each call takes the next record of
  that iteration. The op, group kind, group ranks, peer, reduction and every
  shape and dtype must equal the record, else :class:`ReplayMismatch` names
  the call and what differed. Results are copied into the caller's tensors;
  sends and barriers are checked and skipped. An iteration that makes fewer
  or more calls than were recorded also raises.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from nccl_delta.backend import DoneWork, NamedGroup  # a replayed call completes on return, like an inline op
from trainmover_ext.errors import ReplayMismatch

from .groups import megatron_group_kinds
from .ops import METHOD_TO_OP, NO_RESULT_OPS, OpCall, decode
from .recording import Recording, dtype_name

BACKEND_NAME = "tm_replay"

_SESSION: ReplaySession | None = None  # the backend creator has no other way to reach it


class ReplayInterrupted(Exception):
    """A replayed call found the session's ``interrupt`` set (the standby was promoted): the shadow
    iteration ends at that call, its model and state are to be dropped."""


class ReplaySession:
    """The cursor over one role's recording, shared by all replay groups of this process."""

    def __init__(self, recording: Recording, interrupt: Callable[[], bool] | None = None):
        self.recording = recording
        self.interrupt = interrupt
        """Asked at each replayed call: True ends the shadow iteration there (:class:`ReplayInterrupted`)."""
        self.interrupted = False
        """Whether a replayed call raised :class:`ReplayInterrupted` (a caller may see it wrapped)."""
        self.phase = "setup"
        self.iteration: int | None = None
        self.cursor = 0
        self.setup_calls = 0
        self.replayed_calls = 0
        self.replayed_bytes = 0
        self._kinds: dict[int, str] = {}
        self.members: dict[int, list[int]] = {}
        """``id(group) -> global ranks`` of every replay group of this session."""
        self.groups: list = []
        self.group_class: type | None = None
        """The job's group class the replay groups are made of (None: :class:`ReplayProcessGroup`)."""
        first = recording.index["start_iteration"] + 1
        self.iterations = list(range(first, first + recording.index["iterations"]))

    # --- iteration boundaries ------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        """Enter strict replay for recorded iteration ``iteration``."""
        if iteration not in self.iterations:
            raise ReplayMismatch(
                f"iteration {iteration} was not recorded (recorded: {self.iterations}) for role {self.recording.role!r}"
            )
        if self.phase == "setup":
            self._kinds = megatron_group_kinds()
        self.phase, self.iteration = "replay", iteration

    def end_iteration(self, iteration: int) -> None:
        """Check every recorded call of ``iteration`` was replayed; back to setup semantics."""
        nxt = self._peek()
        if nxt is not None and nxt["iteration"] == iteration:
            left = sum(1 for r in self.recording.records[self.cursor :] if r["iteration"] == iteration)
            raise ReplayMismatch(
                f"shadow iteration {iteration} of role {self.recording.role!r} ended with {left} recorded calls "
                f"not replayed; next expected: {_describe(nxt)}"
            )
        self.phase, self.iteration = "setup", None

    def rewind(self) -> None:
        """Start the recording over (warm-up longer than the recording repeats it)."""
        self.cursor = 0

    def _peek(self) -> dict | None:
        records = self.recording.records
        return records[self.cursor] if self.cursor < len(records) else None

    # --- one call -------------------------------------------------------------------------
    def handle(self, pg: ReplayProcessGroup, method: str, args: tuple, kwargs: dict) -> DoneWork:
        call = decode(method, args, kwargs)
        if self.phase == "setup":
            self.setup_calls += 1
            _answer_locally(pg, call)
            return DoneWork(call.results)
        if self.interrupt is not None and self.interrupt():
            self.interrupted = True
            raise ReplayInterrupted(f"shadow iteration {self.iteration} interrupted at call #{self.cursor}")
        record = self._peek()
        where = f"shadow iteration {self.iteration}, call #{self.cursor} ({call.op} on group {self._kind(pg)})"
        if record is None or record["iteration"] != self.iteration:
            raise ReplayMismatch(
                f"{where}: the recording of role {self.recording.role!r} has no more calls "
                f"in this iteration; the shadow iteration makes more calls than the job did"
            )
        diffs = self._compare(pg, call, record)
        if diffs:
            raise ReplayMismatch(
                f"{where} differs from the recording: {'; '.join(diffs)} (recorded: {_describe(record)})"
            )
        for i, out in enumerate(call.results):
            value = self.recording.read_tensor(self.cursor, i)
            with torch.no_grad():
                out.copy_(value)
            self.replayed_bytes += value.numel() * value.element_size()
        self.cursor += 1
        self.replayed_calls += 1
        return DoneWork(call.results)

    def _kind(self, pg: ReplayProcessGroup) -> str:
        return self._kinds.get(id(pg), "other")

    def _compare(self, pg: ReplayProcessGroup, call: OpCall, record: dict) -> list[str]:
        diffs = []
        if call.op != record["op"]:
            return [f"op {call.op!r} != recorded {record['op']!r}"]
        if self._kind(pg) != record["group"]:
            diffs.append(f"group kind {self._kind(pg)!r} != recorded {record['group']!r}")
        members = self.members.get(id(pg))
        if members != record["ranks"]:
            diffs.append(f"group ranks {members} != recorded {record['ranks']}")
        if call.peer != record["peer"]:
            diffs.append(f"peer {call.peer} != recorded {record['peer']}")
        if call.reduce_op != record["reduce_op"]:
            diffs.append(f"reduction {call.reduce_op} != recorded {record['reduce_op']}")
        got_in = [[list(t.shape), dtype_name(t.dtype)] for t in call.inputs]
        if got_in != record["inputs"]:
            diffs.append(f"input shapes/dtypes {got_in} != recorded {record['inputs']}")
        want = [[e["shape"], e["dtype"]] for e in record["tensors"]]
        got = [[list(t.shape), dtype_name(t.dtype)] for t in call.results]
        if call.op not in NO_RESULT_OPS and got != want:
            diffs.append(f"result shapes/dtypes {got} != recorded {want}")
        return diffs


def _describe(record: dict) -> str:
    shapes = [e["shape"] for e in record["tensors"]] or [s for s, _ in record["inputs"]]
    return (
        f"#{record['seq']} {record['op']} on {record['group']} {record['ranks']} iteration "
        f"{record['iteration']} shapes {shapes}"
    )


def _answer_locally(pg: ReplayProcessGroup, call: OpCall) -> None:
    """Setup-phase answer: every peer is assumed to hold this rank's values."""
    with torch.no_grad():
        if call.op in ("allgather", "allgather_coalesced", "gather"):
            # outputs are flattened per input: [input 0 x size, input 1 x size, ...]
            for k, out in enumerate(call.results):
                out.copy_(call.inputs[k // pg.size()].view_as(out))
        elif call.op in ("all_gather_single", "all_gather_single_coalesced"):
            for out, inp in zip(call.results, call.inputs, strict=False):
                out.copy_(inp.reshape(-1).repeat(pg.size()).view_as(out))
        elif call.op in ("reduce_scatter_single", "reduce_scatter_single_coalesced"):
            for out, inp in zip(call.results, call.inputs, strict=False):
                out.copy_(inp.reshape(-1).chunk(pg.size())[pg.rank()].view_as(out))
        elif call.op in ("recv", "recv_anysource", "alltoall", "all_to_all_single", "scatter", "reduce_scatter"):
            raise ReplayMismatch(
                f"{call.op} outside a shadow iteration: it was not recorded and has no local "
                "answer; call session.begin_iteration(k) first"
            )
        # allreduce / broadcast / reduce / send / barrier: the local buffer already is the answer


class ReplayProcessGroup(NamedGroup, dist.ProcessGroup):
    """A group handle whose every op is answered by the process's :class:`ReplaySession`."""

    def __init__(self, rank: int, size: int, name: str, session: ReplaySession):
        super().__init__(rank, size)
        self.session = session
        self._group_name = name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ReplayProcessGroup(ranks={self.session.members.get(id(self))}, rank={self.rank()})"


def _make_method(method: str):
    def op_method(self: ReplayProcessGroup, *args, **kwargs):
        return self.session.handle(self, method, args, kwargs)

    op_method.__name__ = method
    op_method.__doc__ = f"``{method}`` answered from the recording (see :class:`ReplaySession`)."
    return torch.compiler.disable(op_method)  # under --tm-compile: a graph break, never traced


for _method in METHOD_TO_OP:
    setattr(ReplayProcessGroup, _method, _make_method(_method))


def _create(dist_opts, backend_opts=None):
    """torch calls this for every group on the tm_replay backend, on members only."""
    if _SESSION is None:
        raise RuntimeError("tm_replay: no replay session is open; use trainmover_ext.sandbox.replay.replay_world")
    members = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    rank, size, name = dist_opts.group_rank, dist_opts.group_size, str(dist_opts.group_id)
    if _SESSION.group_class is None:
        pg = ReplayProcessGroup(rank, size, name, _SESSION)
    else:  # the job's class, without links: its op methods are routed here (see _route_class)
        cls = _SESSION.group_class
        pg = cls.__new__(cls)
        dist.ProcessGroup.__init__(pg, rank, size)
        pg._group_name, pg.delta = name, None
    _SESSION.members[id(pg)] = members
    _SESSION.groups.append(pg)  # keeps ids unique while the session lives
    return pg


_LIFECYCLE = ("shutdown", "abort")


def _route_class(cls: type, session: ReplaySession) -> list[tuple[str, object]]:
    """Send ``cls``'s op methods of the session's groups to the session; returns what to put back."""
    saved = []
    for method in (*METHOD_TO_OP, *_LIFECYCLE):
        if method not in cls.__dict__:
            continue
        original = cls.__dict__[method]

        def routed(pg, *args, _method=method, _original=original, **kwargs):
            if id(pg) not in session.members:
                return _original(pg, *args, **kwargs)
            if _method in _LIFECYCLE:
                return None  # nothing to close: a replay group has no links
            return session.handle(pg, _method, args, kwargs)

        routed.__name__ = method
        setattr(cls, method, torch.compiler.disable(routed))
        saved.append((method, original))
    return saved


def register() -> None:
    """Register the ``tm_replay`` backend (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    # A job on NCCL is replayed on CUDA tensors (see shadow.shadow_device): its groups serve both devices.
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)


@contextlib.contextmanager
def replay_world(
    recording: Recording, timeout_s: float = 600.0, interrupt: Callable[[], bool] | None = None
) -> Iterator[ReplaySession]:
    """Init WORLD on ``tm_replay`` as the recorded rank, alone; destroy it (and megatron's state) on exit.
    ``interrupt``: see :attr:`ReplaySession.interrupt`."""
    global _SESSION
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised; the sandbox needs this process's own world: "
            "warm up before joining the job, or call trainmover_training.initialize.shutdown() first"
        )
    register()
    session = ReplaySession(recording, interrupt)
    saved: list = []
    if recording.index["layout"].get("comm") == "nccl_delta":
        from nccl_delta.backend import DeltaProcessGroup

        session.group_class = DeltaProcessGroup
        saved = _route_class(DeltaProcessGroup, session)
    _SESSION = session
    try:
        dist.init_process_group(
            backend=BACKEND_NAME,
            store=dist.HashStore(),
            rank=recording.rank,
            world_size=recording.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        yield session
    finally:
        from trainmover_training.initialize import shutdown

        try:
            shutdown()
        finally:
            _SESSION = None
            for method, original in saved:
                setattr(session.group_class, method, original)
