"""A real Prometheus (Debian's) loading dashboards/orch-alerts.yml fires ``OrchJobFailed`` and ``OrchNoProgress``
for real jobs: one whose rank exits 1 (examples/train_gpt.py --fail-at-step) and one whose rank hangs
(--hang-at-step, the spec's hang_timeout off so orch leaves it running), scraped through the targets files
``orch server`` writes, with dashboards/prometheus.yml's configuration.

For the test's sake the rules are loaded from a copy with every ``for:`` at 0s and the no-progress window at
5 s instead of 300 s (docs/metrics.md, "Alert rules"); the expressions are the file's own.
"""

from __future__ import annotations


import httpx
import pytest
import yaml

import helpers_train
from conftest import ROOT, assert_no_leftovers, wait_for
from promserver import PrometheusServer, check_prerequisites, free_port

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "0"]
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
NO_PROGRESS = "> 300"  # OrchNoProgress's threshold in the file (seconds without a step)


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    check_prerequisites()
    helpers_train.prebuild_ops()


def write_config(prom_dir) -> None:
    """prometheus.yml (1 s intervals) and orch-alerts.yml (``for: 0s``, a 5 s no-progress window) in
    ``prom_dir``; the targets files go to ``prom_dir/targets``."""
    config = yaml.safe_load((ROOT / "dashboards" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for sd in config["scrape_configs"][0]["file_sd_configs"]:
        sd["refresh_interval"] = "1s"
    config["rule_files"] = ["orch-alerts.yml"]
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    rules = yaml.safe_load((ROOT / "dashboards" / "orch-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
            if rule["alert"] == "OrchNoProgress":
                assert NO_PROGRESS in rule["expr"]
                rule["expr"] = rule["expr"].replace(NO_PROGRESS, "> 5")
    (prom_dir / "orch-alerts.yml").write_text(yaml.safe_dump(rules))


def alerts(prom: PrometheusServer) -> list[dict]:
    """Prometheus' ``/api/v1/alerts``: dicts with ``labels``, ``annotations``, ``state`` ('pending', 'firing')."""
    body = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()
    assert body["status"] == "success", body
    return list(body["data"]["alerts"])


def firing(prom: PrometheusServer, name: str) -> dict[str, dict]:
    """The firing alerts called ``name``, by their ``job`` label."""
    return {a["labels"]["job"]: a for a in alerts(prom)
            if a["labels"]["alertname"] == name and a["state"] == "firing"}


def test_real_prometheus_fires_job_failed_and_no_progress_for_real_jobs(orch, write_spec, hostfile,
                                                                        tmp_path) -> None:
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    write_config(prom_dir)
    targets = prom_dir / "targets"
    port = free_port()
    server = orch.popen("server", "--port", str(port), "--prometheus-targets", str(targets))
    try:
        wait_for(lambda: (targets / "controller.json").exists(), 30, "the server's targets file")
        with PrometheusServer(prom_dir / "prometheus.yml", tmp_path / "prom-work") as prom:
            rules = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
            assert {r["name"] for g in rules for r in g["rules"]} >= {"OrchJobFailed", "OrchNoProgress"}
            prom.wait_for('up{orch_role="controller"}', lambda r: r and r[0]["value"][1] == "1", 30)

            hf = hostfile("node-0 slots=1\n")
            common = dict(hostfile=str(hf), workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                          deepspeed_config=str(EXAMPLES / "ds_zero2.json"), env=ENV, stop_grace_seconds=5)
            hung = orch.json("submit", str(write_spec(name="alert-hang", hang_timeout=None, args=[
                "--steps", "1000", "--hang-at-step", "3", *TINY], **common)))["id"]
            failed = orch.json("submit", str(write_spec(name="alert-fail", args=[
                "--steps", "50", "--fail-at-step", "3", "--fail-rank", "0", *TINY], **common)))["id"]

            wait_for(lambda: orch.json("status", failed)["state"] == "FAILED", 180, "the failing job to fail")
            fired = wait_for(lambda: firing(prom, "OrchJobFailed").get(failed), 60, "OrchJobFailed for the job")
            assert fired["labels"]["cause"] == "rank_exit" and fired["labels"]["severity"] == "critical"
            assert failed in fired["annotations"]["summary"]
            assert f"orch resume {failed}" in fired["annotations"]["description"]

            stuck = wait_for(lambda: firing(prom, "OrchNoProgress").get(hung), 240, "OrchNoProgress for the hang")
            assert stuck["labels"]["rank"] == "0" and stuck["labels"]["node"] == "node-0"
            assert f"orch stacks {hung}" in stuck["annotations"]["description"]
            assert orch.json("status", hung)["state"] == "RUNNING"  # orch left it running: the alert saw it
            assert hung not in firing(prom, "OrchJobFailed")
            assert failed not in firing(prom, "OrchNoProgress")  # its rank exited: no longer a running rank
            print(f"\n[alerts] OrchJobFailed {fired['annotations']['summary']!r}; "
                  f"OrchNoProgress {stuck['annotations']['summary']!r}")

            r = orch("cancel", hung, "--wait", "30")
            assert r.returncode == 0, r.stderr
            assert_no_leftovers(hung, timeout=10)
            assert_no_leftovers(failed, timeout=5)
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(60)
