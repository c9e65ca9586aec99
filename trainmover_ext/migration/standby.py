"""A standby: warm up, register, wait to be promoted into a rank, then train it.

Contract:
- Started by the agent as ``pretrain_gpt.py ... --tm-role standby`` with the
  job's environment (no ``RANK``). It opens no link to the job before it is
  promoted.
- It registers as a ``standby`` member with no warm role. Before it
  advertises any role it compares its model fingerprint with the one the
  job's first worker published (:mod:`trainmover_ext.control.fingerprint`),
  waiting for it at most ``--tm-fingerprint-timeout``; a difference refuses
  it: :class:`StandbyRefused` names every differing field, goes to the job's
  timeline, and the process exits with ``STANDBY_REFUSED_EXIT_CODE`` (78),
  which its launcher does not restart. Then it warms up.
  By default that is the sandbox (``trainmover_ext.sandbox``; ``trainmover
  launch`` gives the job ``--tm-record-dir <run dir>/recordings``): shadow
  iterations of the first, middle and last roles replayed from the job's
  recordings, timings in the member record's ``warmup``. It advertises every
  role as soon as its fingerprint matched, with ``warming`` set until the
  roles are warm: a failure before then still finds it, and its warm-up
  stops at the next shadow iteration. Without recordings (``--tm-no-sandbox``,
  no directory to record into, none within ``--tm-record-timeout``, or
  corrupt) it says why and does the basic warm-up: the data index and the
  kernels of one layer of the job's width.
- It then waits (bounded by its parent's life) for a plan naming it as a joiner. Then it
  joins the communicator as that rank, builds the rank's model, takes the
  state (from a replica, the leaver, or the checkpoint) and trains on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainmover_ext.control.fingerprint import check_standby, model_fingerprint, refusal_event, wait_job_fingerprint
from trainmover_ext.control.membership import Membership, PlanInbox
from trainmover_ext.control.records import ROLES, MigrationPlan
from trainmover_ext.errors import MembershipLost, StandbyRefused, StoreError
from trainmover_ext.launch.identity import identity_from_env, open_space

if TYPE_CHECKING:
    import argparse

    from trainmover_ext.config import TrainMoverConfig
    from trainmover_ext.kv.job import JobSpace
    from trainmover_ext.launch.identity import Identity
    from trainmover_ext.sandbox.adopt import KeptRole
    from trainmover_ext.sandbox.pacing import Pacer

    Providers = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
    """``pretrain``'s (model_provider, train_valid_test_dataset_provider, forward_step_func)."""

logger = logging.getLogger(__name__)


def basic_warm_up(args: argparse.Namespace, providers: Providers) -> dict[str, float]:
    """Warm what needs no job: data index, kernels, optimizer. Returns timings in seconds."""
    t0 = time.time()
    import torch

    from trainmover_training.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads_per_rank)
    build_tokenizer(args)
    _, dataset_provider, _ = providers
    dataset_provider([args.global_batch_size, 0, 0])  # builds the dataset's index (mmap, permutation)
    t_data = time.time()
    # Exercise the kernels of one transformer layer of the job's width: a forward, a backward
    # and an Adam step, without megatron's parallel state (which only the real rank may set).
    width, seq = args.hidden_size, args.seq_length
    layer = torch.nn.TransformerEncoderLayer(width, args.num_attention_heads, 4 * width, dropout=0.0, batch_first=True)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-4)
    x = torch.randn(args.micro_batch_size, seq, width)
    layer(x).float().pow(2).mean().backward()
    opt.step()
    del layer, opt, x
    return {"data_s": t_data - t0, "kernels_s": time.time() - t_data}


def preload_rank_code(args: argparse.Namespace) -> float:
    """Do now the job-independent part of a promotion; returns the seconds it took.

    That is installing the megatron patches (source rewrites: about 0.4 s of CPU) and importing
    the modules the rank's model is built from (the layer spec, fused kernels, dynamo's rules).
    ``initialize_distributed`` and ``build_session`` would otherwise pay them after the plan, on
    the downtime's critical path, competing with every stayer for the node's cores."""
    t0 = time.time()
    import trainmover_ext.migration.transfer  # noqa: F401
    import trainmover_ext.migration.worker  # noqa: F401
    import trainmover_ext.patches as patches
    import trainmover_ext.runtime.quiet_build  # noqa: F401
    from trainmover_training.model import gpt_layer_spec

    patches.install()
    gpt_layer_spec(args)
    return time.time() - t0


def refuse_unless_fingerprint_matches(
    args: argparse.Namespace, config: TrainMoverConfig, space: JobSpace, member: Membership
) -> None:
    """Compare this standby's model fingerprint with the job's (waiting for the job to publish it);
    on a difference, record the refusal in the job's timeline, log it and raise :class:`StandbyRefused`."""
    job = wait_job_fingerprint(space, config.fingerprint_timeout_s)
    member_id = member.record.member_id
    try:
        check_standby(job.fields, model_fingerprint(args), member=member_id)
    except StandbyRefused as exc:
        logger.error("%s", exc)
        try:
            space.commit([], [refusal_event(space, member_id, exc.fields)])
        except StoreError as err:  # the exit code alone still stops the launcher from restarting it
            logger.warning("could not record standby %s's refusal in the timeline: %s", member_id, err)
        raise


