"""Per-rank GPU series from the real NVML (agents/gpu.py without its fake): a 1-GPU rank under orch, its node's
/metrics scraped while the rank holds memory on its GPU. The CPU form, through the fake NVML, is
tests/test_gpu_telemetry.py. Skipped without CUDA, like every test in tests/gpu.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest
import torch
from conftest import assert_no_leftovers, wait_for
from prometheus_client.parser import text_string_to_metric_families

from agents import gpu

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)

# Holds 1 GiB on cuda:LOCAL_RANK until the test says stop (a file), at most 120 s.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    held = torch.ones(256 << 20, device=device)  # 1 GiB of float32
    torch.cuda.synchronize(device)
    ready, stop = sys.argv[1], sys.argv[2]
    open(ready, "w").write(str(held.numel()))
    deadline = time.time() + 120
    while not os.path.exists(stop) and time.time() < deadline:
        held.mul_(1.0)
        time.sleep(0.05)
    print("step=1 loss=0.0", flush=True)
""")


def _cuda0_bus_id() -> str:
    """CUDA device 0's PCI bus id as NVML writes it, from torch (or, on a torch without it, NVML in PCI order)."""
    props = torch.cuda.get_device_properties(0)
    if hasattr(props, "pci_bus_id"):
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    mod = gpu.nvml({})
    mod.nvmlInit()
    return gpu.bus_id(mod, mod.nvmlDeviceGetHandleByIndex(0))


def test_real_nvml_maps_the_rank_and_serves_its_gpu_series(orch, write_spec, hostfile, tmp_path: Path) -> None:
    sent: list[dict] = []
    node = gpu.NodeGpus({0: {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}}, "here", 0,
                        sent.append, expect_gpus=True)
    (row,) = node.samples()
    assert row["gpu"] == _cuda0_bus_id() and row["memory_total"] > 0 and 0 <= row["utilization"] <= 1, row
    assert node.errors == {} and node.poll() == [], (node.errors, sent)
    node.close()

    script, ready, stop = tmp_path / "hold.py", tmp_path / "ready", tmp_path / "stop"
    script.write_text(SCRIPT)
    spec = write_spec(name="gpu-series", hostfile=str(hostfile("localhost slots=1\n")), entrypoint=str(script),
                      args=[str(ready), str(stop)], stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cuda", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    proc = orch.popen("run", str(spec), env={"DS_ACCELERATOR": "cuda"})
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        wait_for(ready.exists, 120, "the rank to hold its GPU memory")
        (port,) = [e.data["metrics_port"] for e in orch.events(job_id, "ranks_started")]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
        (used,) = fams["orch_rank_gpu_memory_used_bytes"]
        assert used.labels["rank"] == "0" and used.labels["gpu"] == _cuda0_bus_id(), used.labels
        assert used.value >= 1 << 30  # the rank's 1 GiB, at least
        for name in ("orch_rank_gpu_utilization_ratio", "orch_rank_gpu_temperature_celsius",
                     "orch_rank_gpu_sm_clock_hertz", "orch_rank_gpu_clock_throttle"):
            assert fams.get(name), (name, sorted(fams))
        assert fams["orch_rank_gpu_temperature_celsius"][0].value > 0
        assert "orch_gpu_nvml_errors_total" not in text, text
        stop.write_text("")
        out, err = proc.communicate(timeout=120)
    finally:
        stop.write_text("")
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out + err
    assert_no_leftovers(job_id)
