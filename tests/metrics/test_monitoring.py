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
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")
METRIC = re.compile(r"\btrainmover_[a-z_]+\b")


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make test` installs Debian's prometheus package (apt-get install prometheus)"
    return path


def test_alert_rules_pass_promtool():
    res = subprocess.run([_promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 rules found" in res.stdout


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: the same file with one expression broken."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        open(RULES)
        .read()
        .replace("increase(trainmover_restarts_total[15m]) > 0", "increase(trainmover_restarts_total[15m] > 0")
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


def test_events_and_migrations_outlive_etcd_in_the_run_dir(failover_run):
    run_dir = failover_run.job.metrics_path.replace(".metrics.jsonl", ".run")
    events = list(read_jsonl(os.path.join(run_dir, "events.jsonl")))
    migrations = list(read_jsonl(os.path.join(run_dir, "migrations.jsonl")))
    assert events and all("what" in e and "time" in e for e in events), events
    assert [m["epoch"] for m in migrations] == [1], migrations
    assert "first_iteration" in migrations[0]["steps"]
