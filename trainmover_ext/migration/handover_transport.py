"""The planned hand-over's pair on the ranks' own devices: NCCL between two GPUs, gloo otherwise.

Contract:
- Both ends call :func:`connect_handover` with the same ``name`` and opposite sides. Each first
  publishes where its state lives (:class:`DeviceInfo`: node, device, NCCL or not) under
  ``transfer/<name>/dev/<side>`` and reads the other's, so both pick the same transport
  (:func:`choose_transport`): NCCL (``nccl_delta``'s framed pair) when both states are on CUDA
  devices of a torch with NCCL and the two devices differ (a joiner on a standby machine, or in
  another slot); gloo otherwise. NCCL refuses two ranks of one communicator on one device, which
  is where a same-node standby that took the leaver's local rank stands.
- Over gloo, CUDA tensors are staged through host memory (gloo's pair transport reads and writes
  host memory only): a send copies to the host before it is posted, a receive lands in a host
  buffer that is copied to the device when it is waited for. CPU tensors go as they are.
- :class:`HandoverChannel` is the :class:`~trainmover_ext.migration.transfer.Channel` over either
  pair; :meth:`HandoverChannel.sever` (any thread) cuts it.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store


@dataclass(frozen=True)
class DeviceInfo:
    """Where one end's training state lives."""

    node: str
    device: str
    """``str(torch.device)``: ``cpu`` or ``cuda:N``."""
    nccl: bool
    """Whether this end's torch can run NCCL on that device."""
    uuid: str = ""
    """The physical GPU's UUID (empty for the CPU): two node names can share one machine's GPUs, and
    ``cuda:N`` names a GPU only under the process's ``CUDA_VISIBLE_DEVICES``."""

    @classmethod
    def of(cls, device: torch.device) -> DeviceInfo:
        from nccl_delta.transport_nccl import nccl_available
        from trainmover_ext.launch.identity import node_name

        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
        return cls(node=node_name(), device=str(device), nccl=device.type == "cuda" and nccl_available(), uuid=uuid)


def choose_transport(a: DeviceInfo, b: DeviceInfo) -> str:
    """``nccl`` when both ends' states are on distinct CUDA devices with NCCL, else ``gloo``; symmetric.

    The same device: the same GPU UUID where both ends know it, else the same node and device name."""
    both_gpu = a.nccl and b.nccl and a.device.startswith("cuda") and b.device.startswith("cuda")
    if a.uuid and b.uuid:
        same_device = a.uuid == b.uuid
    else:
        same_device = a.node == b.node and a.device == b.device
    return "nccl" if both_gpu and not same_device else "gloo"


class _StagedRecv:
    """A gloo receive into a host buffer for a device tensor: :meth:`wait` copies it to the device."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self) -> bool:
        self.work.wait()
        self.target.copy_(self.host)
        return True


class _FramedRecv:
    """A receive on NCCL's framed pair: :meth:`wait` waits through the pair, with the channel's deadline."""

    def __init__(self, pair: Any, work: Any, timeout: datetime.timedelta) -> None:
        self.pair, self.work, self.timeout = pair, work, timeout

    def wait(self) -> bool:
        self.pair.wait(self.work, self.timeout)
        return True


class HandoverChannel:
    """The state transfer over the hand-over's pair: the leaver is side 0 and sends, the joiner side 1
    receives (see the module docstring)."""

    def __init__(self, pair: Any, timeout_s: float, transport: str = "gloo") -> None:
        self.pair = pair
        self.transport = transport
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def send(self, tensor: torch.Tensor, tag: int) -> Any:
        if self.transport == "gloo" and tensor.device.type != "cpu":
            tensor = tensor.to("cpu")  # the pair's send keeps this host copy alive until it is done
        return self.pair.isend(tensor, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> Any:
        if self.transport == "nccl":
            return _FramedRecv(self.pair, self.pair.irecv(tensor, tag), self.timeout)
        if tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            return _StagedRecv(self.pair.irecv(host, tag), host, tensor)
        return self.pair.irecv(tensor, tag)

    def wait_sends(self, works: list[Any]) -> None:
        self.pair.wait_sends(works, self.timeout)

    def sever(self) -> None:
        self.pair.sever()

    def close(self) -> None:
        self.pair.close()


def connect_handover(store: Store, name: str, side: int, timeout_s: float, device: torch.device) -> HandoverChannel:
    """Agree the transport with the other end and build the pair ``transfer/<name>/`` (both ends call this)."""
    from torch.distributed.distributed_c10d import PrefixStore

    timeout = datetime.timedelta(seconds=timeout_s)
    scope = PrefixStore(f"transfer/{name}/", store)
    mine = DeviceInfo.of(device)
    scope.set(f"dev/{side}", json.dumps(asdict(mine)))
    theirs = DeviceInfo(**json.loads(scope.get(f"dev/{1 - side}").decode()))
    transport = choose_transport(mine, theirs)
    if transport == "nccl":
        from nccl_delta.transport_nccl import connect_nccl_pair

        pair: Any = connect_nccl_pair(store, f"transfer/{name}/nccl/", side, timeout, timeout)
    else:
        from nccl_delta.transport_gloo import connect_gloo_pair

        host = os.environ.get("NCCL_DELTA_LINK_HOST") or "127.0.0.1"
        pair = connect_gloo_pair(store, f"transfer/{name}/", side, timeout, host)
    return HandoverChannel(pair, timeout_s, transport)
