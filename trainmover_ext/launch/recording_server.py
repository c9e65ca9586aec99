"""A node's sandbox recordings over HTTP, for standbys on other nodes; authenticated with the job token.

Who calls it
- The agent of an active node (:mod:`trainmover_ext.launch.tm_supervisor`) starts a
  :class:`RecordingServer` on its ``--tm-record-dir`` once its ranks are forked, writes the URL on its
  node record (``nodes/<host>``: ``recordings_url``) and closes it when it stops.
- A standby whose own record directory lacks a role the job published calls :func:`fetch_role`
  (``trainmover_ext.sandbox.fetch``), which copies that role's two files into its directory.

Contract
- The server answers ``GET /recordings/<role>/index.json`` and ``GET /recordings/<role>/tensors.bin``
  with the file under its directory, and 404 to every other method, path or missing file. A path is
  matched as sent: ``..``, ``%2e``, a query or a symbolic link out of the directory never match.
- Every request must carry ``X-TrainMover-Proof: <unix time>:<HMAC-SHA256 hex>``, an HMAC of
  ``"<method> <path> <time>"`` under a key derived from the job token, with the time within
  :data:`MAX_SKEW_S` of the server's clock; the server compares it in constant time and answers 403
  otherwise. A proof can be replayed within that window, but it only fetches the same file again.
- Nothing is encrypted (like the job's gloo traffic). Integrity is the reader's: a downloaded
  recording is opened through ``sandbox.registry.open_published``, which checks it against the
  ``index_sha256`` in etcd and the data's SHA-256 and CRCs.
- :func:`fetch_role` bounds every socket operation by ``socket_timeout_s`` and the whole download by
  its :class:`Deadline`; any failure raises :class:`RecordingNotFound` saying what to do, and leaves
  no partial file: it writes temporary names and renames them into place, ``index.json`` last.
- A process forked while a server runs closes its copy of the listening socket at once
  (``os.register_at_fork``), so no rank keeps the agent's port open.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import http.client
import os
import re
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import RecordingNotFound
from trainmover_ext.netutil import address_towards

if TYPE_CHECKING:
    from trainmover_ext.launch.config import LaunchConfig

FILES = ("index.json", "tensors.bin")
"""The files of one recorded role (``sandbox.recording``'s ``INDEX_FILE`` and ``DATA_FILE``)."""
PROOF_HEADER = "X-TrainMover-Proof"
MAX_SKEW_S = 300.0
"""How far a proof's time may be from the server's clock (the nodes' clocks must agree this well)."""
CHUNK = 1 << 20
SOCKET_TIMEOUT_S = 30.0
REFUSAL_LOG_S = 60.0
"""A client's refusals are logged once per this many seconds, with the count of those left unlogged."""
"""Longest wait for one socket operation, on both ends: a stalled peer never holds a thread forever."""
_PATH = re.compile(r"/recordings/([A-Za-z0-9_-]{1,64})/(index\.json|tensors\.bin)")
_LIVE: weakref.WeakSet[RecordingServer] = weakref.WeakSet()


def _key(token: str) -> bytes:
    """The proof key: derived from the job token, so the token itself is never an HMAC key elsewhere."""
    return hmac.new(token.encode(), b"trainmover recordings server", hashlib.sha256).digest()


def proof(token: str, method: str, path: str, now: float | None = None) -> str:
    """The ``X-TrainMover-Proof`` value for ``method path`` at ``now`` (default: the current time)."""
    stamp = int(time.time() if now is None else now)
    mac = hmac.new(_key(token), f"{method} {path} {stamp}".encode(), hashlib.sha256).hexdigest()
    return f"{stamp}:{mac}"


def proof_is_valid(key: bytes, method: str, path: str, value: str, now: float) -> bool:
    """Whether ``value`` proves the job token for ``method path`` within :data:`MAX_SKEW_S` of ``now``."""
    stamp, _, mac = value.partition(":")
    if not stamp.isdigit() or abs(now - int(stamp)) > MAX_SKEW_S:
        return False
    want = hmac.new(key, f"{method} {path} {stamp}".encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S  # one request per connection (HTTP/1.0): no idle keep-alive holds a thread

    def do_GET(self) -> None:
        match = _PATH.fullmatch(self.path)
        if match is None:
            return self._refuse(404, "no such recording file")
        if not proof_is_valid(self.server.key, "GET", self.path, self.headers.get(PROOF_HEADER, ""), time.time()):
            self.server.refused(self.client_address[0], self.path)
            return self._refuse(403, "a valid job-token proof is required")
        root = os.path.realpath(self.server.record_dir)
        path = os.path.realpath(os.path.join(root, match.group(1), match.group(2)))
        if os.path.dirname(os.path.dirname(path)) != root or not os.path.isfile(path):
            return self._refuse(404, "no such recording file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            while block := f.read(CHUNK):
                self.wfile.write(block)

    def _refuse(self, code: int, why: str) -> None:
        body = f"{why}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _not_found(self) -> None:
        self._refuse(404, "only GET of a recording file is served")

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_found

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would flood the agent's log; refusals are logged in do_GET


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    record_dir: str
    key: bytes
    log: Callable[[str], None]
    _refusals: dict[str, tuple[float, int]]
    """Per client address: when its last refusal was logged, and how many were refused since."""
    _refusals_lock: threading.Lock

    def refused(self, client: str, path: str) -> None:
        """Log a refusal, at most one line per client per :data:`REFUSAL_LOG_S` (a client that retries, or
        scans, cannot flood the agent's log)."""
        now = time.monotonic()
        with self._refusals_lock:
            logged_at, unlogged = self._refusals.get(client, (-REFUSAL_LOG_S, 0))
            if now - logged_at < REFUSAL_LOG_S:
                self._refusals[client] = (logged_at, unlogged + 1)
                return
            self._refusals[client] = (now, 0)
        more = f" ({unlogged} more refused since the last line)" if unlogged else ""
        self.log(f"refused {path} to {client}: no valid job-token proof{more}")


class _Server6(_Server):
    address_family = socket.AF_INET6


class RecordingServer:
    """Serves ``record_dir``'s recordings on ``host:port`` (0: a free port) from a daemon thread; its
    :attr:`url` names ``advertise`` when given (for a wildcard ``host``), else ``host``."""

    def __init__(
        self,
        record_dir: str,
        token: str,
        host: str,
        port: int = 0,
        *,
        advertise: str | None = None,
        log: Callable[[str], None] = print,
    ):
        if not token:
            raise ValueError("the recording server needs the job token")
        self._advertise = advertise
        self._server = (_Server6 if ":" in host else _Server)((host, port), _Handler)
        self._server.record_dir, self._server.key, self._server.log = record_dir, _key(token), log
        self._server._refusals, self._server._refusals_lock = {}, threading.Lock()
        self._thread = threading.Thread(target=self._server.serve_forever, name="tm-recordings", daemon=True)
        _LIVE.add(self)

    @property
    def url(self) -> str:
        bound, port = self._server.server_address[:2]
        host = self._advertise or str(bound)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> RecordingServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port (safe to call twice)."""
        _LIVE.discard(self)
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def _close_in_child(self) -> None:
        self._server.socket.close()


def _after_fork_in_child() -> None:
    for server in list(_LIVE):
        server._close_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def fetch_role(
    url: str, token: str, role: str, record_dir: str, *, deadline: Deadline, socket_timeout_s: float = SOCKET_TIMEOUT_S
) -> int:
    """Copy ``role``'s recording from the server at ``url`` into ``<record_dir>/<role>/``; returns the bytes
    downloaded (0 when another process of this node did it meanwhile). See the module docstring."""
    dest = os.path.join(record_dir, role)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, ".download.lock"), "w") as lock:
        # The standbys of one machine share a directory: one downloads, the others then find the files.
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline.expired:
                    raise RecordingNotFound(
                        f"another standby of this node was still downloading recording {role} into {dest} "
                        "when --tm-record-timeout ran out: raise it"
                    ) from None
                time.sleep(0.1)
        if os.path.isfile(os.path.join(dest, FILES[0])):
            return 0
        temps = {name: os.path.join(dest, f".{name}.{os.getpid()}.download") for name in FILES}
        try:
            got = sum(_get(url, token, role, name, temps[name], deadline, socket_timeout_s) for name in FILES)
            for name in reversed(FILES):  # the data first, the index last: an index means a complete copy
                os.replace(temps[name], os.path.join(dest, name))
            return got
        finally:
            for temp in temps.values():
                if os.path.exists(temp):
                    os.unlink(temp)


def _get(url: str, token: str, role: str, name: str, out: str, deadline: Deadline, socket_timeout_s: float) -> int:
    path = f"/recordings/{role}/{name}"
    where = f"{url}{path}"
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(
        parts.hostname or "", parts.port, timeout=min(socket_timeout_s, max(deadline.remaining(), 0.1))
    )
    try:
        conn.request("GET", path, headers={PROOF_HEADER: proof(token, "GET", path)})
        resp = conn.getresponse()
        if resp.status == 403:
            raise RecordingNotFound(
                f"{where} refused this standby's job token: start it with the job's --tm-job-token, and keep the "
                f"nodes' clocks within {MAX_SKEW_S:.0f}s of each other"
            )
        if resp.status != 200:
            raise RecordingNotFound(
                f"{where} answered {resp.status} {resp.reason}: the recording node has no such file"
            )
        size, got = int(resp.headers.get("Content-Length", "-1")), 0
        with open(out, "wb") as f:
            while block := resp.read(CHUNK):
                if deadline.expired:
                    raise RecordingNotFound(
                        f"downloading {where} took longer than --tm-record-timeout: raise it, or share "
                        "--tm-record-dir between the nodes"
                    )
                if conn.sock is not None:
                    conn.sock.settimeout(min(socket_timeout_s, max(deadline.remaining(), 0.1)))
                f.write(block)
                got += len(block)
        if got != size:
            raise RecordingNotFound(f"{where}: the connection closed after {got} of {size} bytes; try again")
        return got
    except (OSError, http.client.HTTPException) as exc:
        raise RecordingNotFound(
            f"could not download {where} ({exc}): check that the recording node's agent runs and that this "
            "node reaches it (its address is --recordings-host), or share --tm-record-dir between the nodes"
        ) from exc
    finally:
        conn.close()


def serve_node_recordings(cfg: LaunchConfig, log: Callable[[str], None]) -> RecordingServer | None:
    """An active node's agent: serve its recordings to standbys on other nodes (the module docstring); the
    caller puts the server's URL on the node record. Without the sandbox, a record directory or the job
    token, or when the address cannot be bound, nothing is served (None), and why is logged with ``log``."""
    if not cfg.sandbox or cfg.record_dir is None:
        return None
    if not cfg.rendezvous.token:
        log(
            "sandbox: this node's recordings are not served to other nodes: the job has no token to "
            "authenticate standbys with (pass --tm-job-token); standbys elsewhere do the basic warm-up"
        )
        return None
    try:
        host = cfg.recordings_host or address_towards(cfg.master_addr)
        # bound to every interface, it is still reached at one address: the one the job's nodes use
        shown = address_towards(cfg.master_addr) if host in ("0.0.0.0", "::") else None
        server = RecordingServer(
            cfg.record_dir, cfg.rendezvous.token, host, cfg.recordings_port, advertise=shown, log=log
        ).start()
    except OSError as exc:
        log(
            f"sandbox: cannot serve this node's recordings on {cfg.recordings_host or cfg.master_addr}"
            f"{f':{cfg.recordings_port}' if cfg.recordings_port else ''} ({exc}); standbys on other nodes "
            "do the basic warm-up unless --tm-record-dir is shared (--recordings-host and --recordings-port "
            "pick the address)"
        )
        return None
    log(f"sandbox: serving {cfg.record_dir} to standbys on other nodes at {server.url} (job token required)")
    return server
