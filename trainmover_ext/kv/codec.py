"""Versioned JSON values: the only format TrainMover writes into etcd.

Every value is ``{"tm": <kind>, "v": <schema version>, "data": {...}}``.
Never pickle: values are read by other processes, other versions and humans.

Contract: :func:`decode` raises :class:`MalformedValue` (bytes that are not our
JSON, or the wrong kind) or :class:`SchemaVersionError` (a version this build
cannot read). The message names the key and what to do. It never modifies the
store: a bad value is reported, not repaired, so nothing is lost.

Example::

    raw = encode("member", {"host": "n1"})
    decode(raw, kind="member", key="/trainmover/j/members/a")   # -> {"host": "n1"}
"""

from __future__ import annotations

import json
from typing import Any

from trainmover_ext.errors import MalformedValue, SchemaVersionError

SCHEMA_VERSION = 1
"""The schema version this build writes."""
READABLE_VERSIONS = (1,)
"""Schema versions this build can read."""


def encode(kind: str, data: dict[str, Any], *, version: int = SCHEMA_VERSION) -> bytes:
    """Serialize ``data`` as a ``kind`` record at schema ``version``."""
    return json.dumps({"tm": kind, "v": version, "data": data}, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes, *, kind: str, key: str) -> dict[str, Any]:
    """Parse a ``kind`` record read from ``key``; see the module docstring for errors."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedValue(
            f"{key} does not hold TrainMover JSON ({raw[:40]!r}...): something else wrote it. The value is left "
            f"untouched; inspect it with `etcdctl get {key}` and delete it if it is garbage"
        ) from exc
    if not isinstance(doc, dict) or "tm" not in doc or "v" not in doc or not isinstance(doc.get("data"), dict):
        raise MalformedValue(
            f"{key} holds JSON without the TrainMover envelope (tm/v/data); the value is left untouched"
        )
    if doc["tm"] != kind:
        raise MalformedValue(
            f"{key} holds a {doc['tm']!r} record where a {kind!r} record was expected; the value is left untouched"
        )
    if doc["v"] not in READABLE_VERSIONS:
        raise SchemaVersionError(
            f"{key} holds a {kind!r} record of schema version {doc['v']}, but this TrainMover reads versions "
            f"{list(READABLE_VERSIONS)}: run the same TrainMover version as the job that wrote it. "
            "The value is left untouched"
        )
    data: dict[str, Any] = doc["data"]
    return data
