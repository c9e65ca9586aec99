"""``pretrain()``'s runtime hooks for ``pretrain_gpt.py``: what the ``--tm-*`` flags ask for.

Contract: :func:`trainmover_training.training.pretrain` knows only the
:class:`~trainmover_training.training.RuntimeHooks` protocol; this module is where
the choice between a worker and a standby is made, where the worker's runtime
(membership and migrations), the fault drills and the sandbox recorder are
attached, and where a planned leaver rejoins the standby pool. A worker under
``--trainmover`` publishes the job's model fingerprint before it registers
(:mod:`trainmover_ext.control.fingerprint`): standbys compare theirs with it. Without
``--trainmover`` the hooks still serve the launcher (the rank dies with its
agent), logging, ``--tm-metrics-file`` and the fault drills.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from trainmover_ext.config import TrainMoverConfig
from trainmover_ext.launch.distributed import TrainMoverDistributed
from trainmover_training.training import Runtime, Session


class TrainMoverHooks:
    """See the module docstring."""

    def __init__(self) -> None:
        self.config: TrainMoverConfig | None = None
        self.worker = None

    def start(self, args) -> None:
        from trainmover_ext.config import config_from_args
        from trainmover_ext.launch import heartbeat
        from trainmover_ext.launch.process import die_with_parent_from_env
        from trainmover_ext.logconfig import configure as configure_logging

        die_with_parent_from_env()  # a rank spawned by `trainmover launch` never outlives its agent
        if heartbeat.start_from_env():  # its agent sees a frozen process (launch.heartbeat)
            from trainmover_ext.launch import progress

            progress.start(os.environ[heartbeat.ENV_HEARTBEAT_FILE])  # ... and a stalled main thread
        configure_logging(getattr(args, "tm_log_level", None), getattr(args, "tm_log_json", None))
        self.config = config_from_args(args)

    @property
    def metrics_file(self) -> str | None:
        return self.config.metrics_file if self.config else None

    def distributed_setup(self) -> TrainMoverDistributed:
        return TrainMoverDistributed(delta=bool(self.config and self.config.use_delta_comm))

    def prepare_chunk(self, chunk) -> None:
        if self.config is not None and self.config.compile:
            from trainmover_ext.sandbox.compile import compile_chunk

            compile_chunk(chunk)  # in place; collectives stay eager (see that module)

    def serve_other_role(self, args, providers, t_process: float) -> dict | None:
        """A standby's whole life (``--tm-role standby``); None for a worker, which publishes the job's
        model fingerprint here, as early as its arguments allow (standbys wait for it to advertise)."""
        if self.config is None:
            return None
        if self.config.role != "standby":
            if self.config.enabled:
                publish_job_fingerprint(args)
            return None
        from trainmover_ext.migration.standby import run_standby

        return run_standby(args, self.config, providers, t_process)

    def runtime_for(self, session: Session) -> Runtime:
        config = self.config
        runtime: Runtime = Runtime()
        if config is None:
            return runtime
        if config.enabled:
            from trainmover_ext.migration.worker import WorkerRuntime

            runtime = self.worker = WorkerRuntime.for_session(session, config)
        if config.inject_fault:
            from trainmover_ext.runtime import faults

            faults.install(faults.FaultSpec.parse_all(config.inject_fault), session)
        if config.inject_slowdown and self.worker is not None:
            from trainmover_ext.runtime.slowdown import Slowdown, SlowdownClock

            spec = Slowdown.parse(config.inject_slowdown)
            if spec.rank == session.layout.rank:
                self.worker.slowdown = SlowdownClock(spec)
        if config.inject_link_delay and self.worker is not None:
            from trainmover_ext.runtime.slowdown import LinkDelay

            delay = LinkDelay.parse(config.inject_link_delay)
            if delay.peer_of(session.layout.rank) is not None:
                self.worker.link_delay = delay
        if self.worker is not None:
            self.worker.start_mirror(session)
            self.worker.track_progress(session)  # after the drills: a hang in forward is seen in forward
        if config.record_dir:  # sandbox: record the first iterations
            from trainmover_ext.sandbox.hook import attach_recorder

            runtime = attach_recorder(session, runtime, config)
        return runtime

    def after_exit(self, args, providers, t_process: float) -> Callable[[], dict] | None:
        """What this process does next once its rank is given up: a planned leaver with
        ``--tm-leaver-becomes-standby`` rejoins the pool (the caller drops its model first)."""
        worker, config = self.worker, self.config
        if worker is None or worker.handed_over is None:
            return None
        from trainmover_ext.migration.joiner import rejoins

        if not rejoins(config, worker.space, worker.ident):
            return None
        leaver, epoch = worker.ident.member_id, worker.handed_over
        self.worker = None

        def rejoin() -> dict:
            from trainmover_ext.migration.standby import rejoin_as_standby

            return rejoin_as_standby(args, config, providers, t_process, leaver, epoch)

        return rejoin


def publish_job_fingerprint(args) -> None:
    """Write the job's model fingerprint unless a worker did (:class:`ConfigMismatch` if it differs)."""
    from trainmover_ext.control.fingerprint import fingerprint_record, publish_fingerprint
    from trainmover_ext.launch.identity import identity_from_env, open_space

    ident = identity_from_env()
    space = open_space(ident)
    try:
        publish_fingerprint(space, fingerprint_record(args, published_by=ident.member_id))
    finally:
        space.kv.close()
