"""End to end through the ``orch`` command with local agents: success, failures, cancel, bad input.

The ranks are ``tests/scripts/worker.py`` (no DeepSpeed: these tests are about supervision,
so they stay fast); DeepSpeed training end to end is in test_training.py.
"""

from __future__ import annotations

import json
import re
import os
import signal
import sys
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import ROOT, SCRIPTS, assert_no_leftovers, job_processes, wait_for
from orchestrator.supervision import Controller

pytestmark = pytest.mark.integration

WORKER = str(SCRIPTS / "worker.py")
TWO_BY_TWO = "node-0 slots=2\nnode-1 slots=2\n"


def spec_fields(hostfile: Path, **env: str) -> dict:
    return {"name": "w", "hostfile": str(hostfile), "entrypoint": WORKER, "stop_grace_seconds": 2,
            "env": {"WORKER_STEP_S": "0.05", **env}}


def test_run_succeeds_and_the_store_keeps_it(orch, write_spec, hostfile) -> None:
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="5"))
    r = orch("run", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCEEDED" in r.stdout
    (job,) = orch.json("list")  # a new process: the store survived the controller
    assert job["state"] == "SUCCEEDED" and job["nodes"] == ["node-0", "node-1"] and job["world_size"] == 4
    detail = orch.json("status", job["id"])
    assert [(x["global_rank"], x["host"], x["local_rank"], x["state"], x["returncode"], x["step"])
            for x in detail["ranks"]] == [(0, "node-0", 0, "exited", 0, 5), (1, "node-0", 1, "exited", 0, 5),
                                          (2, "node-1", 0, "exited", 0, 5), (3, "node-1", 1, "exited", 0, 5)]
    assert detail["ranks"][0]["loss"] == pytest.approx(2.0)
    states = [e["data"]["to"] for e in _events(orch, job["id"]) if e["kind"] == "state"]
    assert states == ["PROVISIONING", "RUNNING", "SUCCEEDED"]
    assert_no_leftovers(job["id"], timeout=1)


def _events(orch, job_id: str) -> list[dict]:
    from orchestrator.store import Store
    return [e.to_dict() for e in Store(orch.state_dir / "orch.db").events(job_id)]


@pytest.mark.parametrize("mode,how,log_needle", [
    ("exit:3", "exit code 3", "failing at step 2"),
    ("raise", "exit code 1", "RuntimeError: deliberate failure on rank 3"),
    ("kill", "signal SIGKILL", "failing at step 2 (kill)"),
])
def test_one_rank_fails_and_everything_stops(orch, write_spec, hostfile, mode, how, log_needle) -> None:
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="600", WORKER_FAIL_RANK="3",
                                    WORKER_FAIL_AT="2", WORKER_FAIL_MODE=mode))
    t0 = time.monotonic()
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30  # not the 30 s the other ranks would have run
    (job,) = orch.json("list")
    cause = orch.json("status", job["id"])["cause"]
    assert cause["kind"] == "rank_exit" and cause["global_rank"] == 3 and cause["node"] == "node-1"
    assert cause["node_rank"] == 1 and cause["local_rank"] == 1
    assert cause["message"] == f"rank 3 (local rank 1) on node-1 (node 1) exited with {how}"
    assert any(log_needle in line for line in cause["log_tail"])
    assert f"rank 3 (local rank 1) on node-1 (node 1) exited with {how}" in r.stdout
    assert_no_leftovers(job["id"], timeout=1)  # orch run returns only once every process is gone
    ranks = orch.json("status", job["id"])["ranks"]
    assert {x["global_rank"]: x["state"] for x in ranks}[3] == "failed"
    assert all(x["state"] in ("failed", "stopped") for x in ranks)


