"""``provisioner: ray`` with ``ray.address: local`` (the default of the ray section): orch starts
a one-node Ray on this machine for the job, builds the pool from it without a hostfile (or maps
a ``localhost`` hostfile to it), runs the job there and leaves no Ray process and no Ray session
directory behind when it exits; ``orch plan`` starts no Ray at all."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPTS, assert_no_leftovers

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("lone_ray")]  # the only Ray cluster here

WORKER = str(SCRIPTS / "worker.py")


def _ray_processes() -> dict[int, str]:
    """Ray's own daemons on this machine (gcs_server, raylet, their workers)."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "gcs_server" in cmd or "/raylet" in cmd or cmd.startswith("ray::"):
            out[p.info["pid"]] = cmd[:150]
    return out


def _sessions() -> set[str]:
    """Ray's session directories in its default temp dir (each Ray instance started here makes one)."""
    return {p.name for p in Path("/tmp/ray").glob("session_*") if not p.is_symlink()}


def test_local_address_starts_ray_for_the_job_and_leaves_nothing(orch, write_spec, tmp_path) -> None:
    before, sessions = _ray_processes(), _sessions()
    env = {k: v for k, v in orch.env().items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    spec = write_spec(name="raylocal", provisioner="ray", entrypoint=WORKER, stop_grace_seconds=2,
                      env={"WORKER_STEPS": "3", "WORKER_STEP_S": "0.05"})
    assert "ray:" not in Path(spec).read_text()  # the default ray section: address local
    plan = orch.json("plan", str(spec), env=env, replace_env=True)
    cpus = os.cpu_count()
    assert len(plan["nodes"]) == 1 and plan["nodes"][0]["slots"] == list(range(cpus)), plan["nodes"]
    host = plan["nodes"][0]["host"]
    assert plan["master_addr"] == host
    # the plan started nothing: no Ray process, no session directory
    assert {pid: cmd for pid, cmd in _ray_processes().items() if pid not in before} == {}
    assert _sessions() == sessions
    r = orch("run", str(spec), env=env, replace_env=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["nodes"] == [host]
    assert [x["step"] for x in detail["ranks"]] == [3] * cpus
    assert_no_leftovers(job["id"], timeout=5)
    left = {pid: cmd for pid, cmd in _ray_processes().items() if pid not in before}
    assert left == {}, left  # the Ray that orch started for the job went with it
    assert _sessions() == sessions  # and so did its session directory


def test_a_localhost_hostfile_is_the_local_ray_node(orch, write_spec, hostfile, tmp_path) -> None:
    before, sessions = _ray_processes(), _sessions()
    env = {k: v for k, v in orch.env().items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    spec = write_spec(name="raylocalhost", provisioner="ray", hostfile=str(hostfile("localhost slots=2\n")),
                      entrypoint=WORKER, stop_grace_seconds=2, env={"WORKER_STEPS": "2", "WORKER_STEP_S": "0.05"})
    plan = orch.json("plan", str(spec), env=env, replace_env=True)
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [("localhost", [0, 1])]
    r = orch("run", str(spec), env=env, replace_env=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["nodes"] == ["localhost"]
    assert [x["step"] for x in detail["ranks"]] == [2, 2]
    assert_no_leftovers(job["id"], timeout=5)
    assert {pid: cmd for pid, cmd in _ray_processes().items() if pid not in before} == {}
    assert _sessions() == sessions
