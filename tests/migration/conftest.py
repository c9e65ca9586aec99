"""Fixtures for live-migration tests: fault-free reference trajectories, computed once per layout, and
jobs of several loopback nodes."""

from __future__ import annotations

import pytest

from harness.nodes import Node, NodesJob
from helpers import run_job, trajectory


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus):
    """Fault-free trajectories, computed lazily, once per job: cached by ``(nproc, args)``, so two tests that
    name the same job differently share one run (``key`` names its directory)."""
    cache: dict = {}

    def get(key: str, nproc: int, args: list[str]):
        job_key = (nproc, tuple(args))
        if job_key not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{key}")
            job = run_job(tmp, nproc, args, name=f"ref_{key}")
            cache[job_key] = trajectory(job.metrics_path)
        return cache[job_key]

    return get


@pytest.fixture
def nodes_job(tmp_path):
    """``nodes_job(args, nodes, name, **options)`` starts a :class:`~harness.nodes.NodesJob` (``options``: e.g.
    ``per_node``); every one is killed after the test (each node's whole process group) and its etcd stopped."""
    jobs: list[NodesJob] = []

    def start(args: list[str], nodes: list[Node], name: str, **options) -> NodesJob:
        jobs.append(NodesJob(tmp_path, args, nodes, name, **options))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()
