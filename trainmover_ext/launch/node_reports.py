"""What an agent reports about its node for the straggler watch and the rebalancer (``control.straggler_watch``).

Contract:
- :meth:`NodeReports.open` (once etcd is open) records the job's straggler policy and, when one was asked for,
  its rebalancing schedule from this agent's flags, unless an earlier agent (or ``trainmover straggler`` /
  ``rebalance``) recorded them; it starts the GPU health watch where NVML answers.
- :meth:`NodeReports.tick` (every supervision round) relays the serving ranks' compute samples
  (:mod:`~trainmover_ext.launch.compute_relay`) and, when a read of the GPUs is due, exports them and
  publishes ``health/<host>`` when a slot's problems changed (:mod:`~trainmover_ext.launch.gpu_health`).
- etcd trouble is said and retried at a later round; it never stops supervision.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainmover_ext.control import rebalance
from trainmover_ext.control.records import GpuHealthReport, RebalancePolicy, StragglerPolicy
from trainmover_ext.control.straggler_watch import POLICY_KEY
from trainmover_ext.errors import TrainMoverError
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.launch.compute_relay import ComputeRelay
from trainmover_ext.launch.config import LaunchConfig
from trainmover_ext.launch.gpu_health import GpuHealthWatch


class NodeReports:
    """See the module docstring."""

    def __init__(self, space: JobSpace, host: str, gpu: GpuHealthWatch | None, log: Callable[[str], None]) -> None:
        self.space, self.host, self.gpu, self.log = space, host, gpu, log
        self.compute = ComputeRelay(space, host)

    @classmethod
    def open(cls, space: JobSpace, host: str, cfg: LaunchConfig, agent_id: str, log: Callable[[str], None]):
        now = time.time()
        policy = StragglerPolicy(**{**vars(cfg.straggler), "set_by": agent_id, "set_at": now})
        space.put_if_absent(space.key(*POLICY_KEY), policy.to_bytes())
        if cfg.rebalance.interval_s > 0:
            schedule = RebalancePolicy(interval_s=cfg.rebalance.interval_s, set_by=agent_id, set_at=now)
            space.put_if_absent(space.key(*rebalance.POLICY_KEY), schedule.to_bytes())
        gpu: GpuHealthWatch | None = GpuHealthWatch(cfg.nproc_per_node)
        if gpu is not None and not gpu.start():
            gpu = None
        return cls(space, host, gpu, log)

    def tick(self, heartbeats: dict[int, str], metrics: Any | None) -> None:
        """One supervision round: ``heartbeats`` maps each serving rank to its process's heartbeat file."""
        self.compute.collect(heartbeats)
        self.compute.publish()
        if self.gpu is None:
            return
        reads = self.gpu.reads
        found = self.gpu.poll()
        if metrics is not None and self.gpu.reads != reads:
            metrics.observe_gpus(self.gpu.readings, self.gpu.unfit)
        if found is None:
            return
        report = GpuHealthReport(host=self.host, unfit={str(k): v for k, v in found.items()}, read_at=time.time())
        for slot, problems in sorted(found.items()):
            if problems:
                self.log(f"GPU {slot}: {'; '.join(problems)}")
        try:
            self.space.put(self.space.key("health", self.host), report.to_bytes())
        except TrainMoverError as exc:
            self.log(f"GPU health not published ({exc}); trying again at the next read")
            self.gpu.forget_last()

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
