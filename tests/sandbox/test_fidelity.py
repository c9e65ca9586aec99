"""Replay fidelity and isolation: one general standby warms first, middle and last from the job's
recordings; each shadow iteration is bit-identical (loss, gradients, parameters) to the rank that
recorded it, and the standby never has a link to the job."""

from __future__ import annotations

import pytest

from support.sandbox_jobs import RECORD_ITERS

ROLES = ("first", "middle", "last")
GROUP_CLASS = {"gloo": "ReplayProcessGroup", "nccl_delta": "DeltaProcessGroup"}


@pytest.fixture(scope="module", params=["gloo", "nccl_delta"])
def comm(request):
    return request.param


@pytest.fixture(scope="module")
def pp3_job(request, comm):
    """The recorded job, with its groups on gloo or on nccl_delta (``--trainmover``)."""
    return request.getfixturevalue("pp3_job" if comm == "gloo" else "pp3_delta_job")


@pytest.fixture(scope="module")
def standby(pp3_job):
    """One standby process warming all three roles in turn (forked, never told the job's store)."""
    from harness import sandbox as harness

    kids = harness.fork_children({"standby": (harness.standby_process, pp3_job.argv, 3, pp3_job.record_dir)})
    return kids.results(300)["standby"]


def test_recorders_one_per_role_and_hooks_removed(pp3_job):
    assert sorted(r["role"] for r in pp3_job.ranks.values() if r["recorded"]) == sorted(ROLES)
    for rank in pp3_job.ranks.values():
        assert rank["hooks_while_recording"], "the recorder rank's class hooks were not installed"
        assert rank["hooks_after"] == [], f"rank {rank['rank']} still has recorder hooks after sealing"


@pytest.mark.parametrize("role", ROLES)
def test_shadow_iteration_is_bit_identical(pp3_job, standby, role):
    job = {s["iteration"]: s for s in pp3_job.recorder(role)["steps"]}
    shadow = [s for s in standby["shadow"] if s["role"] == role]
    assert [s["iteration"] for s in shadow] == list(range(1, RECORD_ITERS + 1))
    for s in shadow:
        real = job[s["iteration"]]
        assert s["loss"] == real["loss"], f"{role} iteration {s['iteration']}: loss {s['loss']} != {real['loss']}"
        assert s["grad"] == real["grad"], f"{role} iteration {s['iteration']}: gradients differ"
        assert s["param"] == real["param"], f"{role} iteration {s['iteration']}: parameters after the step differ"
    if role == "last":
        assert all(s["loss"] is not None for s in shadow)


def test_standby_is_isolated(standby, comm):
    # Structural: the only process groups the standby ever had are the replay session's (no transport;
    # on nccl_delta they wear the job's class so compiled code fits the promoted process), it opened
    # no socket while warming, and it leaves no process group behind.
    assert standby["group_classes"] == [(GROUP_CLASS[comm], True)], standby["group_classes"]
    assert standby["new_sockets"] == [], f"the standby opened sockets: {standby['new_sockets']}"
    assert standby["initialized_after"] is False
    assert standby["kept_models"] == 0, "a warmed model was kept: nothing reuses it, it would sit beside the rank's"
    for result in standby["results"]:
        assert result["replayed_calls"] > 0 and result["replayed_bytes"] > 0


def test_standby_peak_rss_within_an_active_rank(pp3_job, standby):
    # Both forked from this test process, so shared pages count alike. The standby drops each role's
    # model before building the next: its peak is one role's, not three.
    job_peak = max(r["peak_rss_bytes"] for r in pp3_job.ranks.values())
    standby_peak = max(r["peak_rss_bytes"] for r in standby["results"])
    assert standby_peak <= job_peak * 1.05, f"standby peak {standby_peak} > active rank peak {job_peak}"


def test_a_promotion_stops_the_shadow_iteration_at_its_next_collective(pp3_job):
    """A standby promoted inside a shadow iteration stops at its next replayed call, not at the end of the
    iteration (on the 2-core machine a shadow iteration took 0.25 s, which every rank then waited for):
    the interrupted role is dropped, and no process group is left behind."""
    from harness import sandbox as harness
    from trainmover_ext.sandbox.recording import load_recordings

    first = load_recordings(pp3_job.record_dir, ["first"])["first"]
    per_iteration = sum(1 for r in first.records if r["iteration"] == first.records[0]["iteration"])
    assert per_iteration > 3
    promoted_in_call = per_iteration + 3  # three calls into the second shadow iteration of the first role
    kids = harness.fork_children(
        {"standby": (harness.standby_process, pp3_job.argv, 3, pp3_job.record_dir, ["first"], None, promoted_in_call)}
    )
    out = kids.results(300)["standby"]
    assert out["calls_when_stopped"] == [promoted_in_call], out["calls_when_stopped"]
    assert len(out["shadow"]) == 1, [s["iteration"] for s in out["shadow"]]  # the second one never ended
    assert out["results"] == [] and out["kept_models"] == 0
    assert out["initialized_after"] is False
