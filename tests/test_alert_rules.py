"""dashboards/orch-alerts.yml: ``promtool check rules`` accepts it, ``promtool test rules`` passes its unit
tests (dashboards/orch-alerts.test.yml: each alert fires on a synthetic faulty series and on no healthy one),
every rule carries a severity and a summary and description, every alert is unit-tested firing, and every
alert is documented in docs/metrics.md. The real-Prometheus test is tests/test_prometheus_alerts.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT
from orchestrator.observe.metrics import GOODPUT_JOBS, ControllerMetrics
from orchestrator.store import JobState, Store
from promserver import PROMTOOL, check_prerequisites

RULES = ROOT / "dashboards" / "orch-alerts.yml"
UNIT = ROOT / "dashboards" / "orch-alerts.test.yml"
ALERTS = {"OrchJobFailed", "OrchNodeLost", "OrchNodeUnreachable", "OrchRestartLoop", "OrchNoProgress",
          "OrchStraggler", "OrchGoodputLow", "OrchGpuFault"}


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    check_prerequisites()
    return subprocess.run([str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_promtool_check_rules_accepts_the_alert_file() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in r.stdout


@pytest.mark.integration
def test_promtool_unit_tests_pass() -> None:
    r = _promtool("test", "rules", str(UNIT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.integration
def test_the_unit_tests_fail_when_a_rule_breaks(tmp_path: Path) -> None:
    """The unit tests do test the expressions: with OrchJobFailed matching RUNNING jobs, they fail."""
    shutil.copy(UNIT, tmp_path / UNIT.name)
    text = RULES.read_text()
    broken = text.replace('orch_job_state{state="FAILED"} == 1', 'orch_job_state{state="RUNNING"} == 1')
    assert broken != text
    (tmp_path / RULES.name).write_text(broken)
    r = _promtool("test", "rules", UNIT.name, cwd=tmp_path)
    assert r.returncode != 0 and "alertname: OrchJobFailed" in r.stdout + r.stderr, r.stdout + r.stderr


def test_every_rule_has_severity_summary_description_and_a_firing_unit_test() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == ALERTS and len(rules) == len(ALERTS)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert "{{ $labels.job }}" in rule["annotations"]["summary"], rule["alert"]
        assert "orch " in rule["annotations"]["description"], rule["alert"]  # says which orch command to run
    fired = {t["alertname"] for test in yaml.safe_load(UNIT.read_text())["tests"]
             for t in test["alert_rule_test"] if t["exp_alerts"]}
    assert fired == ALERTS


def test_every_alert_is_documented_with_its_expression() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    section = doc.split("## Alert rules", 1)[1].split("\n## ", 1)[0]
    for rule in _rules():
        assert f"`{rule['alert']}`" in section, rule["alert"]
        first = re.split(r"\s+", rule["expr"].strip())[0]  # e.g. orch_job_state{state="FAILED"}
        assert first in section, (rule["alert"], first)


def _job_states(store: Store) -> dict[str, dict[str, str]]:
    text = generate_latest(ControllerMetrics(store).registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "orch_job_state"]
    assert all(s.value == 1 for s in family.samples)
    return {s.labels["job"]: {k: v for k, v in s.labels.items() if k != "job"} for s in family.samples}


def test_orch_job_state_names_each_job_its_state_cause_and_node(tmp_path: Path) -> None:
    store = Store(tmp_path / "orch.db")
    for job_id, name in (("a-000001", "a"), ("b-000002", "b"), ("c-000003", "c")):
        store.create_job(job_id, name, {})
        store.set_state(job_id, JobState.PROVISIONING)
    store.set_state("a-000001", JobState.FAILED, cause={"kind": "rank_exit", "message": "rank 1 exited 1"})
    store.set_state("b-000002", JobState.FAILED, cause={"kind": "node_lost", "node": "n2", "message": "lost"})
    assert _job_states(store) == {
        "a-000001": {"name": "a", "state": "FAILED", "cause": "rank_exit", "node": ""},
        "b-000002": {"name": "b", "state": "FAILED", "cause": "node_lost", "node": "n2"},
        "c-000003": {"name": "c", "state": "PROVISIONING", "cause": "", "node": ""}}


def test_orch_job_state_is_bounded_to_the_newest_jobs_and_every_unfinished_one(tmp_path: Path) -> None:
    clock = [1000.0]
    store = Store(tmp_path / "orch.db", clock=lambda: clock[0])
    store.create_job("old-000000", "old", {})  # the oldest, still PENDING: always listed
    for i in range(1, GOODPUT_JOBS + 11):
        clock[0] += 1
        store.create_job(f"j-{i:06d}", "j", {})
        store.set_state(f"j-{i:06d}", JobState.CANCELLED, cause={"kind": "cancelled"})
    states = _job_states(store)
    assert len(states) == GOODPUT_JOBS + 1 and states["old-000000"]["state"] == "PENDING"
    assert "j-000001" not in states and f"j-{GOODPUT_JOBS + 10:06d}" in states
