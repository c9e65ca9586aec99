"""Fixtures for live-migration tests: fault-free reference trajectories, computed once per layout."""

from __future__ import annotations

import pytest

from helpers import run_job, trajectory


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus):
    """Fault-free trajectories by layout key, computed lazily."""
    cache: dict = {}

    def get(key: str, nproc: int, args: list[str]):
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{key}")
            job = run_job(tmp, nproc, args, name=f"ref_{key}")
            cache[key] = trajectory(job.metrics_path)
        return cache[key]

    return get
