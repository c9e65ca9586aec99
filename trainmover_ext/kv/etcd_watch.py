"""One prefix watch on etcd, over pyetcd's watch streams (used by :class:`~trainmover_ext.kv.etcd.EtcdKV`).

Contract:
- The callback gets each response's events in revision order, on the stream's thread; an exception it
  raises is logged and the watch goes on.
- After stream loss (an etcd restart, the network) the watch re-subscribes on another thread from the
  revision after the last delivered event, until cancelled; if etcd compacted those revisions meanwhile,
  it re-reads its range, delivers every key written since as a put (deletes in that gap are not seen),
  and watches on from there.
- A watch hears its own range and no other. pyetcd sends one create at a time on a client's stream and
  gives the next "created" answer to whichever create waits then: when a create timed out (etcd stalled)
  and etcd answered it later, that answer went to the *next* watch created, which then heard the first
  one's keys and never its own (a waiter that never woke; it was seen once, two ranks of a 16-rank start
  waiting out a 120 s timeout). So a client's creates take one lock, and after a timed-out create the
  client creates its watches on a new stream: the late answer arrives on the old one, where no create
  waits, and pyetcd cancels that watch. Watches already on the old stream stay there; each is cancelled
  on the stream it was created on.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from trainmover_ext.errors import StoreError
from trainmover_ext.kv.base import WatchCallback, WatchEvent, WatchHandle, prefix_end

if TYPE_CHECKING:
    from trainmover_ext.kv.etcd import EtcdKV

logger = logging.getLogger(__name__)


def compacted_error() -> type[Exception]:
    """pyetcd's error for a watch whose start revision etcd compacted away."""
    import pyetcd.exceptions as pe

    error: type[Exception] = pe.RevisionCompactedError
    return error


class EtcdWatch(WatchHandle):
    """See the module docstring; built by :meth:`EtcdKV.watch_prefix <trainmover_ext.kv.etcd.EtcdKV.watch_prefix>`."""

    def __init__(
        self, kv: EtcdKV, prefix: str, callback: WatchCallback, start_revision: int, end: str | None = None
    ) -> None:
        self.kv, self.prefix, self.callback = kv, prefix, callback
        self.end = end or prefix_end(prefix)
        self.next_revision = start_revision
        self.watch_id: int | None = None
        self._watcher: Any = None
        """The pyetcd watcher (one gRPC stream) this watch was created on: its cancel goes there."""
        self.cancelled = threading.Event()
        self._lock = threading.Lock()

    def _on_response(self, response: Any) -> None:
        if self.cancelled.is_set() or self.kv._closed:
            return
        if response is None or isinstance(response, Exception):
            # The stream died (server restart, network; None: it ended without an error) or etcd compacted
            # the revisions this watch was to resume from. Re-subscribe from where we stopped on another
            # thread: this callback runs on the dying watcher thread.
            compacted = isinstance(response, compacted_error())
            logger.log(
                logging.WARNING if compacted else logging.INFO,
                "etcd watch on %s lost (%s); re-subscribing from revision %d",
                self.prefix,
                "history compacted" if compacted else response,
                self.next_revision,
            )
            threading.Thread(target=self._resubscribe, args=(compacted,), name="tm-etcd-rewatch", daemon=True).start()
            return
        events = []
        for ev in response.events:
            kind = "delete" if type(ev).__name__ == "DeleteEvent" else "put"
            events.append(
                WatchEvent(kind=kind, key=ev.key.decode(), value=bytes(ev.value), mod_revision=ev.mod_revision)
            )
        if not events:
            return
        self.next_revision = events[-1].mod_revision + 1
        try:
            self.callback(events)
        except Exception:  # a user callback bug must not kill the shared watcher thread
            logger.exception("watch callback on %s failed", self.prefix)

    def subscribe(self) -> None:
        """Create the watch on etcd; raises what pyetcd raises (``WatchTimedOut`` when etcd did not
        confirm it within the client timeout), after which the client creates watches on a new stream."""
        import pyetcd.exceptions as pe

        client = self.kv._client()
        kwargs: dict[str, Any] = {"range_end": self.end}
        if self.next_revision:
            kwargs["start_revision"] = self.next_revision
        with self.kv._watch_create_lock:
            watcher = client.watcher
            try:
                self.watch_id = client.add_watch_callback(self.prefix, self._on_response, **kwargs)
            except pe.WatchTimedOut:
                # etcd may still answer this create; on this stream, that answer would go to the next
                # create (see the module docstring). The next creates go to a new stream; this one keeps
                # its watches and cancels the late one.
                if client.watcher is watcher:
                    client.watcher = client.get_watcher()
                raise
            self._watcher = watcher

    def delivery_thread_id(self) -> int | None:
        """The native id of the pyetcd watcher thread this watch was created on (its stream's reader)."""
        thread = getattr(self._watcher, "_callback_thread", None)
        return getattr(thread, "native_id", None)

    def _catch_up(self) -> None:
        """The revisions from ``next_revision`` on were compacted away: deliver the range as it is now
        (each key written since, as a put) and go on watching after that read."""
        snap = self.kv.get_prefix(self.prefix, end=self.end)
        events = [
            WatchEvent(kind="put", key=e.key, value=e.value, mod_revision=e.mod_revision)
            for e in snap.entries
            if e.mod_revision >= self.next_revision
        ]
        self.next_revision = snap.revision + 1
        if events and not self.cancelled.is_set():
            try:
                self.callback(events)
            except Exception:  # as in _on_response: a user callback bug must not stop the watch
                logger.exception("watch callback on %s failed", self.prefix)

    def _resubscribe(self, catch_up: bool = False) -> None:
        """Watch again from ``next_revision``; with ``catch_up`` (or once etcd says that revision was
        compacted) re-read the range first (:meth:`_catch_up`). Tries until cancelled."""
        delay = 0.05
        while not self.cancelled.is_set() and not self.kv._closed:
            try:
                if catch_up:
                    self._catch_up()
                    catch_up = False
                with self._lock:
                    self.subscribe()
                return
            except compacted_error():
                logger.warning(
                    "etcd compacted the history of %s past revision %d while the watch was down; re-reading it",
                    self.prefix,
                    self.next_revision,
                )
                catch_up = True
            except Exception as exc:  # keep trying until cancelled: watchers must outlive outages
                logger.debug("re-watch of %s failed: %s", self.prefix, exc)
                if self.kv.logged_in:  # a restarted etcd forgot the token the watch stream carried
                    try:
                        self.kv._relogin()
                    except StoreError as login_exc:
                        logger.debug("login again for the re-watch of %s failed: %s", self.prefix, login_exc)
                self.kv._rotate()
                self.cancelled.wait(delay)
                delay = min(delay * 2, 1.0)

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.watch_id is not None and self._watcher is not None and not self.kv._closed:
            try:
                self._watcher.cancel(self.watch_id)
            except Exception:  # the stream may already be gone; nothing to cancel then
                pass
