"""A 1-GPU ZeRO-2 job under orch with NCCL (examples/train_gpt.py, examples/ds_zero2.json), its rank's real
NVML series scraped while it trains. The CPU form is the main suite's training tests over gloo
(tests/test_training.py) and the fake-NVML series (tests/test_gpu_telemetry.py). Also ``bind_cores: auto``
with the real nvidia-smi and sysfs (the CPU form: tests/test_bind_cores.py's fake sysfs tree).

Never run where it was written (no GPU lent): the first machine with CUDA that runs ``pytest tests/gpu`` is its
first run.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, assert_no_leftovers, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--seq-len", "64", "--corpus-bytes", "400000",
        "--log-interval", "0"]


def test_zero2_on_one_gpu_runs_over_nccl_and_serves_its_ranks_gpu_series(orch, write_spec, hostfile,
                                                                          tmp_path: Path) -> None:
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    spec = write_spec(name="zero2-gpu", hostfile=str(hostfile("localhost slots=1\n")), workdir=str(EXAMPLES),
                      entrypoint="train_gpt.py", args=["--steps", "100000", *TINY], deepspeed_config=config,
                      checkpoint_dir=str(tmp_path / "ckpt"), stop_grace_seconds=10,
                      env={"DS_ACCELERATOR": "cuda", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    proc = orch.popen("run", str(spec), env={"DS_ACCELERATOR": "cuda"})
    job_id = None
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        log = orch.state_dir / "jobs" / job_id / "attempt-1" / "logs" / "rank-0.log"
        wait_for(lambda: log.exists() and "[train] step=20 " in log.read_text(), 600, "step 20 on the GPU")
        text = log.read_text()
        # deepspeed.comm.init_distributed logs the backend it initialised (comm.py, "...with backend {}")
        assert "in DeepSpeed with backend nccl" in text, text[-3000:]
        (port,) = [e.data["metrics_port"] for e in orch.events(job_id, "ranks_started")]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        fams = {f.name: f.samples for f in text_string_to_metric_families(metrics)}
        (used,) = fams["orch_rank_gpu_memory_used_bytes"]
        assert used.labels["rank"] == "0" and used.labels["gpu"] and used.value > 0, used
        for name in ("orch_rank_gpu_utilization_ratio", "orch_rank_gpu_power_watts", "orch_rank_gpu_temperature_celsius"):
            assert fams.get(name), (name, sorted(fams))
        assert "orch_gpu_nvml_errors_total" not in metrics
        assert [s.value for s in fams["orch_rank_step"]][0] >= 20
        r = orch("cancel", job_id)
        assert r.returncode == 0, r.stderr
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert orch.json("status", job_id)["state"] == "CANCELLED"
    assert_no_leftovers(job_id)


def test_bind_cores_auto_takes_the_cores_of_the_real_gpus_numa_node() -> None:
    """agents.binding with the real nvidia-smi and sysfs: rank 0 on slot 0 gets physical cores of its GPU's NUMA
    node (every CPU when the GPU reports none, numa_node -1), all of them ones this process may use."""
    import os

    from agents import binding
    allowed = os.sched_getaffinity(0)
    env = {k: v for k, v in os.environ.items() if k != binding.FAKE_BUS_IDS_ENV}
    cpus = binding.rank_cpus("auto", [{"global_rank": 0, "slot": 0}], "here", env, allowed, True)[0]
    assert cpus and set(cpus) <= allowed, cpus
    bus = binding._bus_ids(env, "here")["0"]
    numa = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    if numa >= 0:
        node_cpus = set(binding.parse_cpus(Path(f"/sys/devices/system/node/node{numa}/cpulist").read_text()))
        assert set(cpus) <= node_cpus, (cpus, numa, sorted(node_cpus))
