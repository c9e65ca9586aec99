"""Build a joiner's model and optimizer without talking to the job.

megatron-core runs a few collectives while building: the first/last stage
embedding all-reduce (tied weights start equal), the optimizer's
``all_gather_object`` of parameter-group keys, a warm-up all-reduce of NCCL
buffers. Stayers ran them at the job's start; a joiner that ran them now would
block, or worse pair up with a stayer's training collectives. Everything those
collectives establish is overwritten by the state transfer, so on a joiner they
become local: an all-reduce leaves its input, an object all-gather assumes every
rank has this rank's object (true for the GPT param groups: no per-rank
overrides), barriers return at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist


class _Done:
    def wait(self, *args: object, **kwargs: object) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _local(*args: object, async_op: bool = False, **kwargs: object) -> _Done | None:
    return _Done() if async_op else None


def _gather_object_locally(object_list: list[Any], obj: object, group: object = None) -> None:
    for i in range(len(object_list)):
        object_list[i] = obj


_REPLACED: dict[str, Callable[..., Any]] = {
    "all_reduce": _local,
    "broadcast": _local,
    "barrier": _local,
    "all_gather_object": _gather_object_locally,
}


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Inside the block, build-time collectives of ``torch.distributed`` are local no-ops."""
    saved = {name: getattr(dist, name) for name in _REPLACED}
    try:
        for name, fn in _REPLACED.items():
            setattr(dist, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
