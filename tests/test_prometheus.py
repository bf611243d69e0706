"""A real Prometheus server (Debian's) scraping a real 2-node training job through the targets
files orch writes, configured by dashboards/prometheus.yml (only its intervals shortened), and
every panel of the Grafana dashboard dashboards/orch-job.json run against it.

Figures are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import math
import socket
import time

import httpx
import pytest
import yaml

import helpers_train
from conftest import ROOT, assert_no_leftovers, wait_for
from promserver import PrometheusServer, check_prerequisites, dashboard_queries

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "0"]
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    check_prerequisites()
    helpers_train.prebuild_ops()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"][label]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_jobs_through_orchs_targets_and_every_dashboard_panel_has_data(
        orch, write_spec, hostfile, tmp_path) -> None:
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    config = yaml.safe_load((ROOT / "dashboards" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for sd in config["scrape_configs"][0]["file_sd_configs"]:
        sd["refresh_interval"] = "1s"
    config["rule_files"] = [str(ROOT / "dashboards" / f) for f in config.get("rule_files", [])]  # (relative there)
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    targets = prom_dir / "targets"  # what the example config reads: targets/*.json next to itself

    port = _free_port()
    server = orch.popen("server", "--port", str(port), "--prometheus-targets", str(targets))
    api = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: (targets / "controller.json").exists(), 30, "the server's targets file")
        assert json.loads((targets / "controller.json").read_text()) == [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"orch_role": "controller"}}]
        with PrometheusServer(prom_dir / "prometheus.yml", tmp_path / "prom-work") as prom:
            prom.wait_for('up{orch_role="controller"}', lambda r: r and r[0]["value"][1] == "1", 30)

            hf = hostfile("node-0 slots=1\nnode-1 slots=1\n")
            spec = write_spec(name="prom", hostfile=str(hf), workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                              args=["--steps", "1000000", "--pace-ms", "50", *TINY], deepspeed_config=str(EXAMPLES / "ds_zero2.json"),
                              env=ENV, stop_grace_seconds=5)
            submitted = time.time()
            job_id = orch.json("submit", str(spec))["id"]
            sel = f'job="{job_id}"'

            # the targets file of the attempt: both agents, with the job's labels
            path = targets / f"{job_id}.1.json"
            groups = wait_for(lambda: path.exists() and json.loads(path.read_text()), 120, "the attempt's targets")
            assert sorted((g["labels"]["node"], g["labels"]["attempt"], g["labels"]["job"]) for g in groups) == [
                ("node-0", "1", job_id), ("node-1", "1", job_id)]
            ports = {g["labels"]["node"]: int(g["targets"][0].rpartition(":")[2]) for g in groups}
            assert all(g["targets"][0].startswith("127.0.0.1:") for g in groups)
            detail = orch.json("status", job_id)
            assert {n["host"]: n["metrics_port"] for n in detail["node_states"]} == ports

            up = prom.wait_for(f"orch_agent_up{{{sel}}}", lambda r: len(r) == 2, 60)
            assert {tuple(sorted(r["metric"].items())) for r in up} == {
                (("__name__", "orch_agent_up"), ("attempt", "1"), ("instance", f"127.0.0.1:{ports[n]}"),
                 ("job", job_id), ("node", n))
                for n in ("node-0", "node-1")}  # the series' own labels, not exported_job
            steps = prom.wait_for(f"orch_rank_step{{{sel}}}", lambda r: len(r) == 2 and
                                  min(float(x["value"][1]) for x in r) >= 5, 180)
            first = _values(steps, "rank")
            assert {r["metric"]["node"] for r in steps} == {"node-0", "node-1"}
            time.sleep(3)
            later = _values(prom.query(f"orch_rank_step{{{sel}}}"), "rank")
            assert all(later[r] > first[r] for r in ("0", "1")), (first, later)
            loss = _values(prom.query(f"orch_rank_loss{{{sel}}}"), "rank")
            assert sorted(loss) == ["0", "1"] and all(math.isfinite(v) and 0 < v < 10 for v in loss.values())
            tokens = _values(prom.query(f"rate(orch_rank_tokens_total{{{sel}}}[5s])"), "rank")
            assert sorted(tokens) == ["0", "1"] and all(v > 0 for v in tokens.values())
            p50 = prom.query(f"histogram_quantile(0.5, sum by (le, rank) "
                             f"(rate(orch_rank_step_duration_seconds_bucket{{{sel}}}[5s])))")
            assert len(p50) == 2 and all(0 < float(r["value"][1]) < 10 for r in p50)
            mem = _values(prom.query(f"orch_node_memory_used_bytes{{{sel}}}"), "node")
            assert sorted(mem) == ["node-0", "node-1"] and all(v > 0 for v in mem.values())
            rss = _values(prom.query(f"orch_rank_memory_rss_bytes{{{sel}}}"), "rank")
            assert sorted(rss) == ["0", "1"] and all(v > 50e6 for v in rss.values())  # torch is loaded
            assert prom.query(f'{{{sel}, pid!=""}}') == []  # no series carries a pid
            jobs = _values(prom.query('orch_jobs{orch_role="controller"}'), "state")
            assert jobs["RUNNING"] == 1 and jobs["SUCCEEDED"] == 0
            assert float(prom.query("orch_attempts_total")[0]["value"][1]) == 1
            print(f"\n[prometheus] steps {first} -> {later} in 3 s; loss {loss}; tokens/s {tokens}")

            # every dashboard panel, as Grafana runs it (a range query over the job's time)
            time.sleep(4)  # a few more samples for rate() windows
            end = time.time()
            empty = []
            for title, expr in dashboard_queries(ROOT / "dashboards" / "orch-job.json", job_id, "1", "5s"):
                result = prom.query_range(expr, submitted, end, 1.0)
                if not result:
                    empty.append(title)
            gpu = [t for t in empty if t.startswith("GPU")]
            assert gpu == [] or not prom.query('{__name__=~"orch_node_gpu_.*"}')  # CPU-only: no GPU series
            assert [t for t in empty if not t.startswith("GPU")] == [], empty
            print(f"[prometheus] every dashboard panel has data ({len(gpu)} GPU panels empty on this CPU-only "
                  "machine)")

            # cancel: the attempt's targets file goes, and so do its targets
            r = orch("cancel", job_id, "--wait", "30")
            assert r.returncode == 0, r.stderr
            assert not path.exists()
            prom.wait_for_targets(lambda ts: not [t for t in ts if t["labels"].get("job") == job_id], 30)
            assert_no_leftovers(job_id, timeout=5)

            # a failing job: the controller counts how fast it noticed
            spec = write_spec(name="prom-fail", hostfile=str(hf), workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                              args=["--steps", "50", "--fail-at-step", "5", "--fail-rank", "1", *TINY],
                              deepspeed_config=str(EXAMPLES / "ds_zero2.json"), env=ENV, stop_grace_seconds=5)
            failed = orch.json("submit", str(spec))["id"]
            wait_for(lambda: orch.json("status", failed)["state"] == "FAILED", 180, "the failing job to fail")
            det = prom.wait_for('orch_failure_detection_seconds_count{cause="rank_exit"}',
                                lambda r: r and float(r[0]["value"][1]) == 1, 30)
            slow = prom.query('orch_failure_detection_seconds_sum{cause="rank_exit"}')
            print(f"[prometheus] rank exit noticed {float(slow[0]['value'][1]):.3f} s after the rank ended")
            assert det and float(slow[0]["value"][1]) < 1.0
            jobs = _values(prom.wait_for('orch_jobs{state="FAILED"}', lambda r: r and r[0]["value"][1] == "1", 30),
                           "state")
            assert jobs == {"FAILED": 1}
            running = prom.query("orch_time_to_running_seconds_count")
            assert float(running[0]["value"][1]) == 2  # both jobs' attempts ran
            controller = httpx.get(f"{api}/metrics", timeout=10).text
            assert "orch_restarts_total 0.0" in controller and 'orch_jobs{state="CANCELLED"} 1.0' in controller
            assert_no_leftovers(failed, timeout=5)
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(60)
    assert not (targets / "controller.json").exists()
