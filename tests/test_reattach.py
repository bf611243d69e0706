"""A restarted ``orch server`` re-attaches to the running agents of the one that was killed: the ranks
never stop, no step is lost, no attempt is added (``agents/attach.py``, ``supervision/reattach.py``).

Local agents here (the ssh path, with the bridge over real sshd hosts, is in test_ssh.py); the ranks are
``tests/scripts/worker.py``, so a step is a line in the rank's log and lost steps are countable exactly.
"""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest

from conftest import SCRIPTS, assert_no_leftovers, job_processes, running_server, wait_for

pytestmark = pytest.mark.integration

STEP = re.compile(r"^step=(\d+) ", re.M)


def _spec(write_spec, hostfile, steps: int, **env: str):
    return write_spec(name="reattach", hostfile=str(hostfile("node-0 slots=2\nnode-1 slots=1\n")),
                      entrypoint=str(SCRIPTS / "worker.py"), stop_grace_seconds=2,
                      env={"WORKER_STEPS": str(steps), "WORKER_STEP_S": "0.1", **env})


def _ranks(job_id: str) -> dict[int, psutil.Process]:
    """pid -> process of the job's ranks (not its agents)."""
    found = {}
    for p in job_processes(job_id):
        try:
            if "ORCH_ATTEMPT_ID" in p.environ() and "worker.py" in " ".join(p.cmdline()):
                found[p.pid] = p
        except psutil.Error:
            continue
    return found


def _steps(orch, job_id: str, rank: int) -> list[int]:
    return [int(s) for s in STEP.findall(orch("logs", job_id, "--rank", str(rank)).stdout)]


def _submit_then_kill_the_server(orch, spec) -> str:
    """Submit under a server, wait for the 3 ranks and RUNNING, kill -9 the server; the job's id."""
    with running_server(orch) as (proc, _url):
        job_id = orch.json("submit", str(spec))["id"]
        wait_for(lambda: len(_ranks(job_id)) == 3 and orch.json("status", job_id)["state"] == "RUNNING", 60,
                 "the ranks running")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    return job_id


def test_a_killed_server_s_running_job_goes_on_under_the_next_server(orch, write_spec, hostfile) -> None:
    spec = _spec(write_spec, hostfile, steps=150)
    with running_server(orch) as (proc, _url):
        job_id = orch.json("submit", str(spec))["id"]
        wait_for(lambda: orch.json("status", job_id)["state"] == "RUNNING" and len(_ranks(job_id)) == 3, 60,
                 "the ranks running")
        wait_for(lambda: (orch.json("status", job_id)["ranks"][0]["step"] or 0) >= 10, 60, "step 10")
        before = _ranks(job_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
    time.sleep(3)  # no controller at all for 3 s: the ranks train on
    assert set(_ranks(job_id)) == set(before), "a rank stopped while no controller ran"
    detail = orch.json("status", job_id)  # a command meanwhile does not fail the job: a server may take it over
    assert detail["state"] == "RUNNING", detail["cause"]
    assert 50 < detail["awaiting_server"]["seconds_left"] <= 62, detail["awaiting_server"]
    assert "takes the job over without a restart" in " ".join(orch("status", job_id).stdout.split())
    with running_server(orch):
        wait_for(lambda: any(e.kind == "reattached" for e in orch.events(job_id)), 30, "the new server to re-attach")
        reattached = time.monotonic() - killed
        assert set(_ranks(job_id)) == set(before)  # the very same processes
        wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 120, "the job to succeed")
    detail = orch.json("status", job_id)
    assert len(detail["attempts"]) == 1 and detail["attempts"][0]["state"] == "SUCCEEDED"
    for rank in range(3):
        assert _steps(orch, job_id, rank) == list(range(1, 151)), f"rank {rank} lost or redid steps"
    assert [r["step"] for r in detail["ranks"]] == [150, 150, 150]  # progress kept flowing into the store
    kinds = [e.kind for e in orch.events(job_id)]
    assert kinds.count("agent_reattached") == 2 and "restart_scheduled" not in kinds
    assert [e.data["to"] for e in orch.events(job_id, "state")] == ["PROVISIONING", "RUNNING", "SUCCEEDED"]
    print(f"\n[reattach] the next server re-attached {reattached:.1f} s after kill -9 of the first "
          f"(3 s of it with no server); 0 steps lost, 1 attempt")
    assert_no_leftovers(job_id)