@pytest.mark.parametrize("where", ["after its last step", "before its last step"])
def test_a_rank_that_aborts_says_whether_its_training_was_done(orch, write_spec, hostfile, where) -> None:
    """gloo's exit-time abort ('terminate called without an active exception', SIGABRT) hit about 1 run in 10 at
    ZeRO-3 before the project's scripts left without the interpreter's teardown (examples/ds_plain_train.py); a
    user's script may still hit it. What the user sees: FAILED (the rank did not exit 0: as DeepSpeed's launcher
    reports it), the cause saying the abort came after the rank's last reported step, and a hint that says the
    training was done; a rank killed before its last step is not told so."""
    env = {"WORKER_STEPS": "5", "WORKER_STEP_S": "0.01", "WORKER_REPORT": "1"}
    if where == "after its last step":
        env["WORKER_ABORT_AT_EXIT"] = "1"
    else:
        env.update(WORKER_FAIL_RANK="0", WORKER_FAIL_AT="3", WORKER_FAIL_MODE="kill")
    spec = write_spec(**{**spec_fields(hostfile("node-0 slots=1\n")), "env": env})
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    cause = detail["cause"]
    assert detail["state"] == "FAILED" and cause["kind"] == "rank_exit" and cause["global_rank"] == 0, cause
    shown = " ".join(r.stdout.split())
    if where == "after its last step":
        assert cause["message"] == ("rank 0 (local rank 0) on node-0 (node 0) exited with signal SIGABRT after its "
                                    "last step (step 5 of 5)"), cause
        assert cause["after_last_step"] == 5 and "terminate called without an active exception" in cause["log_tail"]
        assert f"cause: {cause['message']}" in shown or cause["message"] in shown, shown
        assert "next: the rank had reported its last step (step 5) and failed on its way out" in shown, shown
        assert f"orch resume {job['id']} starts from its last complete checkpoint" in shown, shown
    else:
        assert cause["message"] == "rank 0 (local rank 0) on node-0 (node 0) exited with signal SIGKILL", cause
        assert "after_last_step" not in cause and "last step" not in shown, shown
        assert f"next: resume from the last complete checkpoint: orch resume {job['id']}" in shown, shown
    assert detail["ranks"][0]["step"] == (5 if where == "after its last step" else 2)
    assert_no_leftovers(job["id"], timeout=1)


def test_rank_that_ignores_sigterm_is_killed_after_the_grace_period(orch, write_spec, hostfile) -> None:
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="600", WORKER_FAIL_RANK="0",
                                    WORKER_FAIL_AT="40", WORKER_IGNORE_TERM="1"))  # 2 s: all ignore TERM by then
    t0 = time.monotonic()
    r = orch("run", str(spec), timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    (job,) = orch.json("list")
    assert_no_leftovers(job["id"], timeout=1)
    exits = [e["data"] for e in _events(orch, job["id"]) if e["kind"] == "rank_exit"]
    assert sorted(e["how"] for e in exits if e["global_rank"] != 0) == ["signal SIGKILL"] * 3
    assert elapsed >= 2  # the grace period was given before SIGKILL


def test_processes_that_left_the_group_are_swept_and_reaped(orch, write_spec, hostfile, tmp_path) -> None:
    ready = tmp_path / "ready"
    spec = write_spec(**spec_fields(hostfile("node-0 slots=1\nnode-1 slots=1\n"), WORKER_STEPS="3",
                                    WORKER_ESCAPEE="1", WORKER_READY_DIR=str(ready)))
    r = orch("run", str(spec))
    assert r.returncode == 0, r.stderr
    (job,) = orch.json("list")
    assert_no_leftovers(job["id"], timeout=1)
    escapees = [int(p.read_text()) for p in ready.glob("escapee*.pid")]
    assert len(escapees) == 2
    for pid in escapees + [x["pid"] for x in orch.json("status", job["id"])["ranks"]]:
        assert not psutil.pid_exists(pid), f"{pid} is still there (a zombie: {psutil.Process(pid).status()})"


def test_every_process_of_an_attempt_is_killed_with_its_cgroup_even_unmarked_after_its_agent(
        orch, write_spec, hostfile, tmp_path) -> None:
    """Each rank starts a child in a new session with an empty environment (no marker), then every agent is
    SIGKILLed: the ranks die with their agent (PDEATHSIG), and the children only by the attempt's cgroup."""
    from agents.cgroups import v2_root
    assert v2_root() is not None, "these tests need a cgroup v2 hierarchy (every Linux since 2016 has one)"
    ready = tmp_path / "ready"
    spec = write_spec(**spec_fields(hostfile("node-0 slots=1\nnode-1 slots=1\n"), WORKER_STEPS="6000",
                                    WORKER_ESCAPEE="clean", WORKER_READY_DIR=str(ready)))
    proc = orch.popen("run", str(spec))
    try:
        wait_for(lambda: len(list(ready.glob("escapee*.pid"))) == 2 and len(list(ready.glob("*.ready"))) == 2, 60,
                 "2 ranks and their children")
        (job,) = orch.json("list")
        escapees = [psutil.Process(int(p.read_text())) for p in ready.glob("escapee*.pid")]
        assert all("ORCH_ATTEMPT_ID" not in p.environ() for p in escapees)  # the marker sweep cannot find them
        started = [e["data"] for e in _events(orch, job["id"]) if e["kind"] == "ranks_started"]
        cgroups = [d["cgroup"] for d in started]
        assert len(cgroups) == 2 and all(c and os.path.isdir(c) for c in cgroups), started
        for p in escapees:
            assert str(p.pid) in Path(cgroups[0 if p.pid in _pids(cgroups[0]) else 1], "cgroup.procs").read_text()
        for agent in [p for p in job_processes(job["id"]) if "ORCH_AGENT_ATTEMPT_ID" in p.environ()]:
            agent.kill()
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    detail = orch.json("status", job["id"])
    assert detail["state"] == "FAILED" and detail["cause"]["kind"] == "node_lost"
    gone = wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in escapees), 10,
                    "the unmarked children to be killed")
    assert gone and not any(os.path.exists(c) for c in cgroups)  # and the cgroups removed
    assert_no_leftovers(job["id"], timeout=1)


