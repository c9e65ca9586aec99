"""Units of the sandbox without processes: the recording format, op decoding, flags, roles."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainmover_ext.errors import ConfigError
from trainmover_ext.sandbox.ops import decode
from trainmover_ext.sandbox.recording import Recording, RecordingWriter
from trainmover_ext.sandbox.registry import (
    control_role,
    index_sha256,
    keep_role_of_job,
    published_summary,
    roles_of_job,
)


def test_recording_roundtrip_keeps_bits_and_dtypes(tmp_path):
    tensors = [
        torch.randn(3, 4),
        torch.randn(5).to(torch.bfloat16),
        torch.arange(7),
        torch.empty(0),
        torch.tensor([True, False]),
    ]
    writer = RecordingWriter(str(tmp_path), "first")
    records = [
        {
            "seq": 0,
            "iteration": 1,
            "op": "allreduce",
            "group": "dp",
            "ranks": [0, 1],
            "peer": None,
            "reduce_op": "SUM",
            "inputs": [],
            "tensors": [writer.add_tensor(t) for t in tensors],
        }
    ]
    index = writer.finish(
        {
            "role": "first",
            "rank": 0,
            "layout": {"world_size": 2},
            "fingerprint": {},
            "start_iteration": 0,
            "iterations": 1,
            "consumed_samples": 0,
        },
        records,
    )
    rec = Recording(str(tmp_path), "first")
    for i, t in enumerate(tensors):
        got = rec.read_tensor(0, i)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    assert rec.data_bytes == sum(t.numel() * t.element_size() for t in tensors)
    summary = published_summary(rec.index, str(tmp_path))
    assert summary["index_sha256"] == index_sha256(index) and summary["calls"] == 1
    assert summary["records"] == records  # small enough to live in etcd too


def test_no_index_means_not_sealed(tmp_path):
    from trainmover_ext.errors import RecordingNotFound

    writer = RecordingWriter(str(tmp_path), "last")
    writer.add_tensor(torch.ones(2))
    writer.abort()  # a recording that never sealed leaves nothing a standby would read
    with pytest.raises(RecordingNotFound, match="--tm-record-iters"):
        Recording(str(tmp_path), "last")


def test_decode_splits_results_from_inputs():
    out, inp = [torch.empty(2), torch.empty(2)], torch.ones(2)
    call = decode("allgather", ([out], [inp], None), {})
    assert call.op == "allgather" and call.results == out and call.inputs == [inp]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    call = decode("allreduce", ([inp], opts), {})
    assert call.results == [inp] and call.reduce_op == "MAX"
    assert decode("send", ([inp], 2, 0), {}).peer == 2 and decode("send", ([inp], 2, 0), {}).results == []
    assert decode("recv", ([inp], 1, 0), {}).results == [inp]
    assert decode("_allgather_base", (out[0], inp, None), {}).op == "all_gather_single"


def test_roles_per_pipeline_depth():
    assert roles_of_job(1) == ["only"] and roles_of_job(2) == ["first", "last"]
    assert roles_of_job(4) == ["first", "middle", "last"]
    assert control_role("only") == "first" and control_role("middle") == "middle"


def test_kept_role_per_pipeline_depth():
    """--tm-keep-role names a pipeline role; a PP=1 job's only role serves first and last."""
    assert keep_role_of_job("last", 2) == "last" and keep_role_of_job("middle", 3) == "middle"
    assert keep_role_of_job("first", 1) == "only" and keep_role_of_job("none", 4) is None
    with pytest.raises(ConfigError, match="pipeline roles are first, last"):
        keep_role_of_job("middle", 2)
    with pytest.raises(ConfigError, match="one pipeline stage"):
        keep_role_of_job("middle", 1)


def _config(argv):
    import argparse

    from trainmover_ext.config import add_trainmover_args, config_from_args

    return config_from_args(add_trainmover_args(argparse.ArgumentParser()).parse_args(argv))


