"""GPU health: NVML's answers parsed and judged (recorded answers, on any machine), the agent's report turned into
a flagged rank by the straggler watch, and on a machine with a GPU the real NVML read."""

from __future__ import annotations

import pytest

from trainmover_ext.control.records import GpuHealthReport, MemberRecord, RankRecord, StragglerPolicy
from trainmover_ext.control.straggler_watch import POLICY_KEY, StragglerWatch
from trainmover_ext.control.view import read_view
from trainmover_ext.kv import Guard, MemoryKV
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.launch.gpu_health import GpuHealthWatch, parse, problems

# What read_nvml returns, as an H200 answers: busy and healthy; idle; held down by heat after XID 79.
BUSY = {
    "throttle_mask": 0x0,
    "sm_clock_mhz": 1980,
    "max_sm_clock_mhz": 1980,
    "temperature_c": 58,
    "power_mw": 612345,
    "ecc_uncorrected": 0,
    "ecc_corrected": 3,
    "xid_errors": [],
}
IDLE = BUSY | {"throttle_mask": 0x1, "sm_clock_mhz": 345, "power_mw": 76000}
CAPPED = BUSY | {"throttle_mask": 0x4 | 0x2, "sm_clock_mhz": 1710}
HOT = BUSY | {"throttle_mask": 0x40 | 0x20, "sm_clock_mhz": 1110, "temperature_c": 91, "xid_errors": [79, 79]}
ECC = {"throttle_mask": 0x0, "ecc_uncorrected": 2, "xid_errors": [48]}
OLD_DRIVER = {"xid_errors": []}  # a driver that answered none of the queries


def test_a_busy_idle_or_power_capped_gpu_is_fit():
    for raw in (BUSY, IDLE, CAPPED, OLD_DRIVER):
        assert problems(parse(0, raw)) == [], raw
    assert parse(0, IDLE).throttle == ("gpu_idle",)
    assert parse(0, BUSY).power_w == pytest.approx(612.345)
    assert parse(0, CAPPED).throttle == ("applications_clocks_setting", "sw_power_cap")


def test_heat_xid_and_uncorrected_ecc_make_a_gpu_unfit():
    assert problems(parse(1, HOT)) == [
        "XID errors [79]",
        "clocks held down: sw_thermal_slowdown, hw_thermal_slowdown (SM clock 1110 of 1980 MHz)",
    ]
    assert problems(parse(2, ECC)) == ["XID errors [48]", "2 uncorrected ECC errors"]
    assert parse(0, {"throttle_mask": 0x1000, "xid_errors": []}).throttle == ("unknown_0x1000",)


def test_an_unfit_gpu_flags_the_rank_in_its_slot_once():
    """The agent of h0 reports slot 1 unfit: rank 1 (h0, local rank 1) is flagged with the reason and, under
    migrate, its move requested; the same process is not flagged again, nor a rank of another slot."""
    space = JobSpace.create(MemoryKV(), "j", "tok")
    for r in range(2):
        member = MemberRecord(member_id=f"w{r}", kind="worker", host="h0", pid=10 + r)
        space.put(space.key("members", member.member_id), member.to_bytes())
        rec = RankRecord(rank=r, member_id=f"w{r}", host="h0", role="first", local_rank=r)
        space.put(space.key("ranks", r), rec.to_bytes())
    standby = MemberRecord(member_id="s", kind="standby", host="h1", pid=20, warm_roles=["first"])
    space.put(space.key("members", "s"), standby.to_bytes())
    space.put(space.key("epoch"), encode("epoch", {"epoch": 0}))
    space.put(space.key(*POLICY_KEY), StragglerPolicy(action="migrate").to_bytes())
    watch = StragglerWatch(space, "ctl", lambda: Guard.absent(space.key("nobody")))
    assert watch.tick(read_view(space)) == []
    found = problems(parse(1, HOT))
    space.put(space.key("health", "h0"), GpuHealthReport(host="h0", unfit={"0": [], "1": found}).to_bytes())
    (flag,) = watch.tick(read_view(space))
    assert (flag.rank, flag.slot, flag.action) == (1, 1, "migrate") and "XID errors [79]" in flag.reason
    assert [r.rank for r in read_view(space).requests.values()] == [1]
    assert watch.tick(read_view(space)) == []


def test_a_machine_without_nvml_reads_nothing():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_nvml_reads_every_local_gpu covers it")
    watch = GpuHealthWatch(slots=4)
    assert watch.start() is False and watch.poll(now=1e9) is None


def test_nvml_reads_every_local_gpu():
    """On a GPU machine (scripts/gpu_check.sh): NVML opens every device, a read answers clocks and temperature,
    and an idle or busy healthy GPU has no problems; a second read soon after reports no change."""
    pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the container image has it)")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        pytest.skip(f"needs an NVIDIA driver: {exc}")
    if count == 0:
        pytest.skip("needs a GPU")
    watch = GpuHealthWatch(slots=count, interval_s=0.0)
    assert watch.start()
    try:
        found = watch.poll(now=1.0)
        assert found is not None and sorted(found) == list(range(count))
        for index, reading in watch.readings.items():
            assert reading.sm_clock_mhz and reading.temperature_c is not None, reading
            assert found[index] == [], f"GPU {index}: {found[index]} ({reading})"
        assert watch.poll(now=2.0) is None
    finally:
        watch.close()


def test_the_agent_exports_each_slots_gpu_as_series():
    from trainmover_ext.metrics import AgentMetrics

    metrics = AgentMetrics(job="j")
    readings = {0: parse(0, BUSY), 1: parse(1, HOT)}
    metrics.observe_gpus(readings, {i: problems(r) for i, r in readings.items()})
    text = metrics.render().decode()
    assert 'trainmover_gpu_unfit{slot="0",tm_job="j"} 0.0' in text
    assert 'trainmover_gpu_unfit{slot="1",tm_job="j"} 1.0' in text
    assert 'trainmover_gpu_xid_errors{slot="1",tm_job="j"} 2.0' in text
    assert 'trainmover_gpu_sm_clock_mhz{slot="1",tm_job="j"} 1110.0' in text
    assert 'trainmover_gpu_temperature_celsius{slot="1",tm_job="j"} 91.0' in text
    metrics.close()
