"""A standby on another node copies the job's recordings from the recording node's agent.

The server (``trainmover_ext.launch.recording_server``) runs on a real loopback socket: it serves
the two files of a role to a request that proves the job token, and nothing else. The standby's side
(``sandbox.fetch`` through ``registry.wait_for_recordings``) reads the recorder's node and URL from a
real etcd, downloads, and opens the copy only if it is the recording etcd pins: a tampered copy is
refused and deleted.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse

import pytest
import torch

from trainmover_ext.control.records import NodeRecord
from trainmover_ext.deadline import Deadline
from trainmover_ext.errors import RecordingCorrupt, RecordingNotFound
from trainmover_ext.launch.recording_server import FILES, PROOF_HEADER, RecordingServer, fetch_role, proof
from trainmover_ext.sandbox import recording
from trainmover_ext.sandbox.fetch import RecordingFetcher
from trainmover_ext.sandbox.recording import RecordingWriter
from trainmover_ext.sandbox.registry import publish, wait_for_recordings

TOKEN = "remote-recordings-token"


def _record(record_dir: str, role: str = "first") -> str:
    """A sealed recording of ``role`` (three tensors, one of 1.5 MiB: more than one chunk)."""
    writer = RecordingWriter(record_dir, role)
    tensors = [torch.randn(3, 4), torch.arange(7), torch.randn(3 << 17)]
    records = [
        {"seq": 0, "iteration": 1, "op": "allreduce", "group": "dp", "ranks": [0, 1], "peer": None,
         "reduce_op": "SUM", "inputs": [], "tensors": [writer.add_tensor(t) for t in tensors]}
    ]  # fmt: skip
    header = {"role": role, "rank": 0, "layout": {"world_size": 2}, "fingerprint": {}, "start_iteration": 0}
    writer.finish(header, records)
    return os.path.join(record_dir, role)


@pytest.fixture
def served(tmp_path):
    """A recording of role ``first`` under ``tmp_path/src``, served with :data:`TOKEN`."""
    src = str(tmp_path / "src")
    _record(src)
    server = RecordingServer(src, TOKEN, "127.0.0.1", log=lambda msg: None).start()
    try:
        yield server, src
    finally:
        server.close()


def _get(url: str, path: str, *, token: str = TOKEN, method: str = "GET", now: float | None = None):
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, headers={PROOF_HEADER: proof(token, method, path, now)})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_served_files_are_the_recorders_and_the_names_are_the_sandboxs(served, tmp_path):
    server, src = served
    assert FILES == (recording.INDEX_FILE, recording.DATA_FILE)
    for name in FILES:
        status, body = _get(server.url, f"/recordings/first/{name}")
        assert status == 200 and body == open(os.path.join(src, "first", name), "rb").read()
    got = fetch_role(server.url, TOKEN, "first", str(tmp_path / "dst"), deadline=Deadline(30))
    for name in FILES:
        assert (
            open(tmp_path / "dst" / "first" / name, "rb").read() == open(os.path.join(src, "first", name), "rb").read()
        )
    assert got == sum(os.path.getsize(os.path.join(src, "first", n)) for n in FILES)
    assert sorted(os.listdir(tmp_path / "dst" / "first")) == [".download.lock", *sorted(FILES)]  # no temporary left
    # a second call finds the copy and downloads nothing (the standbys of one machine share a directory)
    assert fetch_role(server.url, TOKEN, "first", str(tmp_path / "dst"), deadline=Deadline(30)) == 0


def test_a_wrong_token_or_a_stale_proof_is_refused(served, tmp_path):
    server, _ = served
    assert _get(server.url, "/recordings/first/tensors.bin", token="not-the-job-token")[0] == 403
    assert _get(server.url, "/recordings/first/tensors.bin", now=time.time() - 301)[0] == 403
    assert _get(server.url, "/recordings/first/tensors.bin", now=time.time() + 301)[0] == 403
    # a proof for one file does not open another
    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request(
        "GET",
        "/recordings/first/tensors.bin",
        headers={PROOF_HEADER: proof(TOKEN, "GET", "/recordings/first/index.json")},
    )
    assert conn.getresponse().status == 403
    conn.close()
    with pytest.raises(
        RecordingNotFound, match="refused this standby's job token: start it with the job's --tm-job-token"
    ):
        fetch_role(server.url, "not-the-job-token", "first", str(tmp_path / "dst"), deadline=Deadline(30))
    assert not os.path.exists(tmp_path / "dst" / "first" / "index.json")


def test_refusals_are_logged_once_per_client_and_window(tmp_path, monkeypatch):
    """A client that keeps retrying with a wrong token cannot flood the agent's log: one line per client
    per REFUSAL_LOG_S, the next one counting those left unlogged."""
    from trainmover_ext.launch import recording_server

    src = str(tmp_path / "src")
    _record(src)
    lines: list[str] = []
    server = RecordingServer(src, TOKEN, "127.0.0.1", log=lines.append).start()
    try:
        for _ in range(20):
            assert _get(server.url, "/recordings/first/tensors.bin", token="wrong")[0] == 403
        assert len(lines) == 1 and "refused /recordings/first/tensors.bin to 127.0.0.1" in lines[0], lines
        monkeypatch.setattr(recording_server, "REFUSAL_LOG_S", 0.0)  # the window has passed
        assert _get(server.url, "/recordings/first/index.json", token="wrong")[0] == 403
        assert len(lines) == 2 and lines[1].endswith("(19 more refused since the last line)"), lines
    finally:
        server.close()


def test_paths_outside_the_recordings_and_missing_files_are_not_found(served, tmp_path):
    server, src = served
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "index.json").write_text("secret")
    os.symlink(tmp_path / "secret", os.path.join(src, "linked"))
    for path in (
        "/recordings/../secret/index.json",
        "/recordings/first/../../secret/index.json",
        "/recordings/%2e%2e/secret/index.json",
        "/recordings/first/index.json?x=1",
        "/recordings/first/.index.json.1.tmp",
        "/recordings/linked/index.json",  # a symbolic link out of the directory
        "/recordings/middle/index.json",  # not recorded
        "/recordings/first",
        "/etc/passwd",
    ):
        assert _get(server.url, path)[0] == 404, path
    assert _get(server.url, "/recordings/first/index.json", method="POST")[0] == 404
    assert _get(server.url, "/recordings/first/index.json", method="HEAD")[0] == 404
    with pytest.raises(RecordingNotFound, match="answered 404"):
        fetch_role(server.url, TOKEN, "middle", str(tmp_path / "dst"), deadline=Deadline(30))


def test_a_forked_child_does_not_keep_the_listening_socket(served):
    server, _ = served
    inode = os.fstat(server._server.socket.fileno()).st_ino
    pid = os.fork()
    if pid == 0:
        held = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.add(os.fstat(int(fd)).st_ino)
            except OSError:
                pass
        os._exit(1 if inode in held else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child holds the server's socket"
    assert _get(server.url, "/recordings/first/index.json")[0] == 200  # the parent still serves


def test_a_closed_server_fails_the_download_with_what_to_do(tmp_path):
    server = RecordingServer(str(tmp_path), TOKEN, "127.0.0.1", log=lambda msg: None).start()
    server.close()
    with pytest.raises(RecordingNotFound, match="Connection refused.*share --tm-record-dir"):
        fetch_role(server.url, TOKEN, "first", str(tmp_path / "dst"), deadline=Deadline(30))


# --- the standby's side, against a real etcd -----------------------------------------------------------


@pytest.fixture
def space(etcd):
    """The job's namespace on the real etcd of ``tests/conftest.py``."""
    from trainmover_ext.kv import EtcdClientConfig, EtcdKV
    from trainmover_ext.kv.job import JobSpace

    kv = EtcdKV(EtcdClientConfig(endpoints=etcd.endpoints, timeout_s=3.0))
    try:
        yield JobSpace.create(kv, "remote", TOKEN)
    finally:
        kv.close()


