"""Typed configuration of the delta communicator.

Built once per process (usually by :func:`nccl_delta.register`) and shared by
every group of that process; changing it after groups exist has no effect on
links that are already open.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nccl_delta.errors import DeltaConfigError as ConfigError

TRANSPORTS = ("auto", "gloo", "nccl")


@dataclass(kw_only=True)
class DeltaConfig:
    """Knobs of the delta communicator; defaults suit CPU training with gloo links."""

    transport: str = "auto"
    """Link transport: ``gloo`` (CPU pair groups), ``nccl`` (CUDA pair communicators) or ``auto``
    (``nccl`` when CUDA is available, else ``gloo``). Env: ``NCCL_DELTA_TRANSPORT``."""

    op_timeout_s: float = 300.0
    """Deadline of one link op (a send or a receive inside a collective), in seconds. A peer that is
    alive but stuck longer than this makes the op raise :class:`CommTimeout`."""

    connect_timeout_s: float = 120.0
    """Deadline for a link rendezvous (both ends must arrive), in seconds."""

    link_host: str | None = None
    """Address the gloo pair links listen on. ``None`` uses ``GLOO_SOCKET_IFNAME`` when set, else
    the host name. Tests use ``127.0.0.1``. Env: ``NCCL_DELTA_LINK_HOST``."""

    segment_bytes: int = 4 << 20  # measured best of 1, 2, 4 and 8 MiB for 16 and 64 MB at 4 ranks on CPU
    """Pipeline segment of the ring algorithms: a chunk is sent in pieces of this size so the
    reduction of one piece overlaps the transfer of the next. Env: ``NCCL_DELTA_SEGMENT_BYTES``."""

    finish_grace_s: float = 5.0
    """How long a collective in progress inside :meth:`~nccl_delta.world.DeltaWorld.finishing` may run
    on after an abandon when its peer neither finishes it nor stops (a stopped peer publishes its
    ledgers, which ends the wait at once); then its link is severed. Env: ``NCCL_DELTA_FINISH_GRACE_S``."""

    small_bytes: int = 64 << 10
    """All-reduces up to this many bytes use gather-then-reduce (n-1 hops instead of 2(n-1))."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r} is not one of {TRANSPORTS}: set NCCL_DELTA_TRANSPORT")
        if self.op_timeout_s <= 0 or self.connect_timeout_s <= 0 or self.finish_grace_s <= 0:
            raise ConfigError("op_timeout_s, connect_timeout_s and finish_grace_s must be > 0")
        if self.segment_bytes < 4096:
            raise ConfigError(f"segment_bytes={self.segment_bytes} is below 4096: raise it")
        if self.small_bytes < 0:
            raise ConfigError("small_bytes must be >= 0")

    @classmethod
    def from_env(cls, **overrides: Any) -> DeltaConfig:
        """Defaults, then ``NCCL_DELTA_*`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        if "NCCL_DELTA_TRANSPORT" in os.environ:
            values["transport"] = os.environ["NCCL_DELTA_TRANSPORT"]
        if "NCCL_DELTA_LINK_HOST" in os.environ:
            values["link_host"] = os.environ["NCCL_DELTA_LINK_HOST"]
        if "NCCL_DELTA_OP_TIMEOUT_S" in os.environ:
            values["op_timeout_s"] = float(os.environ["NCCL_DELTA_OP_TIMEOUT_S"])
        if "NCCL_DELTA_FINISH_GRACE_S" in os.environ:
            values["finish_grace_s"] = float(os.environ["NCCL_DELTA_FINISH_GRACE_S"])
        if "NCCL_DELTA_SEGMENT_BYTES" in os.environ:
            values["segment_bytes"] = int(os.environ["NCCL_DELTA_SEGMENT_BYTES"])
        values.update(overrides)
        return cls(**values)

    def resolved_transport(self) -> str:
        """The transport ``auto`` stands for on this machine."""
        if self.transport != "auto":
            return self.transport
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
