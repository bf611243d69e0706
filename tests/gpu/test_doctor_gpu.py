"""``orch doctor`` on a machine with CUDA: the node's report names CUDA, NCCL and every GPU torch sees, and the
``gpus`` check passes for a node with as many slots as GPUs; the all-reduce runs with NCCL on CUDA tensors, and,
where there are two GPUs or more, two "nodes" (each its own GPU: node-1 is filtered to its slot 1) test their
link with NCCL too. The CPU form is tests/test_doctor.py. Skipped without CUDA, like every test in tests/gpu.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_no_leftovers

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)


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
    assert out["backend"] == "nccl" and checks["allreduce"]["status"] == "passed", checks["allreduce"]
    assert checks["links"] == {"name": "links", "status": "skipped", "detail": "one node: no link to test"}
    assert checks["ops"]["status"] == "passed" and report["ops"], checks["ops"]
    assert_no_leftovers(timeout=10)


def test_doctor_nccl_all_reduce_and_link_between_nodes_on_their_own_gpus(orch, hostfile) -> None:
    """Two local "nodes" with NCCL, each on a GPU of its own where there are two (node-1 filtered to its slot 1:
    the link test between them); with one GPU, one node (NCCL refuses two ranks of a communicator on one GPU), so
    the all-reduce on CUDA tensors alone is shown."""
    two = torch.cuda.device_count() >= 2
    hosts = "node-0 slots=1\nnode-1 slots=2\n" if two else "node-0 slots=1\n"
    r = orch("doctor", str(hostfile(hosts)), *(("--include", "node-0@node-1:1") if two else ()), "--output", "json",
             timeout=300)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["passed"], (out["failures"], r.stderr[-3000:])
    assert out["backend"] == "nccl"
    assert all(next(c for c in n["checks"] if c["name"] == "allreduce")["status"] == "passed" for n in out["nodes"])
    if two:
        (link,) = out["links"]
        assert (link["a"], link["b"], link["correct"]) == ("node-0", "node-1", True) and link["gbps"] > 0
    else:
        assert out["links"] == [] and out["slowest_link"] is None
    assert_no_leftovers(timeout=10)
