"""Node exporters of real jobs (local agents): a metrics port that is taken, and a script that
never reports (rank 0's series then come from DeepSpeed's own CSV monitor)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import helpers_train
from conftest import ROOT, assert_no_leftovers, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "0"]


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def _scrape(port: int) -> dict[str, list]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_taken_metrics_port_and_a_script_that_never_reports(orch, write_spec, hostfile, tmp_path) -> None:
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    targets = tmp_path / "targets"
    try:
        hf = hostfile("node-0 slots=1\nnode-1 slots=1\n")
        spec = write_spec(name="noreport", hostfile=str(hf), workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                          args=["--steps", "1000000", "--pace-ms", "50", "--no-report", *TINY], metrics_port=port,
                          deepspeed_config=str(EXAMPLES / "ds_zero2.json"),
                          env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, stop_grace_seconds=5)
        proc = orch.popen("run", str(spec), env={"ORCH_PROMETHEUS_TARGETS": str(targets)})
        try:
            path = wait_for(lambda: next(iter(targets.glob("noreport-*.json")), None), 120, "the targets file")
            job_id = path.name.rsplit(".", 2)[0]
            groups = {g["labels"]["node"]: int(g["targets"][0].rpartition(":")[2])
                      for g in json.loads(path.read_text())}
            # node 0's port was taken: another one, and a warning saying which; node 1 has port + 1
            assert groups["node-0"] != port and groups["node-1"] == port + 1, groups
            # each exporter listens where the controller reaches its node (local: loopback), not everywhere
            import psutil
            bound = {c.laddr.port: c.laddr.ip for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in groups.values()}
            assert bound == {p: "127.0.0.1" for p in groups.values()}, bound
            assert all(g["targets"][0].startswith("127.0.0.1:") for g in json.loads(path.read_text()))
            warnings = [e.data["message"] for e in orch.events(job_id) if e.kind == "warning"]
            assert warnings == [f"metrics port {port} on node-0 cannot be used (Address already in use); the node's "
                                f"metrics are on port {groups['node-0']} instead"], warnings

            def rank0_step() -> float | None:
                fams = _scrape(groups["node-0"])
                steps = {s.labels["rank"]: s.value for s in fams.get("orch_rank_step", [])}
                return steps.get("0") if steps.get("0", 0) >= 3 else None
            first = wait_for(rank0_step, 180, "rank 0's step from DeepSpeed's monitor", interval=0.5)
            time.sleep(2)
            fams = _scrape(groups["node-0"])
            assert {s.labels["rank"]: s.value for s in fams["orch_rank_step"]}["0"] > first
            lr = {s.labels["rank"]: s.value for s in fams["orch_rank_learning_rate"]}
            assert list(lr) == ["0"] and 0 < lr["0"] < 1
            samples = fams["orch_rank_samples"][0]
            assert samples.labels["rank"] == "0" and samples.value > 0
            # the rank that reports nothing: liveness only, no training series
            fams1 = _scrape(groups["node-1"])
            assert [s.labels["rank"] for s in fams1["orch_rank_up"]] == ["1"]
            assert "orch_rank_step" not in fams1 and "orch_rank_loss" not in fams1
            detail = orch.json("status", job_id)
            sources = {r["global_rank"]: r["progress_source"] for r in detail["ranks"]}
            assert sources[0] in ("deepspeed", "log") and sources[1] == "log", sources
            wait_for(lambda: orch.json("status", job_id)["ranks"][0]["progress_source"] == "deepspeed"
                     or None, 10, "rank 0's progress from the monitor reaching the controller")
            print(f"\n[metrics] no helper: rank 0 step {first} from DeepSpeed's CSV monitor; "
                  f"taken port {port} replaced by {groups['node-0']}")
            r = orch("cancel", job_id, "--wait", "30")
            assert r.returncode == 0, r.stderr
            assert proc.wait(60) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert not path.exists()
        assert_no_leftovers(job_id, timeout=5)
        assert not (Path(detail["run_dir"]) / "scratch").exists()  # the agents removed their files
    finally:
        taken.close()

