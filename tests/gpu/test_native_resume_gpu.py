"""tests/scripts/accelerate_ds_train.py with Accelerate's DeepSpeed plugin on GPUs (NCCL), killed and resumed
by orch from its own ``save_state`` checkpoints: the GPU form of tests/test_native_resume.py's Accelerate
test (which runs the same script over gloo on the CPU).

One process per "node" and per GPU (node-0 slot 0, node-1 slot 1; a machine with one GPU runs one
process: NCCL refuses two ranks on one device). Skipped without CUDA, like every test in tests/gpu.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_no_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import helpers_resume

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)

SCRIPTS = ROOT / "tests" / "scripts"


def test_accelerate_deepspeed_script_resumes_on_gpus(orch, write_spec, hostfile, tmp_path) -> None:
    world = min(2, torch.cuda.device_count())
    project = tmp_path / "project"
    spec = write_spec(
        name="accel-gpu", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=2\n")),
        include="node-0:0@node-1:1" if world == 2 else "node-0:0", launcher="standard", workdir=str(SCRIPTS),
        entrypoint="accelerate_ds_train.py", stop_grace_seconds=10,
        args=["--deepspeed_config", str(SCRIPTS / "ds_accelerate_zero2.json"), "--project_dir", str(project),
              "--steps", "400", "--save_every", "10"],
        resume={"dir": str(project / "checkpoints"), "args": ["--resume_from", "{checkpoint}"]},
        env={"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "1"})
    job = helpers_resume.run_and_kill(orch, spec, rank=world - 1, at_step=25)
    first = Path(orch.json("status", job)["run_dir"]) / "logs"
    view = orch.json("status", job)["checkpoints"]
    assert view["format"] == "accelerate" and view["next_resume"], view
    r = orch("resume", job, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == view["next_resume"]
    second = Path(detail["run_dir"]) / "logs"
    for rank in range(world):
        assert "distributed_type=DEEPSPEED" in (second / f"rank-{rank}.log").read_text()
        before, after = (helpers_resume.losses(d / f"rank-{rank}.log") for d in (first, second))
        overlap = sorted(set(before) & set(after))
        assert min(after) % 10 == 1 and max(after) == 400 and overlap, (min(after), max(before))
        assert all(after[s] == before[s] for s in overlap), rank  # same ranks, same NCCL reductions
    assert_no_leftovers(job, timeout=10)
