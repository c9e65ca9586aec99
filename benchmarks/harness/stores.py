"""A TCPStore for ranks forked from the calling process."""

from __future__ import annotations


def host_store_in_own_process(timeout_s: float = 120.0, start_timeout_s: float = 60.0):
    """A client of a TCPStore server that runs in a forked process of its own; returns the client.

    For harnesses that fork ranks from the calling process. A server hosted in the caller has
    threads serving the ranks already started while the next one forks; a child can inherit a
    lock such a thread held (c10's logging writes from it) and hang in its own TCPStore
    constructor (CI saw a rank stuck there for 120 s). The server is a daemon child: it ends with
    the caller. ``client.port`` is the server's port, for clients in other processes."""
    import datetime
    import multiprocessing as mp

    from torch.distributed import TCPStore

    ctx = mp.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_serve_store, args=(send_end, timeout_s), daemon=True, name="tm-tcpstore")
    server.start()
    if not recv_end.poll(start_timeout_s):
        server.kill()
        raise TimeoutError(f"the TCPStore server process did not start within {start_timeout_s:.0f}s")
    return TCPStore("127.0.0.1", recv_end.recv(), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _serve_store(conn, timeout_s: float) -> None:
    import datetime
    import time

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    conn.send(store.port)
    while True:  # a daemon: it ends with its parent
        time.sleep(3600)