def _publish_from_node(space, monkeypatch, src: str, url: str) -> dict:
    monkeypatch.setenv("TRAINMOVER_NODE_NAME", "n0")
    node = NodeRecord(host="n0", agent="agent-n0", role="active", slots=2, recordings_url=url)
    space.put(space.key("nodes", "n0"), node.to_bytes())
    return publish(space, "first", src)


def _wait(space, dst: str, lines: list[str]):
    return wait_for_recordings(
        record_dir=dst,
        roles=["first"],
        timeout_s=10,
        space=space,
        fetch=RecordingFetcher(space, dst, 10, lines.append),
    )


def test_a_standby_elsewhere_copies_the_recording_and_opens_it(served, space, monkeypatch, tmp_path):
    server, src = served
    summary = _publish_from_node(space, monkeypatch, src, server.url)
    assert summary["node"] == "n0"
    lines: list[str] = []
    dst = str(tmp_path / "standby-machine")
    rec = _wait(space, dst, lines)["first"]
    assert rec.dir == os.path.join(dst, "first") and rec.read_tensor(0, 2).numel() == 3 << 17
    assert len(lines) == 1 and f"from node n0 at {server.url}" in lines[0] and "bytes" in lines[0], lines
    # the recorder's own node (or a shared directory) opens its files: nothing is downloaded
    lines.clear()
    assert _wait(space, src, lines)["first"].dir == os.path.join(src, "first") and lines == []


