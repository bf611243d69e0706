"""examples/accelerate_train.py with Accelerate's DeepSpeed integration on GPUs, under orch.

Needs CUDA: examples/accelerate_train.py leaves the process group's backend to Accelerate, and
Accelerate 1.15 finds none on a machine without an accelerator: it sets every process up alone
(``num_processes`` 1) even though DeepSpeed joins them, and with ``ACCELERATE_USE_CPU`` it leaves
DeepSpeed out (tests/test_unchanged_scripts.py covers the CPU form). A script that asks for gloo
(``InitProcessGroupKwargs(backend="gloo")``, tests/scripts/accelerate_ds_train.py) runs DeepSpeed on
the CPU (tests/test_native_resume.py). These GPU tests are the suite's only skips, and only when
``torch.cuda.is_available()`` is False.

The job is what ``accelerate launch --use_deepspeed --deepspeed_config_file ...`` would set
up, written as a plain orch spec: the ``standard`` launcher (torchrun's variables, and
``CUDA_VISIBLE_DEVICES`` = the node's slots) and Accelerate's own variables
``ACCELERATE_USE_DEEPSPEED=true`` and ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` (ZeRO-2,
examples/ds_accelerate_zero2.json). Two processes, one per "node", each on its own GPU
(node-0 slot 0, node-1 slot 1): NCCL refuses two ranks on one device ("Duplicate GPU
detected"), so a machine with a single GPU runs the same job with one process.

Accelerate 1.15's DeepSpeed plugin imports ``transformers`` (``DeepSpeedPlugin.select`` ->
``set_deepspeed_weakref``): it must be installed.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_no_leftovers

pytestmark = pytest.mark.integration  # skipped without CUDA by tests/conftest.py (NO_CUDA)

EXAMPLES = ROOT / "examples"


def test_accelerate_with_deepspeed_zero2_trains_under_orch(orch, write_spec, hostfile) -> None:
    assert importlib.util.find_spec("transformers") is not None, (
        "Accelerate 1.15's DeepSpeed integration imports transformers (DeepSpeedPlugin.select); "
        "pip install transformers")
    world = min(2, torch.cuda.device_count())
    spec = write_spec(
        name="accel-ds", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=2\n")),
        include="node-0:0@node-1:1" if world == 2 else "node-0:0", launcher="standard", workdir=str(EXAMPLES),
        entrypoint="accelerate_train.py", args=["--steps", "40"], stop_grace_seconds=10,
        env={"ACCELERATE_USE_DEEPSPEED": "true", "DS_ACCELERATOR": "cuda",
             "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(EXAMPLES / "ds_accelerate_zero2.json")})
    r = orch("run", str(spec), timeout=600, env={"DS_ACCELERATOR": "cuda"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["world_size"] == world
    logs = [(Path(detail["run_dir"]) / "logs" / f"rank-{r}.log").read_text() for r in range(world)]
    for rank, log in enumerate(logs):
        setup = re.search(r"^\[setup\] .*$", log, re.MULTILINE).group(0)
        assert f"rank={rank} distributed_type=DEEPSPEED num_processes={world} backend=nccl" in setup, setup
        assert "device=cuda:0 deepspeed_zero_stage=2" in setup, setup  # each sees only its slot's GPU
        assert len(re.findall(rf"^\[train\] step=\d+ rank={rank} ", log, re.MULTILINE)) == 40
    done = re.search(r"^\[done\] .*$", logs[0], re.MULTILINE).group(0)
    assert f"num_processes={world} distributed_type=DEEPSPEED" in done
    first, last = (float(re.search(rf"\b{k}=(\S+)", done).group(1)) for k in ("first_loss", "last_loss"))
    assert last < first - 1.0, done
    assert_no_leftovers(job["id"], timeout=10)
