"""On-disk recordings: one directory per role, ``index.json`` plus ``tensors.bin``.

Layout under ``record_dir``::

    <role>/tensors.bin   every recorded result tensor, raw bytes, back to back
    <role>/index.json    the index (a JSON-able dict, see :func:`RecordingWriter.finish`)

The index is what the control plane also stores in etcd at ``recordings/<role>``:
per call its op, group kind, group ranks, peer, reduction, iteration and, per
result tensor, shape, dtype, byte offset, length and CRC32; for the whole data
file its length and SHA-256; and the job's config fingerprint.

Contract
- The writer is used by one recorder rank per role. It writes ``tensors.bin``
  first and ``index.json`` last, each through a temporary name and an atomic
  rename, so a reader that finds an index finds a complete recording.
- :class:`Recording` verifies the data file's SHA-256 and every tensor's CRC32
  when it is opened (``verify=True``) and every tensor again when it is read;
  any difference raises :class:`RecordingCorrupt` naming the file and record.
  A corrupt recording is never used.
- Tensors are read on demand with plain file reads (no mmap), so a replaying
  standby's resident memory does not grow with the recording's size.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Any

import torch

from trainmover_ext.errors import RecordingCorrupt, RecordingNotFound

INDEX_VERSION = 1
INDEX_FILE = "index.json"
DATA_FILE = "tensors.bin"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order (bf16 included: viewed as uint8, never via numpy)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def role_dir(record_dir: str, role: str) -> str:
    return os.path.join(record_dir, role)


class RecordingWriter:
    """Appends result tensors to ``<record_dir>/<role>/tensors.bin`` and builds the index."""

    def __init__(self, record_dir: str, role: str):
        self.dir = role_dir(record_dir, role)
        os.makedirs(self.dir, exist_ok=True)
        self._tmp_data = os.path.join(self.dir, f".{DATA_FILE}.{os.getpid()}.tmp")
        self._data = open(self._tmp_data, "wb")
        self._sha = hashlib.sha256()
        self.bytes_written = 0

    def add_tensor(self, tensor: torch.Tensor) -> dict:
        """Append one tensor; returns its index entry (shape, dtype, offset, nbytes, crc32)."""
        raw = tensor_bytes(tensor)
        entry = {
            "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype),
            "offset": self.bytes_written,
            "nbytes": len(raw),
            "crc32": zlib.crc32(raw),
        }
        self._data.write(raw)
        self._sha.update(raw)
        self.bytes_written += len(raw)
        return entry

    def finish(self, header: dict, records: list[dict]) -> dict:
        """Seal the recording; returns the index dict (also written to ``index.json``)."""
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        os.replace(self._tmp_data, os.path.join(self.dir, DATA_FILE))
        index = dict(
            header,
            version=INDEX_VERSION,
            data_file=DATA_FILE,
            data_bytes=self.bytes_written,
            data_sha256=self._sha.hexdigest(),
            records=records,
        )
        tmp_index = os.path.join(self.dir, f".{INDEX_FILE}.{os.getpid()}.tmp")
        with open(tmp_index, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_index, os.path.join(self.dir, INDEX_FILE))
        return index

    def abort(self) -> None:
        """Drop a half-written recording (the directory keeps no index, so nobody reads it)."""
        if not self._data.closed:
            self._data.close()
        if os.path.exists(self._tmp_data):
            os.unlink(self._tmp_data)


class Recording:
    """A sealed recording of one role, opened for replay.

    ``index`` may be given (e.g. read from etcd) instead of reading
    ``index.json``; the tensors always come from ``<record_dir>/<role>/tensors.bin``.
    """

    def __init__(self, record_dir: str, role: str, *, index: dict | None = None, verify: bool = True):
        self.dir = role_dir(record_dir, role)
        self.role = role
        if index is None:
            path = os.path.join(self.dir, INDEX_FILE)
            if not os.path.isfile(path):
                raise RecordingNotFound(
                    f"no recording for role {role!r}: {path} does not exist. The job records its first "
                    "--tm-record-iters iterations into --tm-record-dir; wait for it or point the standby at "
                    "the same shared directory."
                )
            try:
                with open(path) as f:
                    index = json.load(f)
            except (OSError, ValueError) as exc:
                raise RecordingCorrupt(
                    f"{path} is not a readable recording index ({exc}); delete {self.dir} and let the job record again"
                ) from exc
        if index.get("version") != INDEX_VERSION or not isinstance(index.get("records"), list):
            raise RecordingCorrupt(
                f"{self.dir}: index version {index.get('version')!r} is not {INDEX_VERSION} "
                "or has no records; record again with this TrainMover version"
            )
        self.index = index
        self.records: list[dict] = index["records"]
        self.data_path = os.path.join(self.dir, index.get("data_file", DATA_FILE))
        if verify:
            self.verify()

    # --- header accessors -----------------------------------------------------------
    @property
    def rank(self) -> int:
        """The global rank that recorded (the standby replays as this rank)."""
        return int(self.index["rank"])

    @property
    def world_size(self) -> int:
        return int(self.index["layout"]["world_size"])

    @property
    def fingerprint(self) -> dict:
        return self.index["fingerprint"]

    @property
    def data_bytes(self) -> int:
        return int(self.index["data_bytes"])

    # --- integrity ------------------------------------------------------------------
    def verify(self) -> None:
        """Check the data file's size, SHA-256 and every tensor's CRC32; raise :class:`RecordingCorrupt`."""
        try:
            size = os.path.getsize(self.data_path)
        except OSError as exc:
            raise RecordingCorrupt(
                f"{self.data_path} is missing ({exc}); the recording is incomplete: record again"
            ) from exc
        if size != self.data_bytes:
            raise RecordingCorrupt(
                f"{self.data_path} has {size} bytes, the index says {self.data_bytes}: "
                "the recording is truncated or was overwritten; record again"
            )
        sha = hashlib.sha256()
        with open(self.data_path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        if sha.hexdigest() != self.index["data_sha256"]:
            # find the first bad tensor so the message is precise
            for seq, rec in enumerate(self.records):
                for i in range(len(rec["tensors"])):
                    self.read_tensor(seq, i)
            raise RecordingCorrupt(f"{self.data_path}: SHA-256 differs from the index; record again")

    def read_tensor(self, seq: int, i: int) -> torch.Tensor:
        """Tensor ``i`` of record ``seq``, after checking its CRC32."""
        entry = self.records[seq]["tensors"][i]
        with open(self.data_path, "rb") as f:
            f.seek(entry["offset"])
            raw = f.read(entry["nbytes"])
        if len(raw) != entry["nbytes"] or zlib.crc32(raw) != entry["crc32"]:
            rec = self.records[seq]
            raise RecordingCorrupt(
                f"{self.data_path}: tensor {i} of record {seq} ({rec['op']} on {rec['group']}, iteration "
                f"{rec['iteration']}) fails its CRC32 check; the recording is corrupt and is not used. "
                "Delete it and record again."
            )
        dtype = _DTYPES[entry["dtype"]]
        if not raw:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(entry["shape"])

    def summary(self) -> dict[str, Any]:
        """Counts for reports: records, tensor bytes, ops per kind."""
        ops: dict[str, int] = {}
        for rec in self.records:
            ops[rec["op"]] = ops.get(rec["op"], 0) + 1
        return {"role": self.role, "records": len(self.records), "data_bytes": self.data_bytes, "ops": ops}


def load_recordings(record_dir: str, roles: list[str] | None = None, verify: bool = True) -> dict[str, Recording]:
    """Every sealed recording under ``record_dir`` (or the named ``roles``), keyed by role."""
    if roles is None:
        roles = sorted(r for r in os.listdir(record_dir) if os.path.isfile(os.path.join(record_dir, r, INDEX_FILE)))
    return {role: Recording(record_dir, role, verify=verify) for role in roles}
