"""What nvrx 0.4.1's in-process restart needs on CPU/gloo to be a fair baseline (``nvrx_inprocess.py``).

- :func:`shutdown_tcp_connections`: the gloo counterpart of nvrx's NCCL abort. A gloo op waiting on a
  live peer cannot be cancelled (``ProcessGroupGloo.abort()``/``shutdown()`` leave it blocked), so
  without this only nvrx's hard timeout frees such a rank, by killing it.
- :func:`finish_torch_teardown`: completes a ``destroy_process_group`` that nvrx's asynchronous
  ``RankShouldRestart`` cut short, so the restarted rank creates groups under the same names as
  its peers.
"""

import os


def shutdown_tcp_connections(keep_ports: set[int]) -> int:
    """``shutdown(SHUT_RDWR)`` every connected TCP socket of this process whose local or peer port is
    not in ``keep_ports`` (the stores); returns how many. In a rank these are gloo's pairs: an
    operation waiting on one fails at once, here and at the peer. Called from nvrx's monitor thread."""
    import socket

    shut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it leaves the original
        except (OSError, ValueError):
            continue  # not a socket, or closed meanwhile
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
            except OSError:
                continue  # a listening socket: it has no peer
            if ports & keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, not on this descriptor
            shut += 1
        except OSError:
            continue  # the peer had already gone
        finally:
            sock.close()
    return shut


def finish_torch_teardown() -> int:
    """Complete a torch.distributed teardown that a restart may find half done; returns the group
    counter it found (0 after a complete teardown).

    nvrx raises ``RankShouldRestart`` asynchronously, so it can land anywhere in Python code, also
    inside ``destroy_process_group`` (``pretrain``'s ``finally`` calls it) after the default group
    is dropped but before the group names are unregistered and c10d's group counter is reset.
    Unnamed groups are named from that counter: with a stale one a rank publishes its gloo address
    under other names than its peers and every rank waits in ``ProcessGroupGloo()`` until the hard
    timeout terminates them all; reset without unregistering, the names collide ("group name has
    already been created"). Both were observed on the demo job (rank 0 restarted with a counter of
    66). The tail of ``destroy_process_group()`` is therefore redone here; each step is idempotent."""
    import torch
    from megatron.core import parallel_state as mpu
    from torch.distributed import distributed_c10d as c10d

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    world = c10d._world
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    stale, world.group_count = world.group_count, 0
    mpu.destroy_model_parallel()  # only drops megatron's references
    return stale
