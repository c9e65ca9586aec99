"""The communicator's own errors; nothing else of TrainMover's is needed to use or test it.

TrainMover's error tree (``trainmover_ext.errors``) re-exports these under the same names, so a
runtime catching ``CommLinkError`` catches what this package raises.
"""

from __future__ import annotations


class DeltaError(Exception):
    """Base class of every error nccl_delta raises on purpose."""


class DeltaConfigError(DeltaError, ValueError):
    """A :class:`~nccl_delta.config.DeltaConfig` value is invalid; the message names the setting."""


class CommLinkError(DeltaError):
    """A communication link failed; the message names the peer, the group and the op.

    ``peers`` are the ranks this rank suspects: whose connection closed, or whose link failed in the
    transport itself (empty when the link was cut by this rank, a neighbour's error, or the control
    plane). A suspicion is not proof of death: the caller reports it and the control plane checks."""

    def __init__(self, message: str = "", *, peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(peers)


class CommAbandoned(CommLinkError):
    """An op was cut short because the control plane abandoned its epoch; rebuild links with ``recover(epoch)``."""


class CommTimeout(CommLinkError, TimeoutError):
    """A link op or link rendezvous ran past its deadline; the peer is hung or never arrived."""


class SwapAborted(DeltaError):
    """A link swap (``prepare``/``switch``/``recover``/``join``) could not be carried out; the
    communicator keeps the links it had."""