def _pids(cgroup: str) -> list[int]:
    return [int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()]


def _long_job(orch, write_spec, hostfile, tmp_path, env: dict | None = None) -> tuple[Any, dict]:
    """``orch run`` of a 2x2 job that steps for minutes, once its 4 ranks run: ``(the orch process, the job)``."""
    ready = tmp_path / "ready"
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="6000", WORKER_READY_DIR=str(ready)))
    proc = orch.popen("run", str(spec), env=env)
    try:
        wait_for(lambda: len(list(ready.glob("*.ready"))) == 4, 60, "4 ranks running")
        (job,) = orch.json("list")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, job


def test_cancel_from_another_process(orch, write_spec, hostfile, tmp_path) -> None:
    proc, job = _long_job(orch, write_spec, hostfile, tmp_path)
    try:
        assert job["state"] == "RUNNING"
        t0 = time.monotonic()
        r = orch("cancel", job["id"], "--wait", "30")
        assert r.returncode == 0 and r.stdout.startswith(f"Job {job['id']}: CANCELLED; every process is gone ("), r.stdout
        assert proc.wait(30) == 1
        assert time.monotonic() - t0 < 2 + 5  # within the grace period (2 s) and a little
        assert_no_leftovers(job["id"], timeout=1)
        detail = orch.json("status", job["id"])
        assert detail["state"] == "CANCELLED" and detail["cause"]["kind"] == "cancelled"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_cancel_says_what_happens_and_how_to_wait(orch, write_spec, hostfile, tmp_path) -> None:
    proc, job = _long_job(orch, write_spec, hostfile, tmp_path)
    try:
        r = orch("cancel", job["id"])  # without --wait: it says it is cancelling, and how to wait
        words = " ".join(r.stdout.split())
        assert r.returncode == 0, r.stdout + r.stderr
        assert words == (f"Cancelling job {job['id']} (RUNNING): every rank is stopped within its grace period (2 s). "
                         f"Wait for it with: orch cancel {job['id']} --wait 60; watch it with: orch status {job['id']}")
        out, _ = proc.communicate(timeout=30)
        assert f"next: resume it from its last complete checkpoint: orch resume {job['id']}" in " ".join(out.split())
        r = orch("cancel", job["id"], "--wait", "30")
        assert r.returncode == 0 and " ".join(r.stdout.split()) == (
            f"Job {job['id']} had already ended (CANCELLED); nothing is running (an automatic restart it was "
            "waiting for, if any, is called off)")
        assert_no_leftovers(job["id"], timeout=1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_env_passthrough_and_the_pythons_bin_first_on_path(orch, write_spec, hostfile, tmp_path) -> None:
    out = tmp_path / "probe"
    spec = write_spec(name="env", hostfile=str(hostfile("node-0 slots=1\n")), entrypoint=str(ROOT / "tests" / "probe.py"),
                      stop_grace_seconds=2, env={"PROBE_OUT_DIR": str(out), "PATH": "/usr/bin:/bin", "MYJOB_B": "spec"},
                      env_passthrough=["MYJOB_*"])
    shell = {"MYJOB_A": "from the shell", "MYJOB_B": "shell", "OTHERJOB_C": "c"}
    r = orch("plan", str(spec), "--env-passthrough", "OTHERJOB_C,NOTHING_*", "--output", "json", env=shell)
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)["nodes"][0]["ranks"][0]["env"]
    assert (env["MYJOB_A"], env["MYJOB_B"], env["OTHERJOB_C"]) == ("from the shell", "spec", "c")  # the spec's env wins
    assert "env_passthrough: every rank gets MYJOB_A, OTHERJOB_C from this shell" in r.stderr
    assert "warning: env_passthrough 'NOTHING_*' matches no variable of this shell" in r.stderr
    r = orch("run", str(spec), env=shell)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((out / "rank0.json").read_text())["env"]
    assert got["MYJOB_A"] == "from the shell" and got["MYJOB_B"] == "spec"
    # the spec's own PATH, with the ranks' Python's directory first (prepend_python_bin)
    assert got["PATH"] == f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"
    (job,) = orch.json("list")
    assert orch.json("status", job["id"])["spec"]["env"]["MYJOB_A"] == "from the shell"  # kept for a resume
    r = orch("plan", str(spec), "--env-passthrough", "BAD NAME")
    assert r.returncode == 2 and "expected variable names or shell patterns" in r.stderr