def test_a_tampered_copy_is_refused_and_deleted(served, space, monkeypatch, tmp_path):
    _, src = served
    summary = _publish_from_node(space, monkeypatch, src, "")
    # A server that hands out the same index with other bytes (a flipped byte in the data).
    evil = str(tmp_path / "evil")
    os.makedirs(os.path.join(evil, "first"))
    for name in FILES:
        data = bytearray(open(os.path.join(src, "first", name), "rb").read())
        if name == "tensors.bin":
            data[100] ^= 0xFF
        open(os.path.join(evil, "first", name), "wb").write(data)
    server = RecordingServer(evil, TOKEN, "127.0.0.1", log=lambda msg: None).start()
    try:
        space.put(
            space.key("nodes", "n0"),
            NodeRecord(host="n0", agent="agent-n0", role="active", slots=2, recordings_url=server.url).to_bytes(),
        )
        dst = str(tmp_path / "standby-machine")
        with pytest.raises(RecordingCorrupt, match="downloaded from node 'n0' is not the one the job published"):
            _wait(space, dst, [])
    finally:
        server.close()
    assert not any(name in FILES for name in os.listdir(os.path.join(dst, "first"))), "the bad copy was kept"
    assert summary["data_sha256"] != ""


def test_a_node_that_serves_nothing_says_what_to_do(served, space, monkeypatch, tmp_path):
    _, src = served
    _publish_from_node(space, monkeypatch, src, "")
    with pytest.raises(
        RecordingNotFound, match="node 'n0', which recorded it, serves no recordings.*share --tm-record-dir"
    ):
        _wait(space, str(tmp_path / "standby-machine"), [])


def test_a_copy_of_an_earlier_recording_is_copied_again(served, space, monkeypatch, tmp_path):
    """A standby machine started again in the same run directory holds a copy of the job's earlier
    recording: it is replaced by the current one. On the recorder's node a differing index is
    corruption, not a stale copy: refused, and nothing is deleted."""
    server, src = served
    _publish_from_node(space, monkeypatch, src, server.url)
    dst = str(tmp_path / "standby-machine")

    def leave_an_earlier_copy() -> None:
        os.makedirs(os.path.join(dst, "first"), exist_ok=True)
        for name in FILES:  # another index (one field more), so another sha256 than etcd pins
            data = open(os.path.join(src, "first", name), "rb").read()
            if name == "index.json":
                data = json.dumps({**json.loads(data), "stale": True}).encode()
            open(os.path.join(dst, "first", name), "wb").write(data)

    leave_an_earlier_copy()
    monkeypatch.setenv("TRAINMOVER_NODE_NAME", "n2")  # the standby machine
    lines: list[str] = []
    rec = _wait(space, dst, lines)["first"]
    assert rec.dir == os.path.join(dst, "first") and "stale" not in rec.index
    assert len(lines) == 1 and "from node n0" in lines[0], lines

    leave_an_earlier_copy()
    monkeypatch.setenv("TRAINMOVER_NODE_NAME", "n0")  # the recorder's node
    with pytest.raises(RecordingCorrupt):
        _wait(space, dst, [])
    assert "stale" in json.loads(open(os.path.join(dst, "first", "index.json")).read())
