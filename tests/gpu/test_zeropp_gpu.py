"""The ZeRO++ example (examples/ds_zeropp.json: ZeRO-3, quantized weights and gradients, hpZ) trains under orch
with NCCL: 2 ranks on one node where the machine has 2 GPUs (hpZ groups of 2), else 1 rank on the one GPU (hpZ
1: NCCL refuses two ranks on one device). The preflight's ``zero_pp`` check passes on the cuda accelerator. The CPU
form is tests/test_preflight_features.py: the same config refused on cpu with DeepSpeed's missing kernels named.

Never run where it was written (no GPU lent): the first machine with CUDA that runs ``pytest tests/gpu`` is its
first run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_no_leftovers, wait_for

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--seq-len", "64", "--corpus-bytes", "400000",
        "--log-interval", "0"]


def test_zeropp_example_trains_over_nccl_and_passes_the_zero_pp_preflight(orch, write_spec, hostfile,
                                                                         tmp_path: Path) -> None:
    ranks = 2 if torch.cuda.device_count() >= 2 else 1
    config = json.loads((EXAMPLES / "ds_zeropp.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    config["zero_optimization"]["zero_hpz_partition_size"] = ranks
    spec = write_spec(name="zeropp-gpu", hostfile=str(hostfile(f"localhost slots={ranks}\n")), workdir=str(EXAMPLES),
                      entrypoint="train_gpt.py", args=["--steps", "100000", *TINY], deepspeed_config=config,
                      checkpoint_dir=str(tmp_path / "ckpt"), stop_grace_seconds=10,
                      env={"DS_ACCELERATOR": "cuda", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    proc = orch.popen("run", str(spec), env={"DS_ACCELERATOR": "cuda"})
    job_id = None
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        logs = orch.state_dir / "jobs" / job_id / "attempt-1" / "logs"
        for rank in range(ranks):  # every rank logs its own [train] lines
            log = logs / f"rank-{rank}.log"
            wait_for(lambda: log.exists() and f"[train] step=20 rank={rank} " in log.read_text(), 900,
                     f"step 20 on rank {rank}")
        text = (logs / "rank-0.log").read_text()
        assert "in DeepSpeed with backend nccl" in text, text[-3000:]
        assert "This op had not been implemented" not in text
        (event,) = [e.data for e in orch.events(job_id, "preflight")]
        (check,) = [c for c in event["nodes"][0]["checks"] if c["name"] == "zero_pp"]
        assert check["status"] == "passed" and check["detail"].startswith("accelerator cuda: "), check
        r = orch("cancel", job_id)
        assert r.returncode == 0, r.stderr
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert orch.json("status", job_id)["state"] == "CANCELLED"
    assert_no_leftovers(job_id)
