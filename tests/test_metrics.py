"""Metrics of ranks and nodes (agents/report.py, agents/metrics.py) without a training job:
real rank processes call ``agents.report`` in prometheus_client's multiprocess mode, and the
node's collector serves what they wrote, the way an agent does (docs/metrics.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.metrics import NodeCollector, NodeMetrics, ProgressReader, gpu_stats, serve
from conftest import ROOT

LABELS = {"job": "j-1", "attempt": "2", "node": "n0"}

# A rank: reports ``steps`` steps (loss NaN at step 3), then prints its pid.
RANK = textwrap.dedent("""
    import os, sys
    from agents import report
    steps = int(sys.argv[1])
    for step in range(1, steps + 1):
        report.step(step, loss=float("nan") if step == 3 else 1.0 / step, samples=4, tokens=128, lr=0.01 * step,
                    step_seconds=0.05 * step)
    print(os.getpid())
""")


def _rank(env: dict[str, str], rank: int, steps: int) -> int:
    full = {**os.environ, "ORCH_JOB_ID": "j-1", "ORCH_ATTEMPT": "2", "ORCH_NODE": "n0", "RANK": str(rank), **env}
    r = subprocess.run([sys.executable, "-c", RANK, str(steps)], env=full, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return int(r.stdout.strip())


def _families(collector: NodeCollector) -> dict[str, list]:
    text = _scrape_text(collector)
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _scrape_text(collector: NodeCollector) -> str:
    server, port, why = serve(0, collector, "127.0.0.1")
    try:
        assert why is None
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
        server.server_close()


def _by_rank(samples: list, name: str) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in samples if s.name == name}


@pytest.mark.integration
def test_ranks_report_through_multiprocess_files_and_the_node_serves_them(tmp_path: Path) -> None:
    metrics = NodeMetrics(str(tmp_path / "attempt"), 0, prometheus=True)
    metrics.create()
    pid0 = _rank(metrics.rank_env(0), 0, steps=5)
    pid1 = _rank(metrics.rank_env(1), 1, steps=3)
    exits = {0: (pid0, None), 1: (pid1, None)}
    collector = NodeCollector("j-1", 2, "n0", lambda: exits, metrics, restarts=1)
    fams = _families(collector)

    assert _by_rank(fams["orch_rank_step"], "orch_rank_step") == {"0": 5.0, "1": 3.0}
    loss = _by_rank(fams["orch_rank_loss"], "orch_rank_loss")
    assert loss["0"] == 0.2 and math.isnan(loss["1"])  # rank 1's last step had a NaN loss: kept as NaN
    assert _by_rank(fams["orch_rank_learning_rate"], "orch_rank_learning_rate") == {"0": 0.05, "1": 0.03}
    assert _by_rank(fams["orch_rank_tokens"], "orch_rank_tokens_total") == {"0": 640.0, "1": 384.0}
    assert _by_rank(fams["orch_rank_samples"], "orch_rank_samples_total") == {"0": 20.0, "1": 12.0}
    tps = _by_rank(fams["orch_rank_tokens_per_second"], "orch_rank_tokens_per_second")
    assert tps == pytest.approx({"0": 128 / 0.25, "1": 128 / (0.05 * 3)})
    hist = fams["orch_rank_step_duration_seconds"]
    assert _by_rank(hist, "orch_rank_step_duration_seconds_count") == {"0": 5.0, "1": 3.0}
    assert math.isclose(_by_rank(hist, "orch_rank_step_duration_seconds_sum")["0"], 0.05 * 15)
    le_01 = {s.labels["rank"]: s.value for s in hist
             if s.name.endswith("_bucket") and s.labels["le"] == "0.1"}
    assert le_01 == {"0": 2.0, "1": 2.0}  # steps of 0.05 and 0.10 s
    assert fams["orch_agent_up"][0].labels == LABELS
    # every series has exactly the documented labels: never a pid
    for name, samples in fams.items():
        for s in samples:
            assert "pid" not in s.labels, (name, s.labels)
            keys = set(s.labels) - {"le"}
            assert keys in ({"job", "attempt", "node"}, {"job", "attempt", "node", "rank"}), (name, s.labels)
            assert {k: s.labels[k] for k in LABELS} == LABELS
    assert _by_rank(fams["orch_rank_restarts"], "orch_rank_restarts_total") == {"0": 1.0, "1": 1.0}

    # a rank's exit: mark_process_dead drops its live gauges (throughput), its last step stays
    metrics.rank_exited(pid1)
    exits[1] = (pid1, 0)
    fams = _families(collector)
    assert _by_rank(fams["orch_rank_tokens_per_second"], "orch_rank_tokens_per_second") == {"0": 128 / 0.25}
    assert _by_rank(fams["orch_rank_step"], "orch_rank_step") == {"0": 5.0, "1": 3.0}
    assert _by_rank(fams["orch_rank_up"], "orch_rank_up") == {"0": 1.0, "1": 0.0}
    assert _by_rank(fams["orch_rank_exit_code"], "orch_rank_exit_code") == {"1": 0.0}

    # the same steps, read for the controller: one latest point per rank, then nothing new
    reader = ProgressReader(metrics, [0, 1])
    reader.poll()
    changes = reader.changes(most=3)
    assert sorted(changes) == [0, 1]
    assert [p["step"] for p in changes[0]] == [1, 3, 5] and [p["step"] for p in changes[1]] == [1, 2, 3]
    assert math.isnan(changes[1][-1]["loss"]) and changes[0][-1]["tokens_per_second"] == 128 / 0.25
    assert reader.latest[0]["step"] == 5 and reader.latest[0]["source"] == "report"
    assert reader.totals == {0: {"samples": 20.0, "tokens": 640.0}, 1: {"samples": 12.0, "tokens": 384.0}}
    reader.poll()
    assert reader.changes() == {}

    metrics.remove()
    assert not (tmp_path / "attempt").exists()


@pytest.mark.integration
def test_report_does_nothing_outside_orch_and_never_raises(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    code = ("from agents import report\nreport.step(1, loss=1.0)\n"
            "import os\nos.environ['ORCH_JOB_ID'] = 'j'\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    # inside orch, with a report file that cannot be written: one warning, training goes on
    bad = {**env, "ORCH_JOB_ID": "j", "ORCH_REPORT_FILE": str(tmp_path / "missing" / "r.jsonl")}
    code = "from agents import report\nfor s in range(3):\n    report.step(s, loss=1.0)\nprint('trained')\n"
    r = subprocess.run([sys.executable, "-c", code], env=bad, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "trained"
    assert r.stderr.count("orch report: cannot report step") == 1, r.stderr


@pytest.mark.integration
def test_deepspeed_monitor_rows_become_rank_0_series_unless_rank_0_reports(tmp_path: Path) -> None:
    """The CSV files as deepspeed.monitor.csv_monitor writes them (header ``step,<name>``, the step
    column being DeepSpeed's global_samples), one lr row per optimizer step."""
    ds_dir = tmp_path / "deepspeed" / "rank0"
    ds_dir.mkdir(parents=True)
    (ds_dir / "Train_Samples_lr.csv").write_text("step,lr\n16,0.001\n32,0.002\n48,0.003")  # last row incomplete
    metrics = NodeMetrics(str(tmp_path), 0, prometheus=True)
    metrics.create()
    reader = ProgressReader(metrics, [0, 1], str(ds_dir))
    collector = NodeCollector("j-1", 2, "n0", lambda: {}, metrics, reader, restarts=1)
    fams = _families(collector)
    assert _by_rank(fams["orch_rank_step"], "orch_rank_step") == {"0": 2.0}
    assert _by_rank(fams["orch_rank_learning_rate"], "orch_rank_learning_rate") == {"0": 0.002}
    assert _by_rank(fams["orch_rank_samples"], "orch_rank_samples_total") == {"0": 32.0}
    with open(ds_dir / "Train_Samples_lr.csv", "a") as f:
        f.write("\n64,0.004\n")
    fams = _families(collector)
    assert _by_rank(fams["orch_rank_step"], "orch_rank_step") == {"0": 4.0}
    assert reader.latest[0]["source"] == "deepspeed"
    # rank 0 reports itself: the monitor is not read any more, and the report wins
    _rank(metrics.rank_env(0), 0, steps=7)
    with open(ds_dir / "Train_Samples_lr.csv", "a") as f:
        f.write("80,0.005\n")
    fams = _families(collector)
    assert _by_rank(fams["orch_rank_step"], "orch_rank_step") == {"0": 7.0}
    assert reader.latest[0]["source"] == "report"


def test_a_taken_port_is_replaced_by_a_free_one(tmp_path: Path) -> None:
    collector = NodeCollector("j-1", 1, "n0", lambda: {})
    first, port, why = serve(0, collector, "127.0.0.1")
    try:
        second, other, why = serve(port, collector, "127.0.0.1")
        try:
            assert other != port and why and "in use" in why
            assert "orch_agent_up" in httpx.get(f"http://127.0.0.1:{other}/metrics", timeout=10).text
        finally:
            second.shutdown()
            second.server_close()
    finally:
        first.shutdown()
        first.server_close()


def test_no_gpu_means_no_gpu_series_and_no_error(tmp_path: Path) -> None:
    fams = _families(NodeCollector("j-1", 1, "n0", lambda: {}))
    if gpu_stats():  # a machine with NVIDIA GPUs (the device machine): one series per GPU
        assert len(fams["orch_node_gpu_utilization_ratio"]) == len(gpu_stats())
    else:
        assert not [name for name in fams if "gpu" in name]
    assert json.dumps(sorted(fams))  # the rest is served either way
