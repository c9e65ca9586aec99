"""The agent's Prometheus /metrics: unit tests of the feed, and a scrape over loopback during a real failover."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from support.scraped_job import FAULT_ITER
from trainmover_ext.control.records import MemberRecord, MigrationPlan, RankRecord, migration_key_suffix
from trainmover_ext.control.view import epoch_value
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.kv.memory import MemoryKV
from trainmover_ext.metrics import AgentMetrics, MetricsFeed, migration_phases


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without ``tm_job``) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "tm_job"))
            out[(s.name, labels)] = s.value
    return out


def value(text: str, name: str, **labels) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


# -- units ---------------------------------------------------------------------------


def test_phases_are_named_by_the_step_they_end_in():
    steps = {"first_iteration": 9.0, "detected": 1.0, "decided": 1.5, "joined": 4.0, "transferred": 6.0}
    assert migration_phases(steps) == [
        ("decided", 1.0, 1.5),
        ("joined", 1.5, 4.0),
        ("transferred", 4.0, 6.0),
        ("first_iteration", 6.0, 9.0),
    ]
    assert migration_phases({"detected": 1.0}) == []


def test_feed_tails_iterations_and_counts_a_rerun_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"event": "iteration", "iteration": 99, "iteration_s": 9.0}) + "\n")  # an earlier run
    m = AgentMetrics(job="j")
    feed = MetricsFeed(m, metrics_file=str(path), tokens_per_iteration=1000)
    recs = [{"event": "startup"}] + [
        {"event": "iteration", "iteration": i, "iteration_s": 0.5} for i in (1, 2, 3, 3, 4)
    ]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    with open(path, "a") as f:
        f.write(text[:-10])  # the last record is still being written
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_iterations_total") == 3 and value(out, "trainmover_iteration") == 3
    with open(path, "a") as f:
        f.write(text[-10:])
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_iterations_total") == 4, "iteration 3 re-ran after an abandon: counted once"
    assert value(out, "trainmover_last_iteration_seconds") == 0.5
    assert value(out, "trainmover_tokens_per_second") == 2000
    assert value(out, "trainmover_iteration_duration_seconds_count") == 5


def test_feed_reads_membership_and_finished_migrations():
    space = JobSpace.create(MemoryKV(), "j", "tok")
    members = [
        MemberRecord(member_id="w0", kind="worker", host="a", pid=1),
        MemberRecord(member_id="s0", kind="standby", host="b", pid=2, warm_roles=["first", "last"]),
        MemberRecord(member_id="s1", kind="standby", host="b", pid=3),  # still warming
        MemberRecord(member_id="ag", kind="agent", host="a", pid=4),
    ]
    for rec in members:
        space.put(space.key("members", rec.member_id), rec.to_bytes())
    space.put(space.key("ranks", 0), RankRecord(rank=0, member_id="w0").to_bytes())
    plan = MigrationPlan(
        epoch=1,
        reason="failure",
        replacements=[],
        resume_iteration=5,
        status="preparing",
        steps={"detected": 10.0, "decided": 10.01},
    )
    key = space.key("migrations", migration_key_suffix(1))
    space.put(key, plan.to_bytes())
    m = AgentMetrics(job="j")
    feed = MetricsFeed(m, metrics_file=None)
    feed.attach(space)
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_members", kind="worker") == 1 and value(out, "trainmover_standbys_ready") == 1
    assert value(out, "trainmover_migrations_total", kind="failure") == 1
    assert value(out, "trainmover_migrations_total", kind="planned") == 0
    assert value(out, "trainmover_migration_phase_seconds_count", kind="failure", phase="decided") == 0, (
        "not finished yet"
    )
    plan.status, plan.steps = "done", plan.steps | {"joined": 10.5, "transferred": 11.0, "first_iteration": 12.0}
    space.put(key, plan.to_bytes())
    feed.poll()
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_migrations_total", kind="failure") == 1, "one plan is one migration"
    assert value(out, "trainmover_migration_phase_seconds_count", kind="failure", phase="joined") == 1
    assert (
        abs(value(out, "trainmover_migration_phase_seconds_sum", kind="failure", phase="first_iteration") - 1.0) < 1e-9
    )
    assert abs(value(out, "trainmover_migration_downtime_seconds_sum", kind="failure") - 2.0) < 1e-9


def test_tokens_loss_progress_and_build_info(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = AgentMetrics(job="j")
    feed = MetricsFeed(m, metrics_file=str(path), tokens_per_iteration=1000)
    recs = [
        {"event": "iteration", "iteration": i, "iteration_s": 0.5, "loss": 6.0 - i, "t_end": 100.0 + i}
        for i in (1, 2, 2, 3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_tokens_total") == 3000, "a re-run iteration's tokens count once"
    assert value(out, "trainmover_loss") == 3.0
    assert value(out, "trainmover_last_progress_timestamp_seconds") == 103.0
    info = [k for k in samples(out) if k[0] == "trainmover_build_info"]
    assert len(info) == 1 and dict(info[0][1])["megatron_core"] == "0.16.1", info


def test_job_wide_series_come_from_the_leader_only():
    space = JobSpace.create(MemoryKV(), "j", "tok")
    space.put(space.key("members", "w0"), MemberRecord(member_id="w0", kind="worker", host="a", pid=1).to_bytes())
    leading = {"now": False}
    m = AgentMetrics(job="j")
    feed = MetricsFeed(m, metrics_file=None)
    feed.attach(space, is_leader=lambda: leading["now"])
    feed.poll()
    out = m.render().decode()
    assert not [k for k in samples(out) if k[0] in ("trainmover_members", "trainmover_migrations_total")], out
    leading["now"] = True
    feed.poll()
    out = m.render().decode()
    assert value(out, "trainmover_members", kind="worker") == 1
    assert ("trainmover_migrations_total", (("kind", "failure"),)) in samples(out)


def test_a_stopping_agent_keeps_its_last_job_wide_figures():
    """The agent detaches its feed before its controller resigns: the finished job's migrations stay
    exported. Companion: an agent whose controller merely lost the lead clears them."""
    space = JobSpace.create(MemoryKV(), "j", "tok")
    plan = MigrationPlan(epoch=1, reason="failure", replacements=[], resume_iteration=5)
    space.put(space.key("migrations", migration_key_suffix(1)), plan.to_bytes())
    leading = {"now": True}
    for detach in (True, False):
        m = AgentMetrics(job="j")
        feed = MetricsFeed(m, metrics_file=None)
        feed.attach(space, is_leader=lambda: leading["now"])
        leading["now"] = True
        feed.poll()
        assert value(m.render().decode(), "trainmover_migrations_total", kind="failure") == 1
        if detach:
            feed.detach()
        leading["now"] = False  # the controller resigned
        feed.poll()
        exported = [k for k in samples(m.render().decode()) if k[0] == "trainmover_migrations_total"]
        if detach:
            assert value(m.render().decode(), "trainmover_migrations_total", kind="failure") == 1
        else:
            assert exported == [], exported


# -- a real job ------------------------------------------------------------------------


def test_scrape_during_a_failover(failover_run):
    """The iteration counter rises, and the failure migration is counted, while the job runs."""
    scrapes = failover_run.scrapes
    iterations = [value(s, "trainmover_iterations_total") for s in scrapes]
    failures = [value(s, "trainmover_migrations_total", kind="failure") for s in scrapes]
    assert iterations == sorted(iterations) and iterations[0] < FAULT_ITER < iterations[-1], iterations
    assert failures[0] == 0 and failures[-1] == 1, failures
    # the iteration counter keeps rising after the migration
    after = [it for it, f in zip(iterations, failures, strict=False) if f == 1]
    assert after and after[-1] > after[0], (iterations, failures)
    last = scrapes[-1]
    # 5 for up to one lease TTL: the promoted standby registers as a worker before the dead one's lease expires
    assert max(value(s, "trainmover_members", kind="worker") for s in scrapes) >= 4
    assert value(last, "trainmover_membership_epoch") == 1
    assert value(last, "trainmover_tokens_per_second") > 0 and value(last, "trainmover_last_iteration_seconds") > 0
    assert value(last, "trainmover_detection_latency_seconds_count") == 1
    assert value(last, "trainmover_migration_phase_seconds_count", kind="failure", phase="first_iteration") == 1
    assert max(value(s, "trainmover_standbys_ready") for s in scrapes) >= 1
    assert value(last, "trainmover_tokens_total") > 0 and value(last, "trainmover_loss") > 0
    assert value(last, "trainmover_last_progress_timestamp_seconds") > 0
    # the migration finished, and the job's end was scraped before its series vanished (--metrics-linger)
    assert value(last, "trainmover_migration_in_progress_seconds") == 0
    assert value(last, "trainmover_job_finished") == 1 and value(scrapes[0], "trainmover_job_finished") == 0


def test_an_unfinished_migration_ages_and_a_finished_one_does_not():
    """``trainmover_migration_in_progress_seconds``: the age of the newest epoch's plan while it is not done."""
    import time

    space = JobSpace.create(MemoryKV(), "j", "tok")
    space.put(space.key("epoch"), epoch_value(1))
    plan = MigrationPlan(epoch=1, reason="failure", replacements=[], resume_iteration=5)
    plan.steps = {"detected": time.time() - 400}
    space.put(space.key("migrations", migration_key_suffix(1)), plan.to_bytes())
    m = AgentMetrics(job="j")
    feed = MetricsFeed(m, metrics_file=None)
    feed.attach(space)
    feed.poll()
    assert value(m.render().decode(), "trainmover_migration_in_progress_seconds") >= 400
    plan.status = "done"  # companion: finished, it no longer counts
    space.put(space.key("migrations", migration_key_suffix(1)), plan.to_bytes())
    feed.poll()
    assert value(m.render().decode(), "trainmover_migration_in_progress_seconds") == 0


def test_linger_waits_for_one_more_scrape_only_when_scraped():
    import threading
    import urllib.request

    m = AgentMetrics(job="j")
    port = m.serve(0)
    try:
        assert m.linger(5) is False  # nobody ever scraped: no wait
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=5).read()
        threading.Timer(0.3, lambda: urllib.request.urlopen(url, timeout=5).read()).start()
        assert m.linger(5) is True
        assert m.linger(0.2) is False  # no scrape comes: it gives up at the limit
    finally:
        m.close()
