"""One real failover job shared by the metrics and timeline tests (the CPUs are scarce).

4 ranks (PP2 x DP2) and one standby, under an etcd the test owns (so the job's
records outlive the job), with rank 1 SIGKILLed in iteration ``FAULT_ITER``.
/metrics is scraped every 0.1 s while it runs.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass

import pytest

from helpers import LaunchedJob, start_job, tm_args
from support.scraped_job import FAULT_ITER, ITERS, JOB, TOKEN
from trainmover_ext.etcd import EmbeddedEtcd, EmbeddedEtcdConfig


@dataclass
class FailoverRun:
    job: LaunchedJob
    scrapes: list[str]
    endpoints: str
    metrics_url: str


@pytest.fixture(scope="session")
def failover_run(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("failover_run")
    etcd = EmbeddedEtcd(EmbeddedEtcdConfig(data_dir=tmp / "etcd")).start(timeout=30)
    try:
        endpoints = ",".join(etcd.endpoints)
        args = tm_args(corpus, tp=1, pp=2, iters=ITERS, extra=["--tm-inject-fault", f"1:{FAULT_ITER}:forward"])
        job = start_job(
            tmp,
            4,
            args,
            "--metrics-port",
            "0",
            "--tm-etcd-endpoints",
            endpoints,
            "--tm-job",
            JOB,
            "--tm-job-token",
            TOKEN,
            name="failover",
        )
        url, scrapes = None, []
        deadline = time.time() + 240
        while job.popen.poll() is None and time.time() < deadline:
            if url is None:
                found = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", job.stderr())
                url = found.group(1) if found else None
            if url:
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        scrapes.append(resp.read().decode())
                except OSError:
                    pass  # the agent stops serving when the job ends
            time.sleep(0.1)
        assert job.wait(60) == 0, job.stderr()[-3000:]
        assert url and len(scrapes) > 5, f"no scrapes; stderr:\n{job.stderr()[-2000:]}"
        yield FailoverRun(job=job, scrapes=scrapes, endpoints=endpoints, metrics_url=url)
    finally:
        etcd.stop()
