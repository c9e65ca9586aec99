"""``trainmover launch`` refuses a multi-node job without a shared token, and names its node from the environment."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from harness.jobs import PRETRAIN, REPO_ROOT
from trainmover_ext.errors import ConfigError
from trainmover_ext.launch.agent import Agent
from trainmover_ext.launch.cli import job_token
from trainmover_ext.launch.config import LaunchConfig
from trainmover_ext.launch.identity import node_name
from trainmover_ext.launch.rendezvous import RendezvousPlan


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"tm_job_token": None, "nnodes": 1} | kw))


def test_single_node_generates_a_token():
    assert len(job_token(_args())) >= 24
    assert job_token(_args(tm_job_token="given", nnodes=4)) == "given"


def test_multi_node_without_token_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        job_token(_args(nnodes=2))
    msg = str(err.value)
    assert "--tm-job-token" in msg and "TRAINMOVER_JOB_TOKEN" in msg and "secrets.token_hex" in msg


def test_multi_node_refusal_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMOVER_")}
    cmd = [
        sys.executable,
        "-m",
        "trainmover_ext.cli",
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29400",
        "--tm-etcd-endpoints",
        "127.0.0.1:1",
        "--run-dir",
        str(tmp_path),
        PRETRAIN,
        "--mock-data",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--tm-job-token" in proc.stderr and "multi-node" in proc.stderr, proc.stderr
    assert not os.listdir(tmp_path), "nothing may start before the refusal"


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"TRAINMOVER_NODE_NAME": "rack1-n3", "SLURMD_NODENAME": "node3"}, "rack1-n3"),
        ({"SLURMD_NODENAME": "node3"}, "node3"),
        ({}, socket.gethostname()),
    ],
)
def test_node_name_precedence(environ, expected):
    assert node_name(environ) == expected


def test_ranks_inherit_the_node_name(monkeypatch):
    monkeypatch.delenv("TRAINMOVER_NODE_NAME", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "emulated-node-2")
    agent = Agent(LaunchConfig(script=PRETRAIN, rendezvous=RendezvousPlan(backend="tcp")))
    assert agent.rank_env(0, 1234)["TRAINMOVER_NODE_NAME"] == "emulated-node-2"


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_recordings_port_out_of_range_is_refused(port):
    with pytest.raises(ConfigError, match="--recordings-port must be a TCP port"):
        LaunchConfig(script=PRETRAIN, rendezvous=RendezvousPlan(backend="tcp"), recordings_port=port)


def test_a_process_rotating_through_the_pool_keeps_an_id_of_one_length():
    from trainmover_ext.launch.identity import leaver_standby_id

    assert leaver_standby_id("worker-n0-1-49050e", 2) == "standby-worker-n0-1-49050e-e2"
    assert leaver_standby_id("standby-n0-0-4530dd", 1) == "standby-n0-0-4530dd-e1"
    ids = ["worker-n0-1-49050e"]
    for epoch in (2, 7, 12, 1000):
        ids.append(leaver_standby_id(ids[-1], epoch))
    assert ids[1:] == [f"standby-worker-n0-1-49050e-e{e}" for e in (2, 7, 12, 1000)]
