"""Fixtures for the sandbox tests (helpers in ``tests/support/sandbox_jobs.py``)."""

from __future__ import annotations

import pytest

from support.sandbox_jobs import RecordedJob, pp3_argv, record_job


@pytest.fixture(scope="session")
def pp3_job(tmp_path_factory, corpus) -> RecordedJob:
    """The tiny PP=3 job on gloo, trained ITERS iterations with the first RECORD_ITERS recorded."""
    import trainmover_training  # noqa: F401  (import once in the parent: every fork starts warm)

    return record_job(tmp_path_factory.mktemp("pp3"), pp3_argv(corpus))


@pytest.fixture(scope="session")
def pp3_delta_job(tmp_path_factory, corpus) -> RecordedJob:
    """The same job with every group on nccl_delta, as under ``--trainmover``."""
    import trainmover_training  # noqa: F401

    return record_job(tmp_path_factory.mktemp("pp3delta"), pp3_argv(corpus), comm="nccl_delta")
