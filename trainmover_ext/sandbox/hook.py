"""The training loop's recording hook: ``pretrain`` wraps its runtime when ``--tm-record-dir`` is set.

Who calls it: ``trainmover_training.training.pretrain`` on every rank, right
before ``train_loop``::

    runtime = attach_recorder(session, runtime, tm_config)

On the recorder rank of each role (see :func:`~.recorder.recorder_role`) the
returned :class:`RecordingRuntime` records the next ``--tm-record-iters``
iterations, seals the recording after the last of them (the class hooks are
removed at that moment, so steady iterations run untouched code), and
publishes its index to etcd at ``recordings/<role>`` when the runtime has a
job space (under ``--trainmover``). Every other rank gets its runtime back
unchanged.

Failure: an iteration that is abandoned (the runtime's ``recover``) drops an
unsealed recording, since it would hold a partial iteration; the job trains
on and standbys fall back after ``--tm-record-timeout``. A recording error
(disk full ...) is logged and drops the recording: training never fails
because of the sandbox.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from trainmover_ext.errors import TrainMoverError

from .recorder import RecordingHandle, maybe_start_recording, paused
from .registry import publish

logger = logging.getLogger(__name__)


class RecordingRuntime:
    """Delegates every hook to the wrapped runtime; records and publishes around ``after_iteration``."""

    def __init__(self, inner, handle: RecordingHandle, record_dir: str):
        self.inner, self.handle, self.record_dir = inner, handle, record_dir
        self.published: dict | None = None

    @property
    def recoverable(self) -> tuple:
        return self.inner.recoverable

    def __getattr__(self, name):  # anything else the loop or a caller reads lives on the wrapped runtime
        return getattr(self.inner, name)

    def before_iteration(self, session) -> bool:
        return self.inner.before_iteration(session)

    def recover(self, session, exc: BaseException) -> None:
        self.handle.abort(f"iteration {session.args.iteration + 1} was abandoned ({exc})")
        self.inner.recover(session, exc)

    @contextlib.contextmanager
    def evaluating(self, session) -> Iterator[None]:
        with self.inner.evaluating(session), paused():
            yield

    def after_iteration(self, session, loss) -> None:
        if self.handle.active:
            self._record_step(session)
        self.inner.after_iteration(session, loss)

    def _record_step(self, session) -> None:
        try:
            index = self.handle.after_iteration(session.args.iteration)
        except (OSError, TrainMoverError, RuntimeError) as exc:
            self.handle.abort(f"recording failed: {exc}")
            return
        if index is None:
            return
        overhead = self.handle.recorder.overhead_s if self.handle.recorder is not None else None
        logger.info(
            "sealed recording of role %s: %d calls, %d bytes", index["role"], len(index["records"]), index["data_bytes"]
        )
        space = getattr(self.inner, "space", None)
        if space is not None:
            self.published = publish(space, index["role"], self.record_dir, record_overhead_s=overhead)

    def after_training(self, session) -> None:
        self.inner.after_training(session)

    def close(self) -> None:
        try:
            self.handle.close()
        finally:
            self.inner.close()


def attach_recorder(session, runtime, config):
    """``runtime`` wrapped for recording when this rank records (``config.record_dir`` set), else ``runtime``."""
    if not getattr(config, "record_dir", None):
        return runtime
    handle = maybe_start_recording(
        session.args, session.layout, record_dir=config.record_dir, record_iters=config.record_iters
    )
    if handle.recorder is None:
        return runtime
    return RecordingRuntime(runtime, handle, config.record_dir)
