"""A planned move's hand-over: the leaver streams its state to the joiner at the agreed boundary.

Contract:
- Both ends open one 2-rank gloo pair of their own, ``transfer/<e>/<rank>``
  on the job's rendezvous store (the leaver and the joiner serve the same
  logical rank, so no communicator link joins them); a move of several ranks
  (a drain) has one pair per rank. The leaver starts its end once every joiner
  is ready (each opens its end then, :func:`prepare_hand_over`) and trains on
  meanwhile, so the pair is up by the switch point two boundaries later. The pair is built on a
  daemon thread while the caller polls: a newer failure plan (the leaver died,
  or another rank did) makes the wait give up at once with
  :class:`RecoverySuperseded`, and severs a pair already in use, so neither
  end waits for a dead peer.
- The leaver marks ``handed_over/<rank>`` on the plan once its last tensor is
  sent (``handed_over`` once every leaver did); until then the control plane
  treats the leaver's death as a failure of the rank
  (:mod:`trainmover_ext.control.decide`), whose joiner stays.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainmover_ext.control.records import MigrationPlan
from trainmover_ext.errors import CommLinkError, MembershipLost, MigrationAborted, RecoverySuperseded
from trainmover_ext.migration.handover_transport import HandoverChannel, connect_handover
from trainmover_ext.migration.recovery import recv_and_report, send_and_report
from trainmover_ext.migration.timeline import mark_rank_step

if TYPE_CHECKING:
    import torch
    from torch.distributed.distributed_c10d import Store

    from trainmover_ext.migration.worker import WorkerRuntime
    from trainmover_training.training import Session


class PendingHandover:
    """A hand-over pair being built on a daemon thread (see :func:`start_handover`)."""

    def __init__(self, store: Store, name: str, side: int, timeout_s: float, device: torch.device) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._lock = threading.Lock()
        self._pair: HandoverChannel | None = None
        self._error: BaseException | None = None
        self._gave_up = False
        self._done = threading.Event()
        threading.Thread(
            target=self._build, args=(store, side, device), name=f"tm_handover_{name}", daemon=True
        ).start()

    def _build(self, store: Store, side: int, device: torch.device) -> None:
        try:
            pair = connect_handover(store, self.name, side, self.timeout_s, device)
        except BaseException as exc:  # noqa: BLE001 - re-raised by channel()
            self._error = exc
        else:
            with self._lock:
                if self._gave_up:
                    pair.sever()
                    pair.close()
                else:
                    self._pair = pair
        finally:
            self._done.set()

    def channel(self, cancelled: Callable[[], bool]) -> HandoverChannel:
        """Wait for the pair (at most its timeout); gives up when ``cancelled()`` turns true."""
        while not self._done.wait(0.02):
            if cancelled():
                self.cancel()
                raise RecoverySuperseded(f"hand-over link {self.name!r}: a newer failure plan superseded the move")
        if self._error is not None:
            raise MigrationAborted(f"hand-over link {self.name!r} could not be built: {self._error}") from self._error
        with self._lock:
            pair, self._pair = self._pair, None
        if pair is None:
            raise MigrationAborted(f"hand-over link {self.name!r} was given up")
        return pair

    def cancel(self) -> None:
        """Drop the pair (now, or once built); idempotent."""
        with self._lock:
            self._gave_up = True
            pair, self._pair = self._pair, None
        if pair is not None:
            pair.sever()
            pair.close()


def start_handover(store: Store, name: str, side: int, timeout_s: float, device: torch.device) -> PendingHandover:
    """Start building the hand-over pair ``name`` for state on ``device`` (both ends call this, or
    :func:`open_handover`)."""
    return PendingHandover(store, name, side, timeout_s, device)


def open_handover(
    store: Store, name: str, side: int, timeout_s: float, cancelled: Callable[[], bool], device: torch.device
) -> HandoverChannel:
    """Build the hand-over pair ``name`` and wait for it; gives up when ``cancelled()`` turns true."""
    return start_handover(store, name, side, timeout_s, device).channel(cancelled)


def state_device(session: Session) -> torch.device:
    """Where the rank's training state lives (its first parameter's device)."""
    import torch

    for chunk in session.model:
        for param in chunk.parameters():
            device: torch.device = param.device
            return device
    return torch.device("cpu")


def _use(rt: WorkerRuntime, channel: HandoverChannel, epoch: int, transfer: Callable[[], int]) -> None:
    """Run ``transfer`` over ``channel`` where the watch thread can sever it (a newer failure plan)."""
    from nccl_delta.waiter import WaitCancelled

    rt.handover = channel
    try:
        if rt.newest_failure_epoch() > epoch:
            channel.sever()  # superseded before the watch thread could see the channel
        transfer()
    except (RuntimeError, WaitCancelled) as exc:  # gloo reports a severed or reset pair as RuntimeError
        if rt.newest_failure_epoch() > epoch:
            raise RecoverySuperseded(f"the hand-over of epoch {epoch} was cut short by a newer failure plan") from exc
        raise CommLinkError(f"the hand-over of epoch {epoch} broke: {exc}") from exc
    finally:
        rt.handover = None
        channel.close()


def _handover_store(rt: WorkerRuntime) -> Store:
    from trainmover_ext.launch.rendezvous import rank_store

    # Not None: a WorkerRuntime exists only under etcd rendezvous (identity_from_env refuses anything else).
    store: Store = rank_store(datetime.timedelta(seconds=rt.timeout_s))
    return store


def _superseded(rt: WorkerRuntime, epoch: int) -> Callable[[], bool]:
    return lambda: rt.newest_failure_epoch() > epoch


def prepare_hand_over(rt: WorkerRuntime, session: Session, plan: MigrationPlan) -> PendingHandover:
    """The planned leaver, once every joiner is ready: build its hand-over pair in the background, so
    that at the boundary only the state crosses (the joiner opens its end when it is ready)."""
    return start_handover(_handover_store(rt), f"{plan.epoch}/{rt.layout.rank}", 0, rt.timeout_s, state_device(session))


def hand_over(rt: WorkerRuntime, session: Session, plan: MigrationPlan, pending: PendingHandover | None = None) -> None:
    """The planned leaver, at the agreed boundary: stream state to the joiner (over ``pending``, the pair
    :func:`prepare_hand_over` started, or a new one), then leave."""
    rank = rt.layout.rank
    pending = pending or prepare_hand_over(rt, session, plan)
    channel = pending.channel(_superseded(rt, plan.epoch))
    print(f"[trainmover] rank {rank}: planned hand-over of epoch {plan.epoch} on {channel.transport}", flush=True)
    try:
        _use(
            rt,
            channel,
            plan.epoch,
            lambda: send_and_report(channel, session, rank, plan.epoch, drill="handover", space=rt.space),
        )
    except CommLinkError as exc:
        # The joiner is gone: our state went nowhere, and the rank is not ours any more. Leave; the
        # control plane replaces the rank from a replica (the joiner's loss is a failure of it).
        raise MembershipLost(f"the planned hand-over of epoch {plan.epoch} failed: {exc}") from exc
    mark_rank_step(rt.space, plan.epoch, "handed_over", rank)
    rt.epoch = plan.epoch


def receive_from_leaver(rt: WorkerRuntime, session: Session, plan: MigrationPlan) -> None:
    """The planned joiner: receive the leaver's state (blocks until the leaver reaches the boundary).

    Raises :class:`RecoverySuperseded` (or a link error) when a newer failure plan cuts the move
    short; the state is then unusable (``rt.state_valid`` is False) until a recovery copies it."""
    rank = rt.layout.rank
    channel = open_handover(
        _handover_store(rt), f"{plan.epoch}/{rank}", 1, rt.timeout_s, _superseded(rt, plan.epoch), state_device(session)
    )
    _use(
        rt,
        channel,
        plan.epoch,
        lambda: recv_and_report(channel, session, rank, plan.epoch, space=rt.space),
    )
    rt.state_valid = True
    from trainmover_training import iteration_start

    session.started = iteration_start.capture(session.args)
    mark_rank_step(rt.space, plan.epoch, "transferred", rank, resume_iteration=session.args.iteration)
    session.reset_data()
    rt.epoch = plan.epoch
