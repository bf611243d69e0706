"""dashboards/: the example Prometheus configuration and the Grafana dashboard.

Fast (no training): promtool checks the configuration, the dashboard's JSON model is
checked against Grafana's import format and docs/metrics.md, and a real Prometheus
(tests/promserver.py), configured from dashboards/prometheus.yml, scrapes a tiny exporter
that this test serves through a ``file_sd`` file and answers every panel's query.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from promserver import (
    PROMTOOL,
    PrometheusServer,
    check_prerequisites,
    dashboard_queries,
    free_port,
    iter_panels,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "dashboards" / "prometheus.yml"
DASHBOARD = ROOT / "dashboards" / "orch-job.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

DS_UID = "${DS_PROMETHEUS}"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan", "start", "end"}
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER_RE = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[a-zA-Z]*)")
_IDENT_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_DOC_ROW_RE = re.compile(r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*([^|]*?)\s*\|", re.MULTILINE)
_LABEL_VALUES_RE = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")


# --------------------------------------------------------------------------- helpers

def expr_metric_names(expr: str) -> set[str]:
    """Metric names an (un-substituted) PromQL expression selects: identifiers outside
    strings, label matchers, ranges and grouping lists that are neither function calls nor
    keywords. ``{__name__=...}`` selectors are not resolved."""
    text = _STRING_RE.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING_RE.sub(" ", text)
    text = _NUMBER_RE.sub(" ", text)
    names = set()
    for m in _IDENT_RE.finditer(text):
        if text[m.end():].lstrip().startswith("("):
            continue  # a function or aggregation
        if m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def documented_metrics() -> tuple[set[str], set[str]]:
    """``(names, histograms)`` from the tables of docs/metrics.md (first column a
    backquoted name, second its type)."""
    names, histograms = set(), set()
    for name, kind in _DOC_ROW_RE.findall(METRICS_DOC.read_text()):
        names.add(name)
        if kind.startswith("histogram"):
            histograms.add(name)
    return names, histograms


def is_documented(name: str, names: set[str], histograms: set[str]) -> bool:
    """``name`` is in the doc, or is a documented histogram's ``_bucket``/``_sum``/``_count``."""
    if name in names:
        return True
    return any(name.endswith(sfx) and name[: -len(sfx)] in histograms
               for sfx in HISTOGRAM_SUFFIXES)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return iter_panels(board["panels"])


def refers_to_input(datasource: Any) -> bool:
    """A panel's or target's ``datasource`` names the ``DS_PROMETHEUS`` import input."""
    if isinstance(datasource, str):
        return datasource == DS_UID
    return isinstance(datasource, dict) and datasource.get("uid") == DS_UID


# --------------------------------------------------------------------------- (a) config