def test_controller_killed_agents_stop_ranks_and_the_job_is_marked_failed(orch, write_spec, hostfile,
                                                                          tmp_path) -> None:
    proc, job = _long_job(orch, write_spec, hostfile, tmp_path)
    assert len(job_processes(job["id"])) >= 6  # 2 agents + 4 ranks
    assert Controller(orch.state_dir).recover() == []  # its controller is alive: not an orphan
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert_no_leftovers(job["id"], timeout=10)  # agents saw their link close and stopped the ranks
    detail = orch.json("status", job["id"])  # reading the store notices the dead controller
    assert detail["state"] == "FAILED" and detail["cause"]["kind"] == "controller_lost"
    assert f"orch resume {job['id']}" in detail["cause"]["message"]
    assert all(r["state"] == "stopped" for r in detail["ranks"])
    assert detail["attempts"][0]["stopped_at"] is not None
    assert [e["data"].get("to") for e in _events(orch, job["id"]) if e["kind"] == "state"][-1] == "FAILED"


def test_resume_of_a_running_job_says_what_to_do(orch, write_spec, hostfile, tmp_path) -> None:
    ready = tmp_path / "ready"
    spec = write_spec(**spec_fields(hostfile("node-0 slots=1\n"), WORKER_STEPS="6000", WORKER_READY_DIR=str(ready)))
    proc = orch.popen("run", str(spec))
    try:
        wait_for(lambda: list(ready.glob("*.ready")), 60, "the rank running")
        (job,) = orch.json("list")
        r = orch("resume", job["id"])
        assert r.returncode == 2 and "is RUNNING" in r.stderr and f"orch cancel {job['id']}" in r.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("fields,hostfile_text,needles", [
    ({"hostfile": "missing-hostfile"}, None, ["hostfile", "no such file", "missing-hostfile"]),
    ({"include": "node-9"}, TWO_BY_TWO, ["node-9", "not in", "node-0"]),
    ({"include": "node-1:2,3"}, TWO_BY_TWO, ["node-1", "0..1"]),
    ({"include": "node-0:0,1,"}, TWO_BY_TWO, ["node-0:0,1,"]),
    ({"launcher": "mpirun"}, TWO_BY_TWO, ["launcher", "'mpirun'", "pdsh"]),
    ({"launcher": "mpich"}, "node-0 slots=2\nnode-1 slots=1\n", ["mpich", "same number of ranks", "node-0: 2, node-1: 1"]),
    ({"launcher_args": "--mca 'btl"}, TWO_BY_TWO, ["launcher_args", "No closing quotation"]),
    ({"launcher": "slurm", "include": "node-0:1@node-1"}, TWO_BY_TWO, ["slurm", "slots [1] on node-0", "include/exclude filter"]),
    ({"num_nodes": "two"}, TWO_BY_TWO, ["num_nodes", "integer", "'two'"]),
    ({"entrypoint": "nope.py"}, TWO_BY_TWO, ["entrypoint", "no such file", "nope.py"]),
    ({}, "node-0 lots=2\n", ["Line 1", "node-0 lots=2", "<host> slots=<n>"]),
    ({}, "node-0 slots=2\nnode-1 slots=0\n", ["node-1 (line 2)", "slots=0", "hostfile"]),
    ({"exclude": "node-0@node-1"}, TWO_BY_TWO, ["No slot of hostfile", "exclude 'node-0@node-1'"]),
    ({"provisioner": "k8s"}, TWO_BY_TWO, ["provisioner", "'k8s'", "'local', 'ssh', 'ray' or 'slurm'"]),
])
def test_bad_input_is_one_clear_message_and_starts_nothing(orch, write_spec, hostfile, fields, hostfile_text,
                                                          needles) -> None:
    base = spec_fields(hostfile(hostfile_text) if hostfile_text else Path("x"))
    base.update(fields)
    spec = write_spec(**base)
    for command in ("plan", "run"):
        r = orch(command, str(spec))
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
        err = " ".join(r.stderr.split())
        for needle in needles:
            assert needle in err, (needle, r.stderr)
    assert orch.json("list") == []