def test_sandbox_flags_are_wired():
    from trainmover_ext.config import NOT_WIRED

    cfg = _config(
        [
            "--tm-record-iters",
            "3",
            "--tm-record-dir",
            "/shared/rec",
            "--tm-compile",
            "--tm-record-timeout",
            "12.5",
            "--tm-keep-role",
            "first",
        ]
    )
    assert (cfg.record_iters, cfg.record_dir, cfg.compile, cfg.record_timeout_s) == (3, "/shared/rec", True, 12.5)
    assert cfg.keep_role == "first" and _config([]).keep_role == "last"
    assert not {"tm_record_iters", "tm_record_dir", "tm_compile"} & set(NOT_WIRED)
    for bad, flag in (
        (["--tm-record-iters", "0"], "--tm-record-iters"),
        (["--tm-record-timeout", "0"], "--tm-record-timeout"),
        (["--tm-record-dir", " "], "--tm-record-dir"),
    ):
        with pytest.raises(ConfigError, match=flag):
            _config(bad)


def _benchmark_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "warmup.py")
    spec = importlib.util.spec_from_file_location("tm_bench_warmup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_ratio_is_the_stayers_first_iteration_over_the_iterations_beside_it():
    # Synthetic hand-over of rank 1 at boundary s=20: stayers (ranks 0, 2) take 0.05 s, except
    # 0.10 s right after the switch; the leaver (before) and the newcomer (after) are slower still,
    # which must not count: only the stayers measure the job's iteration.
    bench = _benchmark_module()
    s, its = 20, {}
    for k in range(s - 9, s + 13):
        stay = 0.10 if k == s + 1 else (0.06 if k == s + 12 else 0.05)
        its[k] = [(("job", 0), 0, 0.0, stay, 0.0), (("job", 2), 2, 0.0, stay - 0.01, 0.0)]
        its[k].append(
            (("job", 1), 1, 0.0, 0.5, 0.0)
            if k <= s
            else (("newcomer", 3), 1, 0.0, 0.9 if k == s + 1 else 0.3, 0.02 if k == s + 1 else 0.0)
        )
    fig = bench.trial_figures(its, {"switch_at": s, "rank": 1, "epoch": 3}, steady_iters=12)
    assert fig["ratio"] == pytest.approx(2.0) and fig["null_ratio"] == pytest.approx(1.0)
    assert fig["own_ratio"] == pytest.approx(3.0) and fig["steady_s"] == pytest.approx(0.05)
    assert fig["gc_first_s"] == pytest.approx(0.02)


def test_benchmark_isolation_compares_each_probe_window_with_the_quiet_one_after_it():
    # Job iterations of 0.1 s from t=0; probe 0 (unpaced) warms over [2, 4) and doubles them, probe 1
    # (duty 0.25) over [6, 8) and leaves them alone; each is followed by as long a quiet window.
    bench = _benchmark_module()
    steps = []
    for k in range(1, 100):
        t0 = 0.1 * (k - 1)
        slow = 2.0 <= t0 < 4.0
        steps.append({"iteration": k, "t0": t0, "t1": t0 + (0.2 if slow else 0.1)})
    results = {
        ("job", 0): {"steps": steps},
        ("probe", 0): {
            "warm_start": 2.0,
            "warm_end": 4.0,
            "nice": 0,
            "duty": 1.0,
            "paused_s": 0.0,
            "warm_new_sockets": 0,
            "steps": [],
        },
        ("probe", 1): {
            "warm_start": 6.0,
            "warm_end": 8.0,
            "nice": 0,
            "duty": 0.25,
            "paused_s": 1.5,
            "warm_new_sockets": 0,
            "steps": [],
        },
    }
    job_time = {st["iteration"]: st["t1"] - st["t0"] for st in steps}
    probes = [bench.isolation(results, job_time, 2, n) for n in range(2)]
    assert probes[0]["ratio_of_medians"] == pytest.approx(2.0) and probes[1]["ratio_of_medians"] == pytest.approx(1.0)
    by_duty = bench.isolation_by_duty(probes)
    assert [(d["standby_duty"], d["ratio_of_medians"]) for d in by_duty] == [(1.0, 2.0), (0.25, 1.0)]


def test_adoption_walk_repoints_every_mutable_holder_and_names_the_rest():
    """sandbox.adopt.walk: references in dicts, lists, attributes, slots and closure cells are replaced;
    one in a tuple cannot be, and is reported (the standby then builds the model anew)."""
    from trainmover_ext.sandbox.adopt import walk

    old, new = object(), object()

    class Slotted:
        __slots__ = ("group",)

    def closure_over(group):
        return lambda: group

    holder = type("Holder", (), {})()
    holder.attr, holder.items, holder.table, holder.fn = old, [1, old], {"k": old}, closure_over(old)
    holder.frozen = ("x", old)
    holder.slotted = Slotted()
    holder.slotted.group = old
    replaced, stuck = walk([holder], {id(old): new}, rewrite=True)
    assert replaced == 5 and stuck == ["tuple"]
    assert holder.attr is new and holder.items[1] is new and holder.table["k"] is new
    assert holder.fn() is new and holder.slotted.group is new
    assert walk([holder], {id(old): new}, rewrite=False) == (0, ["tuple"])


def test_pacer_keeps_cpu_within_its_duty_and_stops_at_once():
    """--tm-standby-duty: the pause owed is CPU time / duty minus the wall time already passed."""
    import threading
    import time

    from trainmover_ext.sandbox.pacing import Pacer

    cpu = [0.0]
    pacer = Pacer(0.25, cpu_clock=lambda: cpu[0])
    assert pacer.pace() == 0.0  # nothing used yet
    cpu[0] = 0.02  # 20 ms of CPU at a 25% share: 80 ms of wall time in all
    t0 = time.monotonic()
    slept = pacer.pace()
    assert 0.05 <= slept and time.monotonic() - t0 >= 0.05
    assert pacer.pace() == 0.0, "the debt is paid"
    assert Pacer(1.0, cpu_clock=lambda: 100.0).pace() == 0.0, "duty 1 never pauses"

    cpu[0] = 1000.0  # a long pause owed (capped at max_pause_s) ...
    capped = Pacer(0.5, cpu_clock=lambda: cpu[0], max_pause_s=30.0)
    cpu[0] = 2000.0
    done = threading.Event()
    threading.Thread(target=lambda: (capped.pace(), done.set()), daemon=True).start()
    time.sleep(0.05)
    capped.stop()  # ... ends at once on a promotion
    assert done.wait(5.0)
    assert capped.pace() == 0.0
    with pytest.raises(ValueError):
        Pacer(0.0)


def test_standby_duty_flag():
    from trainmover_ext.config import TrainMoverConfig

    assert TrainMoverConfig(standby_duty=0.25).standby_duty == 0.25
    with pytest.raises(ConfigError, match="--tm-standby-duty"):
        TrainMoverConfig(standby_duty=1.5)


def test_shadow_iterations_run_on_the_device_of_the_recorded_job():
    """A job on NCCL trains on CUDA, so its standby's shadow model is built on CUDA (megatron-core's bf16
    optimizer takes CUDA parameters only; scripts/gpu_check.sh runs the GPU case). A job on gloo: CPU."""
    from trainmover_ext.sandbox.shadow import shadow_device

    assert shadow_device("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert shadow_device("nccl") == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(ConfigError, match="no CUDA device"):
            shadow_device("nccl")


def test_a_kept_model_on_another_device_is_not_adopted():
    """A standby that warmed on one device and is promoted onto another builds its model anew."""
    from types import SimpleNamespace

    from trainmover_ext.errors import KeptRoleUnusable
    from trainmover_ext.sandbox.adopt import KeptRole, adopt, adopt_or_build

    def kept() -> KeptRole:
        parts = SimpleNamespace(layout=SimpleNamespace(device=torch.device("cuda", 0)), model=[], optimizer=None)
        return KeptRole(role="first", rank=0, session=parts)

    promoted = SimpleNamespace(device=torch.device("cuda", 1))
    with pytest.raises(KeptRoleUnusable, match="is on cuda:0, the rank runs on cuda:1"):
        adopt(kept(), promoted, None, 0)
    session, why, replaced = adopt_or_build(kept(), promoted, None, 0, build=lambda why: ("built", why))
    assert session == ("built", why) and "cuda:1" in why and replaced == 0
