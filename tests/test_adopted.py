"""agents/adopted.py and agents/native_rank.py without a real launcher: the records a native rank
leaves, how the agent reads them, and the check that refuses the wrong MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.adopted import LOST_RETURNCODE, SHIM, AdoptedRank, log_tail, write_plans, wrong_tool


def _shim(tmp_path: Path, env: dict, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SHIM, "--dir", str(tmp_path), "--flavour", "slurm", "--wait", "2", "--",
                           *command], env={"PATH": os.defpath, **env}, capture_output=True, text=True, timeout=30)


@pytest.mark.integration
def test_a_rank_started_by_the_shim_is_adopted_with_its_exit_code(tmp_path):
    write_plans(str(tmp_path), "n0", str(tmp_path), 2, [(1, 0, {"PLANNED": "yes", "PATH": os.defpath})])
    rank = AdoptedRank(1, str(tmp_path))
    assert not rank.started and rank.poll() is None and rank.wait(0.1) is None
    tool = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}
    r = _shim(tmp_path, tool, sys.executable, "-c",
              "import os, sys; print(os.environ['PLANNED'], os.environ['SLURM_JOB_ID']); sys.exit(5)")
    assert r.returncode == 5, r.stderr
    assert rank.started and rank.poll() == 5 and rank.pid is not None
    assert (tmp_path / "rank-1.log").read_text() == "yes 7\n"  # the plan's env, the tool's own laid over it


@pytest.mark.integration
def test_the_shim_refuses_a_rank_placed_where_orch_did_not_plan_it(tmp_path):
    write_plans(str(tmp_path), "n0", str(tmp_path), 2, [(1, 0, {"PATH": os.defpath})])
    r = _shim(tmp_path, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}, "true")
    assert r.returncode == 3 and "as local rank 1 of world 2; orch planned local rank 0" in r.stderr
    r = _shim(tmp_path, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "true")
    assert r.returncode == 3 and "no plan for rank 0" in r.stderr
    r = _shim(tmp_path, {}, "true")
    assert r.returncode == 3 and "not under the slurm tool" in r.stderr


@pytest.mark.integration
def test_a_rank_whose_processes_vanish_without_a_record_is_lost(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    (tmp_path / ".native").mkdir()
    (tmp_path / ".native" / "rank-0.pid").write_text(json.dumps({"pid": proc.pid, "child": proc.pid, "at": 0}))
    rank = AdoptedRank(0, str(tmp_path))
    assert rank.poll() is None
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while rank.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank.poll() == LOST_RETURNCODE


def test_log_tail_keeps_the_last_words_not_the_banners(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("start\n" + "-" * 70 + "\nOpen MPI could not ssh\n\n" + "*" * 20 + "\nssh: no route to host\n")
    assert log_tail(str(log), 2) == "Open MPI could not ssh | ssh: no route to host"
    assert log_tail(str(tmp_path / "none")) == "(no output)"


@pytest.mark.integration
def test_the_wrong_mpi_is_named():
    env = {"PATH": os.defpath}
    assert wrong_tool("mpirun.openmpi", "openmpi", env) is None
    assert wrong_tool("mpiexec.hydra", "hydra", env) is None
    assert "is Open MPI's" in wrong_tool("mpirun.openmpi", "hydra", env)
    assert "is not Open MPI's mpirun" in wrong_tool("mpiexec.hydra", "openmpi", env)
    assert wrong_tool("srun", "slurm", env) is None