@pytest.mark.integration
def test_promtool_accepts_the_example_config() -> None:
    check_prerequisites()
    proc = subprocess.run([str(PROMTOOL), "check", "config", str(CONFIG)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"promtool check config failed:\n{proc.stdout}{proc.stderr}"


def test_example_config_scrapes_orch_targets_with_honor_labels() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "orch"
    assert job["honor_labels"] is True
    (sd,) = job["file_sd_configs"]
    assert sd["files"] == ["targets/*.json"]
    assert "refresh_interval" in sd
    gitignore = (ROOT / "dashboards" / "targets" / ".gitignore").read_text().split()
    assert gitignore == ["*", "!.gitignore"]


# --------------------------------------------------------------------------- (b) dashboard

def test_expr_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, rank) (rate(orch_a_bucket{job="$job", '
            'le!="x y"}[$__rate_interval]))) / on (node) group_left(gpu) orch_b offset 5m '
            'or vector(1e9) > bool 2 and time() - orch_c{node=~"n.*"}')
    assert expr_metric_names(expr) == {"orch_a_bucket", "orch_b", "orch_c"}


def test_dashboard_is_an_importable_grafana_model() -> None:
    board = load_dashboard()
    for key in ("__inputs", "__requires", "panels", "templating", "time", "refresh",
                "schemaVersion", "title", "uid"):
        assert key in board, f"dashboard lacks {key!r}"
    assert board["title"] == "orch job"
    assert board["uid"] and len(board["uid"]) <= 40
    assert board["schemaVersion"] >= 38
    assert board["refresh"] == "5s"
    assert board["time"]["to"] == "now"
    (ds_input,) = [i for i in board["__inputs"] if i["name"] == "DS_PROMETHEUS"]
    assert ds_input["type"] == "datasource" and ds_input["pluginId"] == "prometheus"
    required = {(r["type"], r["id"]) for r in board["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    used_types = {p["type"] for p in all_panels(board) if p["type"] != "row"}
    assert used_types <= {r["id"] for r in board["__requires"] if r["type"] == "panel"}

    variables = {v["name"]: v for v in board["templating"]["list"]}
    job, attempt = variables["job"], variables["attempt"]
    for var in (job, attempt):
        assert var["type"] == "query"
        assert refers_to_input(var["datasource"])
    assert job["definition"] == "label_values(orch_agent_up, job)"
    assert attempt["definition"] == 'label_values(orch_agent_up{job="$job"}, attempt)'
    assert attempt["includeAll"] and attempt["multi"]
    assert attempt["allValue"] == ".*"


def test_every_panel_is_complete() -> None:
    board = load_dashboard()
    panels = all_panels(board)
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    titles = [p.get("title") for p in panels if p["type"] != "row"]
    for panel in panels:
        what = f"panel {panel.get('id')} {panel.get('title')!r}"
        pos = panel.get("gridPos") or {}
        assert set(pos) >= {"h", "w", "x", "y"}, f"{what}: gridPos {pos}"
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, f"{what}: gridPos {pos}"
        if panel["type"] == "row":
            continue
        assert panel.get("title"), f"{what}: no title"
        assert titles.count(panel["title"]) == 1, f"{what}: title used twice"
        assert refers_to_input(panel.get("datasource")), f"{what}: datasource"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{what}: no unit"
        assert panel.get("targets"), f"{what}: no targets"
        ref_ids = [t.get("refId") for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"{what}: refIds {ref_ids}"
        for target in panel["targets"]:
            expr = target.get("expr", "")
            assert expr.strip(), f"{what}: empty expr"
            assert refers_to_input(target.get("datasource", panel["datasource"])), what
            assert target.get("legendFormat"), f"{what}: {expr}: no legendFormat"
            # Every selector of an orch series is scoped to the chosen job and attempts.
            for m in re.finditer(r"\b(orch_\w+)(\{[^}]*\})?", expr):
                sel = m.group(2) or ""
                assert 'job="$job"' in sel and 'attempt=~"$attempt"' in sel, \
                    f"{what}: {m.group(0)} is not scoped to $job/$attempt"
            for rng in re.findall(r"\[([^\]]*)\]", expr):
                assert rng == "$__rate_interval", f"{what}: range [{rng}] in {expr}"
            if re.search(r"\b(rate|irate|increase|deriv)\(", expr):
                assert "$__rate_interval" in expr, f"{what}: {expr}"


def test_per_rank_and_per_node_legends() -> None:
    for panel in all_panels(load_dashboard()):
        for target in panel.get("targets") or []:
            expr, legend = target["expr"], target["legendFormat"]
            aggregated = re.match(r"\s*(count|sum|max|min|avg)\s*\(", expr)
            if aggregated:
                continue
            if "orch_rank_" in expr:
                assert "{{rank}}" in legend and "{{node}}" in legend, (panel["title"], legend)
            elif "orch_node_gpu_" in expr:
                assert "{{node}}" in legend and "{{gpu}}" in legend, (panel["title"], legend)
            elif "orch_node_" in expr:
                assert "{{node}}" in legend, (panel["title"], legend)


def test_gpu_panels_are_in_a_collapsed_row_and_say_they_may_be_empty() -> None:
    board = load_dashboard()
    rows = [p for p in board["panels"] if p["type"] == "row" and p["title"] == "GPU"]
    assert len(rows) == 1 and rows[0]["collapsed"] is True
    nested = rows[0]["panels"]
    assert nested
    for panel in nested:
        assert all("orch_node_gpu_" in t["expr"] for t in panel["targets"]), panel["title"]
        assert "CPU-only" in panel.get("description", ""), panel["title"]
    outside = [p for p in all_panels(board) if p not in nested]
    for panel in outside:
        assert not any("gpu" in t["expr"] for t in panel.get("targets") or []), panel["title"]


def test_every_metric_in_the_dashboard_is_documented() -> None:
    names, histograms = documented_metrics()
    assert {"orch_agent_up", "orch_rank_step", "orch_jobs"} <= names, "doc tables not parsed"
    assert "orch_rank_step_duration_seconds" in histograms
    used: dict[str, list[str]] = {}
    for panel in all_panels(load_dashboard()):
        for target in panel.get("targets") or []:
            for name in expr_metric_names(target["expr"]):
                used.setdefault(name, []).append(panel["title"])
    for var in load_dashboard()["templating"]["list"]:
        m = _LABEL_VALUES_RE.match(var["definition"])
        if m and m.group(1):
            for name in expr_metric_names(m.group(1)):
                used.setdefault(name, []).append(f"variable {var['name']}")
    assert "orch_rank_step_duration_seconds_bucket" in used
    undocumented = {n: t for n, t in used.items() if not is_documented(n, names, histograms)}
    assert not undocumented, f"metrics not in docs/metrics.md: {undocumented}"


def test_dashboard_queries_substitutes_variables(tmp_path: Path) -> None:
    board = {"panels": [
        {"title": "a", "targets": [{"expr": 'x{job="$job", attempt=~"${attempt}"}'}]},
        {"title": "r", "type": "row", "panels": [
            {"title": "b", "targets": [{"expr": 'rate(y{job="${job}"}[$__rate_interval])'},
                                       {"expr": "z[$__interval]"}]}]},
    ]}
    path = tmp_path / "board.json"
    path.write_text(json.dumps(board))
    assert dashboard_queries(path, job="j", attempt="2", rate_interval="1m") == [
        ("a", 'x{job="j", attempt=~"2"}'),
        ("b", 'rate(y{job="j"}[1m])'),
        ("b", "z[5s]"),
    ]
    board["panels"][0]["targets"][0]["expr"] = "x{node=\"$node\"}"
    path.write_text(json.dumps(board))
    with pytest.raises(ValueError, match=r"\$node"):
        dashboard_queries(path, job="j")


# --------------------------------------------------------------------------- (c) Prometheus

def make_test_config(tmp_path: Path, targets_dir: Path, interval: str = "1s") -> Path:
    """dashboards/prometheus.yml with every interval set to ``interval`` and the file_sd
    files pointed at ``targets_dir``; its rule files made absolute; nothing else changed."""
    config = yaml.safe_load(CONFIG.read_text())
    for key in ("scrape_interval", "scrape_timeout", "evaluation_interval"):
        if key in config.get("global", {}):
            config["global"][key] = interval
    for job in config["scrape_configs"]:
        for key in ("scrape_interval", "scrape_timeout"):
            if key in job:
                job[key] = interval
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(targets_dir / "*.json")]
            sd["refresh_interval"] = interval
    # the alert rules, relative to dashboards/ in the file: absolute here, where the copy is elsewhere
    config["rule_files"] = [str(CONFIG.parent / f) for f in config.get("rule_files", [])]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def exporter() -> Iterator[int]:
    """A tiny exporter on 127.0.0.1 serving what one node agent of job ``j`` would:
    yields its port."""
    registry = CollectorRegistry()
    node = {"job": "j", "attempt": "1", "node": "n0"}
    Gauge("orch_agent_up", "agent serves", list(node), registry=registry).labels(**node).set(1)
    Gauge("orch_rank_up", "rank runs", [*node, "rank"],
          registry=registry).labels(**node, rank="0").set(1)
    Gauge("orch_rank_step", "last step", [*node, "rank"],
          registry=registry).labels(**node, rank="0").set(7)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def write_targets(path: Path, groups: list[dict[str, Any]]) -> None:
    """Write a file_sd file atomically (Prometheus never reads half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


@pytest.mark.timeout(90)
@pytest.mark.integration
def test_prometheus_scrapes_file_sd_targets_and_answers_every_panel(
        tmp_path: Path, exporter: int) -> None:
    check_prerequisites()
    targets_dir = tmp_path / "targets"
    targets_dir.mkdir()
    config = make_test_config(tmp_path, targets_dir)
    address = f"127.0.0.1:{exporter}"
    labels = {"job": "j", "attempt": "1", "node": "n0"}
    target_file = targets_dir / "j.1.json"

    with PrometheusServer(config, tmp_path / "prom") as prom:
        assert prom.targets() == []
        write_targets(target_file, [{"targets": [address], "labels": labels}])

        # The target appears with the file's labels and is scraped.
        (target,) = prom.wait_for_targets(
            lambda ts: len(ts) == 1 and ts[0]["health"] == "up", timeout=15)
        assert target["scrapePool"] == "orch"
        assert target["labels"] == {**labels, "instance": address}, target
        assert target["scrapeUrl"] == f"http://{address}/metrics"

        # honor_labels: the series keep their own labels; nothing is renamed exported_*.
        (up,) = prom.wait_for('orch_agent_up{job="j"}', lambda r: len(r) == 1, timeout=10)
        assert up["metric"] == {"__name__": "orch_agent_up", **labels, "instance": address}
        assert up["value"][1] == "1"
        assert prom.query('{__name__=~"orch_.*", exported_job!=""}') == []
        assert prom.query('{__name__=~"orch_.*", exported_node!=""}') == []

        # Every panel's query parses and runs; the ones this exporter feeds have data.
        queries = dashboard_queries(DASHBOARD, job="j", attempt="1", rate_interval="20s")
        assert len(queries) >= 15
        errors, results = [], {}
        for title, expr in queries:
            try:
                results.setdefault(title, []).append(prom.query(expr))
            except AssertionError as exc:  # collect them all, then report together
                errors.append(f"{title}: {exc}")
        assert not errors, "Prometheus rejected dashboard queries:\n" + "\n".join(errors)
        assert [r["value"][1] for r in results["Nodes up"][0]] == ["1"]
        assert [r["value"][1] for r in results["Step"][0]] == ["7"]
        assert [r["metric"]["rank"] for r in results["Step per rank"][0]] == ["0"]

        # The variables list what Grafana's label_values() would.
        variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
        for name, expected in (("job", ["j"]), ("attempt", ["1"])):
            m = _LABEL_VALUES_RE.match(variables[name]["definition"])
            assert m, variables[name]["definition"]
            match = m.group(1).replace("$job", "j") if m.group(1) else None
            assert prom.label_values(m.group(2), match=match) == expected

        # The attempt ends: orch removes the file, the target goes, its series go stale.
        target_file.unlink()
        prom.wait_for_targets(lambda ts: ts == [], timeout=15)
        prom.wait_for('orch_agent_up{job="j"}', lambda r: r == [], timeout=10)