def warm_up(
    args: argparse.Namespace,
    config: TrainMoverConfig,
    providers: Providers,
    space: JobSpace,
    member: Membership,
    should_stop: Callable[[], bool],
    pacer: Pacer,
) -> tuple[dict[str, Any], KeptRole | None]:
    """Warm this standby and report it on its member record; returns the warm-up report and the
    parts of the role it keeps (``--tm-keep-role``; None without the sandbox).

    With ``--tm-record-dir`` it runs sandbox shadow iterations of the first,
    middle and last roles (``trainmover_ext.sandbox.standby``); without it, or
    when the recordings do not appear in time or are corrupt, it says why and
    falls back to the basic warm-up (still able to serve any role, only colder).
    Promoted while it waits for the recordings, it skips the basic warm-up too.
    Either way it first checks the job's model fingerprint: a standby whose model differs is refused
    (:class:`StandbyRefused`) before it advertises any role; the sandbox refuses one whose recordings'
    fingerprint differs (ConfigMismatch).
    ``pacer`` (``--tm-standby-duty``) keeps its CPU share within bounds; it pauses between steps.
    """
    from trainmover_ext.errors import RecordingCorrupt, RecordingNotFound

    preload_s = preload_rank_code(args)  # job-independent: done while the workers build their model
    if not config.sandbox:
        reason = "--tm-no-sandbox: the sandbox is off"
    else:
        reason = (
            "no --tm-record-dir, and no run directory to record into (the script was not started by "
            "`trainmover launch`): pass --tm-record-dir DIR, shared by the job and its standbys"
        )
    if config.record_dir:
        from trainmover_ext.sandbox.standby import warm_general_standby

        # Before any pause: once its fingerprint matched it advertises every role (colder until warm), so a
        # rank lost now is served at once. Paced first, a standby at --tm-standby-duty 0.02 slept 50 times its
        # preload's CPU time (15 s on a slow machine) before it could serve anything.
        refuse_unless_fingerprint_matches(args, config, space, member)
        try:
            return warm_general_standby(
                args, config, providers, space=space, member=member, pacer=pacer, should_stop=should_stop
            )
        except (RecordingNotFound, RecordingCorrupt) as exc:
            if should_stop():  # promoted while it waited for the recordings: no time for the basic warm-up
                report: dict[str, Any] = {
                    "mode": "sandbox",
                    "stopped": "promoted before the job's recordings were sealed",
                }
                member.update(warming=False, warmup=report)
                return report | {"total_s": round(pacer.paused_s, 4)}, None
            reason = str(exc)
        print(
            f"[trainmover] standby {member.record.member_id}: sandbox warm-up impossible, falling back to "
            f"the basic warm-up: {reason}",
            flush=True,
        )
    elif config.sandbox:
        print(f"[trainmover] standby {member.record.member_id}: basic warm-up only: {reason}", flush=True)
    pacer.pace()
    timings = {"preload_s": preload_s, **basic_warm_up(args, providers)}  # also while the workers start
    pacer.pace()
    if not config.record_dir:
        t_check = time.time()
        refuse_unless_fingerprint_matches(args, config, space, member)  # before any role is advertised
        timings["fingerprint_s"] = time.time() - t_check
    report = {
        "mode": "basic",
        "reason": reason,
        **{k: round(v, 4) for k, v in timings.items()},
        "total_s": round(sum(timings.values()) + pacer.paused_s, 4),
        "paused_s": round(pacer.paused_s, 4),
    }
    member.update(warm_roles=list(ROLES), warming=False, warmup=report)
    return report, None


def run_standby(
    args: argparse.Namespace, config: TrainMoverConfig, providers: Providers, t_process: float
) -> dict[str, Any]:
    """The standby's whole life; returns the training summary once it served a rank. A rank it leaves by a
    planned move under ``--tm-leaver-becomes-standby`` (``serve_rank`` returns ``rejoin``) sends it back to
    the pool, as often as that happens, in this same process and without deeper calls."""
    while True:
        summary = _standby_once(args, config, providers, t_process)
        rejoin = summary.pop("rejoin", None)
        if rejoin is None:
            return summary
        del summary
        _become_standby_again(config, *rejoin)


def register_standby(space: JobSpace, ident: Identity, config: TrainMoverConfig) -> Membership:
    """Register this process as an unpromoted standby, with no warm role yet (the controller picks it only
    once ``warm_up`` reports roles).

    Until its promotion it serves no rank, so a lease lost to CPU starvation (it runs at a low priority
    beside busy ranks) is not its death: it registers again at once, on a thread of its own, not at its
    next paced step (a standby at ``--tm-standby-duty 0.02`` sat out of the pool long enough that a rank
    lost then had no replacement within the agent's 30 s). ``serve_rank`` turns that off at promotion."""
    from trainmover_ext.launch.identity import slot_from_env
    from trainmover_ext.sandbox.standby import StandbyMemberRecord

    member = Membership(
        space,
        StandbyMemberRecord(
            member_id=ident.member_id,
            kind="standby",
            host=ident.host,
            pid=ident.pid,
            warm_roles=[],
            slot=slot_from_env(),
        ),
        ttl_s=max(1, round(config.lease_ttl_s)),
        rejoin_on_loss=True,
    ).register()
    member.rejoin_in_background(lambda: member.rejoin_on_loss)
    return member