def test_ranks_that_fail_while_no_server_runs_are_reported_by_the_next(orch, write_spec, hostfile) -> None:
    spec = _spec(write_spec, hostfile, steps=400, WORKER_FAIL_RANK="2", WORKER_FAIL_AT="60")
    job_id = _submit_then_kill_the_server(orch, spec)
    wait_for(lambda: len(_ranks(job_id)) == 2, 60, "rank 2 to fail on its own")
    with running_server(orch):
        wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", 30, "the job to fail")
    detail = orch.json("status", job_id)
    assert detail["cause"]["kind"] == "rank_exit" and detail["cause"]["global_rank"] == 2, detail["cause"]
    assert detail["cause"]["returncode"] == 3
    assert_no_leftovers(job_id)


@pytest.mark.timing
def test_agents_stop_their_ranks_when_no_server_comes_back_in_time(orch, write_spec, hostfile, monkeypatch) -> None:
    monkeypatch.setenv("ORCH_AGENT_REATTACH_S", "3")
    spec = _spec(write_spec, hostfile, steps=3000)
    job_id = _submit_then_kill_the_server(orch, spec)
    killed = time.monotonic()
    assert_no_leftovers(job_id, timeout=15)
    gone = time.monotonic() - killed
    assert 2.5 < gone < 10, gone
    # once the window (and 2 s of slack) passed, a command records the end
    wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", 10, "a command to record the end")
    assert orch.json("status", job_id)["cause"]["kind"] == "controller_lost"
    print(f"\n[reattach] with a 3 s window and no server, every process was gone {gone:.1f} s after the kill")


def test_a_job_that_ends_while_no_server_runs_is_recorded_as_it_ended(orch, write_spec, hostfile, monkeypatch) -> None:
    """Every rank exits 0 after the server died and none comes back: the agents leave the exits, and the next
    command records SUCCEEDED (not controller_lost, and no restart). The same with a rank failing: its node's
    other rank is stopped at once, and the job is FAILED naming that rank."""
    monkeypatch.setenv("ORCH_AGENT_REATTACH_S", "6")
    ok = _spec(write_spec, hostfile, steps=60, WORKER_STEP_S="0.05")
    bad = _spec(write_spec, hostfile, steps=60, WORKER_STEP_S="0.05", WORKER_FAIL_RANK="1", WORKER_FAIL_AT="30")
    ids = []
    for spec in (ok, bad):
        job_id = _submit_then_kill_the_server(orch, spec)
        ids.append(job_id)
        wait_for(lambda: orch.json("status", job_id)["state"] in ("SUCCEEDED", "FAILED"), 30, "the end recorded")
        assert_no_leftovers(job_id, timeout=10)
    done, failed = (orch.json("status", j) for j in ids)
    assert done["state"] == "SUCCEEDED" and len(done["attempts"]) == 1, done["cause"]
    assert [r["returncode"] for r in done["ranks"]] == [0, 0, 0]
    assert failed["state"] == "FAILED" and failed["cause"]["kind"] == "rank_exit", failed["cause"]
    assert failed["cause"]["global_rank"] == 1 and "while no controller ran" in failed["cause"]["message"]
    assert max(_steps(orch, ids[1], 0)) < 60  # rank 0, on rank 1's node, was stopped when rank 1 failed


def test_a_dead_server_that_is_a_zombie_or_a_reused_pid_is_dead(tmp_path) -> None:
    import socket
    import subprocess
    import sys
    from orchestrator.supervision.orphans import owner_alive
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10, "a zombie")  # (not reaped)
    zombie = {"pid": child.pid, "host": socket.gethostname(), "create_time": psutil.Process(child.pid).create_time()}
    assert not owner_alive(zombie)
    child.wait()
    me = psutil.Process()
    assert owner_alive({"pid": me.pid, "host": socket.gethostname(), "create_time": me.create_time()})
    assert not owner_alive({"pid": me.pid, "host": socket.gethostname(), "create_time": me.create_time() - 100})


def test_job_ids_that_are_not_ids_are_answered_not_a_traceback(orch) -> None:
    with running_server(orch):
        for job in ("j\x1b[31m", "a?b", "%2e%2e", "a/b", "x[/y]z"):
            for command in ("status", "logs", "cancel"):
                r = orch(command, job)
                assert r.returncode == 2 and "Traceback" not in r.stderr, (job, command, r.stderr[-500:])
                assert f"No job {job!r}" in r.stderr or "Not Found" not in r.stderr, (job, r.stderr)