def test_port_in_use_and_two_jobs_on_one_port(orch, write_spec, hostfile, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO)), master_port=busy)
        r = orch("run", str(spec))
        assert r.returncode == 2 and f"master_port {busy} is in use" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready"
    long = spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="6000", WORKER_READY_DIR=str(ready))
    first = orch.popen("run", str(write_spec(**long, master_port=port)))
    try:
        wait_for(lambda: orch.json("list"), 30, "the first job in the store")
        r = orch("run", str(write_spec(**spec_fields(hostfile(TWO_BY_TWO)), master_port=port)))
        assert r.returncode == 2 and f"master_port {port} is already reserved by another orch job" in r.stderr
        auto = orch.json("plan", str(write_spec(**spec_fields(hostfile(TWO_BY_TWO)))))
        assert auto["master_port"] != port
        r = orch("run", str(write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="2"))))
        assert r.returncode == 0, r.stderr  # an 'auto' job runs beside it on another port
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(30)
    for job in orch.json("list"):
        assert_no_leftovers(job["id"])


def test_metrics_port_in_use_is_replaced_by_a_free_one_with_a_warning(orch, write_spec, hostfile) -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO)), metrics_port=port - 1)
        r = orch("run", str(spec))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert f"warning: metrics port {port} on node-1 cannot be used (Address already in use); the node's metrics " \
           "are on port" in out, r.stdout
    (job,) = orch.json("list")
    nodes = orch.json("status", job["id"])["node_states"]
    assert nodes[0]["metrics_port"] == port - 1 and nodes[1]["metrics_port"] not in (None, port - 1, port)


def test_logs_prefix_every_rank_and_select_one(orch, write_spec, hostfile) -> None:
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="3"), args=["--lr", "0.1"])
    assert orch("run", str(spec)).returncode == 0
    (job,) = orch.json("list")
    out = orch("logs", job["id"]).stdout.splitlines()
    for rank in range(4):
        assert f"[rank {rank}] step=3 loss=3.333333 rank={rank}" in out
    assert any(line.startswith("[rank 2] worker rank 2 argv=['--local_rank=0', '--lr', '0.1']") for line in out)
    one = orch("logs", job["id"], "--rank", "1").stdout.splitlines()
    assert one[0] == "worker rank 1 argv=['--local_rank=1', '--lr', '0.1']" and one[-1] == "step=3 loss=3.333333 rank=1"
    assert orch("logs", job["id"], "--rank", "1", "--tail", "1").stdout == "step=3 loss=3.333333 rank=1\n"
    r = orch("logs", job["id"], "--rank", "9")
    assert r.returncode == 2 and "no rank 9" in r.stderr


def test_resume_refuses_a_succeeded_job_and_unknown_jobs(orch, write_spec, hostfile) -> None:
    assert orch("run", str(write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="1")))).returncode == 0
    (job,) = orch.json("list")
    r = orch("resume", job["id"])
    assert r.returncode == 2 and "SUCCEEDED" in r.stderr and "only FAILED or CANCELLED" in r.stderr
    r = orch("status", "nope")
    assert r.returncode == 2 and "No job 'nope'" in r.stderr
    assert json.loads(orch("status", "nope", "--output", "json").stdout)["kind"] == "NotFoundError"