def _standby_once(
    args: argparse.Namespace, config: TrainMoverConfig, providers: Providers, t_process: float
) -> dict[str, Any]:
    """Warm up, wait to be promoted, serve the rank: one turn of :func:`run_standby`."""
    from trainmover_ext.sandbox.pacing import Pacer

    ident = identity_from_env()
    space = open_space(ident)
    member = register_standby(space, ident, config)
    pacer = Pacer(config.standby_duty)

    def names_me(plan: MigrationPlan) -> bool:
        return any(r.joiner == ident.member_id for r in plan.replacement_list())

    def promotion(latest: dict[int, MigrationPlan]) -> MigrationPlan | None:
        return next((p for _, p in sorted(latest.items()) if names_me(p)), None)

    niceness_before: list[int] = []

    def end_pause(plan: MigrationPlan) -> None:
        if names_me(plan):
            if not niceness_before:
                # At once, on the watch thread (it left the idle policy): the main thread, woken next,
                # would otherwise wait for a core at the standby's priority while every rank waits for it.
                from trainmover_ext.launch import priority

                niceness_before.append(os.getpriority(os.PRIO_PROCESS, 0))
                priority.restore()
            pacer.stop()  # a pause in progress ends now: the rank waits for us

    inbox = PlanInbox(space, end_pause)
    try:
        report, kept = warm_up(
            args,
            config,
            providers,
            space,
            member,
            should_stop=lambda: promotion(inbox.snapshot()) is not None,
            pacer=pacer,
        )
    except BaseException:
        inbox.close()
        member.close()
        raise
    parts = ", ".join(
        f"{k.removesuffix('_s')} {v:.2f}s"
        for k, v in report.items()
        if k.endswith("_s") and k != "total_s" and isinstance(v, (int, float))
    )
    state = f"warming stopped: {report['stopped']}" if "stopped" in report else "waiting to be promoted"
    print(
        f"[trainmover] standby {ident.member_id} warm in {report['total_s']:.2f}s ({report['mode']}, roles "
        f"{member.record.warm_roles}); {state} [{parts}; {time.time() - t_process:.2f}s since its process started]",
        flush=True,
    )
    parent = os.getppid()
    while (plan := inbox.wait_until(promotion, 0.5)) is None:
        if os.getppid() != parent:
            inbox.close()
            member.close()
            raise MembershipLost("the standby's agent is gone; exiting")
        member.check()
    inbox.close()
    from trainmover_ext.migration.joiner import serve_rank

    before = niceness_before[0] if niceness_before else None
    return serve_rank(args, config, providers, plan, ident, space, member, kept=kept, niceness_before=before)


def rejoin_as_standby(
    args: argparse.Namespace, config: TrainMoverConfig, providers: Providers, t_process: float, leaver: str, epoch: int
) -> dict[str, Any]:
    """A planned leaver of ``epoch`` (``--tm-leaver-becomes-standby``) serves the pool again.

    Called by the worker's process after its state went to the joiner and its groups, links,
    model and optimizer were torn down. It becomes a standby in the same process, as
    ``leaver_standby_id(leaver, epoch)`` (the id its agent adopts it under), warms up like any
    standby and may be promoted into any rank later; returns what :func:`run_standby` returns."""
    _become_standby_again(config, leaver, epoch)
    return run_standby(args, config, providers, t_process)


def _become_standby_again(config: TrainMoverConfig, leaver: str, epoch: int) -> None:
    """This process, the planned leaver ``leaver`` of ``epoch``, takes the standby id its agent adopts it under
    and a standby's CPU priority; its memory is given back first."""
    import gc

    from trainmover_ext.launch.identity import ENV_MEMBER_ID, leaver_standby_id
    from trainmover_ext.sandbox.shadow import release_free_memory

    gc.collect()
    release_free_memory()
    os.environ.pop("RANK", None)
    os.environ.pop("LOCAL_RANK", None)
    os.environ[ENV_MEMBER_ID] = leaver_standby_id(leaver, epoch)
    from trainmover_ext.launch import priority

    if priority.can_restore():
        priority.lower(config.refill_nice if config.refill_nice is not None else config.standby_nice)  # as a refill
    print(
        f"[trainmover] {leaver} left its rank at epoch {epoch}; rejoining the pool as standby "
        f"{os.environ[ENV_MEMBER_ID]} (pid {os.getpid()}, CPU niceness {os.getpriority(os.PRIO_PROCESS, 0)})",
        flush=True,
    )
