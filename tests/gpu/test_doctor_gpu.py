"""``orch doctor`` on a machine with CUDA: the node's report names CUDA, NCCL and every GPU torch sees, and the
``gpus`` check passes for a node with as many slots as GPUs. The CPU form is tests/test_doctor.py. Skipped
without CUDA, like every test in tests/gpu.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_no_leftovers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU form runs in "
                                                             "tests/test_doctor.py)"),
]


def test_doctor_reports_cuda_nccl_and_the_gpus(orch, hostfile) -> None:
    gpus = torch.cuda.device_count()
    r = orch("doctor", str(hostfile(f"localhost slots={gpus}\n")), "--output", "json", timeout=300)
    out = json.loads(r.stdout)
    node = out["nodes"][0]
    checks = {c["name"]: c for c in node["checks"]}
    assert r.returncode == 0 and out["passed"], (out["failures"], r.stderr[-3000:])
    report = node["report"]
    assert report["accelerator"] == "cuda" and report["cuda"] == torch.version.cuda, report
    assert report["nccl"] == ".".join(map(str, torch.cuda.nccl.version())), report
    assert report["gpus"] == gpus and checks["gpus"]["status"] == "passed", (report, checks["gpus"])
    assert_no_leftovers(timeout=10)