def test_plan_shows_ranks_env_and_real_command(orch, write_spec, hostfile) -> None:
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO)), launcher="standard", master_port=29999)
    plan = orch.json("plan", str(spec))
    assert plan["master_port"] == 29999 and plan["world_size"] == 4
    r2 = plan["nodes"][1]["ranks"][0]
    assert r2["global_rank"] == 2 and r2["env"]["GROUP_RANK"] == "1" and r2["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert plan["nodes"][0]["agent_store"] == {"addr": "127.0.0.1", "port": 29999}
    assert [c["argv"][0] for c in plan["real_commands"]] == ["torchrun", "torchrun"]
    text = orch("plan", str(spec)).stdout
    assert "What the real standard launcher would run" in text and "--node_rank=1" in text
    assert "GROUP_RANK=1" in text
    assert orch.json("list") == []  # plan starts nothing


def test_agents_stop_their_ranks_when_the_controller_falls_silent(orch, write_spec, hostfile, tmp_path) -> None:
    """The controller SIGSTOPped past the agents' lease: they stop the ranks; once it runs again, the stall
    is its own trouble, not the job's, so the job restarts although its spec has no restart policy."""
    proc, job = _long_job(orch, write_spec, hostfile, tmp_path, env={"ORCH_AGENT_LEASE_S": "3"})
    try:
        proc.send_signal(signal.SIGSTOP)  # the controller is alive but says nothing
        t0 = time.monotonic()
        wait_for(lambda: not job_processes(job["id"], running="worker.py"),
                 20, "the ranks to be stopped by their agents")
        assert time.monotonic() - t0 < 3 + 2 + 2  # lease + grace + a little
        proc.send_signal(signal.SIGCONT)
        detail = wait_for(lambda: (lambda d: d if d["attempt"] == 2 and d["state"] == "RUNNING" else None)(
            orch.json("status", job["id"])), 60, "attempt 2 RUNNING")
        cause = detail["attempts"][0]["cause"]
        assert cause["kind"] == "controller_stalled" and "no word from the controller for 3 s" in cause["message"]
        (scheduled,) = orch.events(job["id"], "restart_scheduled")
        assert scheduled.data["controller_fault"] is True and scheduled.data["max_restarts"] == 0
        assert orch("cancel", job["id"], "--wait", "30").returncode == 0
        assert proc.wait(30) == 1
        assert_no_leftovers(job["id"])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)


def test_every_node_agent_exports_metrics(orch, write_spec, hostfile, tmp_path) -> None:
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    ready = tmp_path / "ready"
    spec = write_spec(**spec_fields(hostfile(TWO_BY_TWO), WORKER_STEPS="6000", WORKER_READY_DIR=str(ready)),
                      metrics_port=base)
    plan = orch.json("plan", str(spec))
    assert [n["metrics_port"] for n in plan["nodes"]] == [base, base + 1]
    proc = orch.popen("run", str(spec))
    try:
        wait_for(lambda: len(list(ready.glob("*.ready"))) == 4, 60, "4 ranks running")
        (job,) = orch.json("list")
        for node_rank, host in enumerate(["node-0", "node-1"]):
            text = httpx.get(f"http://127.0.0.1:{base + node_rank}/metrics", timeout=5).text
            labels = f'attempt="1",job="{job["id"]}",node="{host}"'
            assert f"orch_agent_up{{{labels}}} 1.0" in text
            for rank in (2 * node_rank, 2 * node_rank + 1):
                assert f'orch_rank_up{{{labels},rank="{rank}"}} 1.0' in text
            used = float(re.search(rf"orch_node_memory_used_bytes{{{labels}}} (\S+)", text).group(1))
            total = float(re.search(rf"orch_node_memory_total_bytes{{{labels}}} (\S+)", text).group(1))
            assert 0 < used < total
            assert "pid" not in text.replace("# HELP", "")
        orch("cancel", job["id"], "--wait", "30")
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_cli_edges(orch, tmp_path) -> None:
    assert orch.json("list") == []  # no state yet: nothing is created by reading
    assert not (orch.state_dir / "orch.db").exists()
    r = orch("status", "nope")
    assert r.returncode == 2 and "No jobs in state dir" in r.stderr
    afile = tmp_path / "afile"
    afile.write_text("")
    r = orch("list", "--state-dir", str(afile))
    assert r.returncode == 2 and "is not a directory" in r.stderr and "Traceback" not in r.stderr
    r = orch("server", "--port", "99999")
    assert r.returncode == 2 and "1..65535" in r.stderr and "Traceback" not in r.stderr
    r = orch("logs", "x", "--tail", "0")
    assert r.returncode == 2 and "at least 1" in r.stderr
    r = orch("cancel", "x", "--wait", "-3")
    assert r.returncode == 2 and ">= 0" in r.stderr
    assert json.loads(orch("-o", "json", "list").stdout) == []  # options also before the command


