"""``benchmarks/control_load.py``'s arithmetic: etcd's counters read from a /metrics page, their rates, which
share a thread's CPU counts in, and the summary's per-round differences. Pure logic; the benchmark itself
runs real jobs and is not a test."""

from __future__ import annotations

import control_load as cl
import pytest

PAGE = """# HELP grpc_server_started_total Total number of RPCs started on the server.
grpc_server_started_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 12
grpc_server_started_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 100
grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_type="bidi_stream"} 300
grpc_server_msg_received_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 100
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 99
etcd_debugging_mvcc_range_total 100
"""


def test_etcd_counters_and_their_rates():
    before = cl.etcd_counters(PAGE)
    assert before == {
        "grpc_server_msg_received_total": {"LeaseKeepAlive": 300.0, "Range": 100.0},
        "grpc_server_started_total": {"LeaseKeepAlive": 12.0, "Range": 100.0},
    }
    after = cl.etcd_counters(PAGE.replace("} 300", "} 330").replace("} 100\n", "} 120\n"))
    rates = cl.counter_rates(before, after, seconds=2.0)
    # Renewals on open streams: messages grew, streams did not (a method whose counter stood still is left out).
    assert rates["grpc_server_msg_received_total"] == {"LeaseKeepAlive": 15.0, "Range": 10.0}
    assert rates["grpc_server_started_total"] == {"Range": 10.0}


@pytest.mark.parametrize(
    ("pid", "tid", "cmdline", "thread", "share"),
    [
        (7, 7, "/usr/bin/etcd\0--name\0x", "etcd", "etcd"),
        (1, 1, "python\0-m\0trainmover_ext.cli", "python", "agent"),
        (1, 3, "python\0-m\0trainmover_ext.cli", "python", "agent"),
        (9, 9, "python\0-m\0trainmover_ext.cli", "python", "rank_main"),
        (9, 11, "python\0-m\0trainmover_ext.cli", "gloo_tcp_loop", "rank_gloo"),
        (9, 12, "python\0-m\0trainmover_ext.cli", "pt_gloo_runloop", "rank_gloo"),
        (9, 13, "python\0-m\0trainmover_ext.cli", "python", "rank_side"),
    ],
)
def test_each_thread_counts_in_one_share(pid, tid, cmdline, thread, share):
    assert cl.classify(pid, tid, launcher=1, cmdline=cmdline, thread=thread) == share


def _job(iteration_s: float, **cpu: float) -> dict:
    return {"iteration_s": iteration_s, "cpu_per_iteration_s": cpu, "etcd_per_s": {}, "etcd_streams_per_s": {}}


def test_the_control_cpu_is_each_rounds_difference_then_the_median():
    rounds = [
        {
            "trainmover": _job(0.2, etcd=0.007, agent=0.004, rank_side=0.001, rank_main=0.3),
            "plain": _job(0.2, etcd=0.002),
        },
        {
            "trainmover": _job(0.3, etcd=0.009, agent=0.005, rank_side=0.001, rank_main=0.9),
            "plain": _job(0.2, etcd=0.002),
        },
        {
            "trainmover": _job(0.2, etcd=0.006, agent=0.004, rank_side=0.0, rank_main=0.1),
            "plain": _job(0.25, etcd=0.001),
        },
    ]
    s = cl.summarize(rounds)
    # The ranks' main threads are training, not control: they stay out of the difference.
    assert s["control_cpu_per_iteration_s"] == {"median": 0.01, "min": 0.009, "max": 0.013, "n": 3}
    assert s["ratio"] == {"median": 1.0, "min": 0.8, "max": 1.5, "n": 3}
    assert s["plain"]["cpu_per_iteration_s"]["etcd"] == {"median": 0.002, "min": 0.001, "max": 0.002, "n": 3}
