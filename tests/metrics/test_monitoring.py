"""The shipped Prometheus alert rules and Grafana dashboard: valid, and about metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

from harness.jobs import REPO_ROOT
from trainmover_ext.control.archive import read_jsonl

MONITORING = os.path.join(REPO_ROOT, "scripts", "monitoring")
RULES = os.path.join(MONITORING, "trainmover-alerts.yml")
RULE_TESTS = os.path.join(MONITORING, "trainmover-alerts.test.yml")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")
METRIC = re.compile(r"\btrainmover_[a-z_]+\b")


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make test` installs Debian's prometheus package (apt-get install prometheus)"
    return path


def test_alert_rules_pass_promtool():
    res = subprocess.run([_promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "7 rules found" in res.stdout


def test_alert_unit_tests_pass():
    """`promtool test rules`: the dead job fires, a failed migration at the default settings fires, a job
    without standbys never gets NoStandbyLeft, a finished job gets neither JobDown nor Stalled."""
    res = subprocess.run([_promtool(), "test", "rules", RULE_TESTS], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_alert_unit_tests_fail_on_the_old_rules(tmp_path):
    """Companion: the rules as the issue found them (a failed migration counted by restarts only, no
    standby guard, no dead-job rule) fail the unit tests."""
    rules = open(RULES).read()
    migration = re.search(r"(?s)(- alert: TrainMoverMigrationFailed.*?expr: \|)(.*?)(\n        labels:)", rules)
    rules = rules.replace(migration.group(2), "\n          increase(trainmover_restarts_total[15m]) > 0")
    rules = rules.replace(
        '\n            and on (tm_job) max by (tm_job) (max_over_time(trainmover_members{kind="standby"}[6h])) > 0', ""
    )
    (tmp_path / "trainmover-alerts.yml").write_text(rules)
    shutil.copy(RULE_TESTS, tmp_path)
    res = subprocess.run(
        [_promtool(), "test", "rules", str(tmp_path / os.path.basename(RULE_TESTS))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "TrainMoverMigrationFailed" in out and "TrainMoverNoStandbyLeft" in out, out


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: the same file with one expression broken."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        open(RULES)
        .read()
        .replace("(increase(trainmover_restarts_total[15m])) > 0", "(increase(trainmover_restarts_total[15m]) > 0")
    )
    res = subprocess.run([_promtool(), "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0


def _exported_names(scrape: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(scrape):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def _expressions() -> list[str]:
    dash = json.load(open(DASHBOARD))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    rules = open(RULES).read()
    return exprs + [m.group(0) for m in re.finditer(r"(?s)expr: \|?.*?(?=\n\s+(for|labels):)", rules)]


def test_dashboard_and_rules_use_only_metrics_the_agent_exports(failover_run):
    """Every metric name in every dashboard panel and alert rule is served by a real agent's /metrics
    (scraped during a real failover)."""
    exported = set().union(*(_exported_names(s) for s in failover_run.scrapes[-3:]))
    exprs = _expressions()
    assert len(exprs) >= 20
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    missing = sorted(used - exported)
    assert not missing, f"not exported by the agent: {missing}"
    assert len(used) >= 15, used


def test_dashboard_picks_a_job_and_shows_p99():
    """A `tm_job` variable scopes every query (jobs sharing one Prometheus stay apart); the quantile
    panels have their p99; migrations are annotations; versions are a table, not a constant 1 in time."""
    dash = json.load(open(DASHBOARD))
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "query"] == ["tm_job"]
    targets = [t for p in dash["panels"] for t in p["targets"]]
    unscoped = [t["expr"] for t in targets if '{tm_job=~"$tm_job"' not in t["expr"]]
    assert not unscoped, unscoped
    p99 = [t["expr"] for t in targets if t["expr"].startswith("histogram_quantile(0.99")]
    assert {m for e in p99 for m in METRIC.findall(e)} >= {
        "trainmover_migration_downtime_seconds_bucket",
        "trainmover_iteration_duration_seconds_bucket",
        "trainmover_detection_latency_seconds_bucket",
    }, p99
    assert [a["name"] for a in dash["annotations"]["list"]] == ["Migrations"]
    assert {p["title"]: p["type"] for p in dash["panels"]}["Versions (per agent)"] == "table"


def test_events_and_migrations_outlive_etcd_in_the_run_dir(failover_run):
    run_dir = failover_run.job.metrics_path.replace(".metrics.jsonl", ".run")
    events = list(read_jsonl(os.path.join(run_dir, "events.jsonl")))
    migrations = list(read_jsonl(os.path.join(run_dir, "migrations.jsonl")))
    assert events and all("what" in e and "time" in e for e in events), events
    assert [m["epoch"] for m in migrations] == [1], migrations
    assert "first_iteration" in migrations[0]["steps"]