def test_read_commands_as_real_processes_answer_as_the_in_process_entry_does(orch, write_spec, hostfile) -> None:
    """The tests run orch's read-only commands (plan, list, status, logs, resume --dry-run) through the CLI's entry
    in their own process (tests/conftest.py ``Orch``); here each is also a real ``python -m orchestrator``
    process: the same exit status, output and errors, table and JSON, for a good and a refused request."""
    spec = write_spec(**spec_fields(hostfile("node-0 slots=1\nnode-1 slots=1\n"), WORKER_STEPS="3",
                                    WORKER_FAIL_RANK="1", WORKER_FAIL_AT="2"))
    assert orch("run", str(spec), timeout=120).returncode == 1
    (job,) = orch.json("list")
    calls = [("plan", str(spec)), ("-o", "json", "plan", str(spec)), ("list",), ("-o", "json", "list"),
             ("status", job["id"]), ("-o", "json", "status", job["id"]), ("logs", job["id"]),
             ("logs", job["id"], "--rank", "1", "--tail", "2"), ("resume", job["id"], "--dry-run"),
             ("status", "no-such-job"), ("logs", job["id"], "--rank", "7"), ("plan", "--no-such-option")]
    ages = re.compile(r"\b\d+(?:\.\d+)?(?:s|m|h|d) ago\b")  # (the two calls may be a second apart)
    # master_port 'auto' is the first free port when each plan is made: another pytest-xdist worker's job may
    # hold it for one of the two calls and not the other, so the port each answer names is masked in it alone
    master_port = re.compile(r"master_port\W+(\d+)", re.IGNORECASE)

    def same(text: str) -> str:
        text = ages.sub("AGE ago", text)
        port = master_port.search(text)
        return re.sub(rf"(?<!\d){port.group(1)}(?!\d)", "PORT", text) if port else text
    for args in calls:
        inside, real = orch(*args), orch(*args, subprocess_=True)
        assert (inside.returncode, same(inside.stdout), inside.stderr) == \
            (real.returncode, same(real.stdout), real.stderr), args
        assert "Traceback" not in real.stdout + real.stderr, args
    assert [orch(*args).returncode for args in calls[-3:]] == [2, 2, 2]


def test_resume_excluding_a_host_uses_a_spare(orch, write_spec, hostfile) -> None:
    hosts = hostfile("node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n")
    spec = write_spec(**spec_fields(hosts, WORKER_STEPS="3", WORKER_FAIL_RANK="0", WORKER_FAIL_AT="2"),
                      num_nodes=2)
    assert orch("run", str(spec)).returncode == 1
    (job,) = orch.json("list")
    assert job["nodes"] == ["node-0", "node-1"]
    r = orch("resume", job["id"], "--exclude", "nope")
    assert r.returncode == 2 and "exclude_hosts names nope" in r.stderr and "node-0, node-1, node-2" in r.stderr
    r = orch("resume", job["id"], "--exclude", "node-0")
    assert r.returncode == 1  # rank 0 fails again, now on node-1
    detail = orch.json("status", job["id"])
    assert [a["nodes"] for a in detail["attempts"]] == [["node-0", "node-1"], ["node-1", "node-2"]]
    assert detail["spec"]["exclude_hosts"] == ["node-0"]
    r = orch("resume", job["id"], "--exclude", "node-1,node-2")
    assert r.returncode == 2 and "leaves no host" in r.stderr
    assert orch.json("status", job["id"])["spec"]["exclude_hosts"] == ["node-0"]  # a refused resume changes nothing
