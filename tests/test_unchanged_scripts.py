"""Scripts written for DeepSpeed's and Accelerate's own launchers run under orch unchanged.

* examples/ds_plain_train.py: a plain DeepSpeed script (``deepspeed.add_config_arguments``,
  ``--local_rank``, ``deepspeed.initialize(args=...)``; no ``ORCH_*`` variable), given
  ``--deepspeed --deepspeed_config`` by the spec's ``deepspeed_args: true``, ZeRO 2 and 3.
* examples/accelerate_train.py: an ``Accelerator()`` script set up from the environment, as
  ``accelerate launch`` leaves it. On this CPU-only machine in its CPU form: torchrun's variables
  (orch's ``standard`` launcher) plus ``ACCELERATE_USE_CPU=true`` give data parallel over gloo
  (MULTI_CPU); without that variable Accelerate 1.15 sets each process up alone, which the
  script refuses. (With DeepSpeed on GPUs: tests/gpu/test_accelerate_deepspeed_gpu.py.)

Both train a byte-level model on the CPython standard library's source across 2 local
"nodes" x 1 slot; the loss must fall.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_no_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TWO_NODES = "node-0 slots=1\nnode-1 slots=1\n"


def _logs(orch, job_id: str) -> tuple[dict, list[str]]:
    detail = orch.json("status", job_id)
    logs = [(Path(detail["run_dir"]) / "logs" / f"rank-{r}.log").read_text() for r in range(2)]
    return detail, logs


def _float(text: str, key: str) -> float:
    return float(re.search(rf"\b{key}=(\S+)", text).group(1))


# pdsh at ZeRO-3, the MPI launchers at ZeRO-2: each launcher and each stage once (pdsh at ZeRO-2 added neither)
@pytest.mark.parametrize("stage,launcher", [(3, "pdsh"), (2, "openmpi"), (2, "mpich")])
def test_plain_deepspeed_script_trains_across_two_nodes(orch, write_spec, hostfile, stage, launcher) -> None:
    """Under the MPI launchers the script gets no --local_rank and finds its ranks as DeepSpeed's
    init_distributed would have after mpi_discovery (here: without mpi4py, orch sets them)."""
    helpers_train.prebuild_ops()
    script = EXAMPLES / "ds_plain_train.py"
    assert "ORCH_" not in script.read_text()  # it knows nothing of orch
    spec = write_spec(name="plain", hostfile=str(hostfile(TWO_NODES)), launcher=launcher, workdir=str(EXAMPLES),
                      entrypoint="ds_plain_train.py", args=["--steps", "30"], deepspeed_args=True,
                      deepspeed_config=str(EXAMPLES / f"ds_zero{stage}.json"), stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    r = orch("run", str(spec), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail, logs = _logs(orch, job["id"])
    assert detail["state"] == "SUCCEEDED" and [x["step"] for x in detail["ranks"]] == [30, 30]
    config = Path(detail["run_dir"]) / "ds_config.json"  # what --deepspeed_config named
    first = {}
    for rank, log in enumerate(logs):
        assert f"setup rank={rank} world_size=2 zero_stage={stage} micro_batch=8 grad_accum=1 config={config}" in log
        steps = [int(s) for s in re.findall(rf"^step=(\d+) rank={rank} ", log, re.MULTILINE)]
        assert steps == list(range(1, 31)), steps
        first[rank] = _float(re.search(rf"^step=1 rank={rank} .*$", log, re.MULTILINE).group(0), "loss")
    assert first[0] != first[1]  # each rank trains on its own shard
    done = re.search(r"^done .*$", logs[0], re.MULTILINE).group(0)
    assert _float(done, "last_loss") < _float(done, "first_loss") - 1.0, done
    # emulated (launch_mode's default): orch started every rank as the launcher would; no node ran the tool
    plan = json.loads((Path(detail["run_dir"]) / "plan.json").read_text())
    assert plan["nodes"][0]["native"] is None and not (Path(detail["run_dir"]) / "logs" / "launcher.log").exists()
    assert_no_leftovers(job["id"], timeout=5)


def _accelerate_spec(write_spec, hostfile, env: dict) -> Path:
    return write_spec(name="accel", hostfile=str(hostfile(TWO_NODES)), launcher="standard",
                      workdir=str(EXAMPLES), entrypoint="accelerate_train.py", args=["--steps", "40"],
                      stop_grace_seconds=5, env={"OMP_NUM_THREADS": "1", **env})


def test_accelerate_script_trains_multi_cpu_across_two_nodes(orch, write_spec, hostfile) -> None:
    spec = _accelerate_spec(write_spec, hostfile, {"ACCELERATE_USE_CPU": "true"})
    r = orch("run", str(spec), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail, logs = _logs(orch, job["id"])
    assert detail["state"] == "SUCCEEDED"
    for rank, log in enumerate(logs):
        assert (f"[setup] rank={rank} distributed_type=MULTI_CPU num_processes=2 backend=gloo "
                f"device=cpu:0 deepspeed_zero_stage=None WORLD_SIZE=2") in log, log[-2000:]
        assert len(re.findall(rf"^\[train\] step=\d+ rank={rank} ", log, re.MULTILINE)) == 40
    step1 = [re.search(r"^\[train\] step=1 .*$", log, re.MULTILINE).group(0) for log in logs]
    assert _float(step1[0], "loss") != _float(step1[1], "loss")  # the prepared loader shards the data
    assert _float(step1[0], "mean_loss") == _float(step1[1], "mean_loss")  # reduced over both processes
    done = re.search(r"^\[done\] .*$", logs[0], re.MULTILINE).group(0)
    assert "num_processes=2 distributed_type=MULTI_CPU" in done
    assert _float(done, "last_loss") < _float(done, "first_loss") - 1.0, done


def test_accelerate_on_cpu_without_use_cpu_is_refused_not_run_twice(orch, write_spec, hostfile) -> None:
    # Accelerate 1.15 without ACCELERATE_USE_CPU and without a GPU: every process "not distributed",
    # num_processes 1, process_index 0 (each would train the whole data set alone): the script refuses.
    spec = _accelerate_spec(write_spec, hostfile, {})
    r = orch("run", str(spec), timeout=300)
    assert r.returncode == 1
    (job,) = orch.json("list")
    detail, logs = _logs(orch, job["id"])
    assert detail["state"] == "FAILED" and detail["cause"]["kind"] == "rank_exit"
    assert "exit code 2" in detail["cause"]["message"]
    failed = logs[detail["cause"]["global_rank"]]
    assert "distributed_type=NO num_processes=1 backend=None" in failed
    assert "WORLD_SIZE is 2 but Accelerate set up 1 process(es) (NO): each would train alone" in failed
