"""Warm agents across attempts (issue 18, item 2): after a failed attempt the agents of healthy nodes stay up,
and the restart links them to its plan (no new agent, no hello); the restart only replaces what failed, and
nothing is left behind when no restart comes (local agents, a small script)."""

from __future__ import annotations

import textwrap
import time

import psutil
import pytest

from conftest import assert_no_leftovers, wait_for

pytestmark = pytest.mark.integration

# Fails (exit 3) on rank FAIL_RANK of the first FAIL_TIMES attempts; SLEEP_FIRST seconds on the first attempt.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    n = int(os.environ["ORCH_RESTART_COUNT"])
    print(f"step=1 loss=1.0 restart={n} agent={os.getppid()}", flush=True)
    if n == 0:
        time.sleep(float(os.environ.get("SLEEP_FIRST", "0")))
    if n < int(os.environ.get("FAIL_TIMES", "0")) and os.environ["RANK"] == os.environ.get("FAIL_RANK", "1"):
        sys.exit(3)
""")


def _fields(hostfile, tmp_path, hosts: str = "node-0 slots=1\nnode-1 slots=1\n", restart=None, **env: str) -> dict:
    script = tmp_path / "flaky.py"
    script.write_text(SCRIPT)
    return {"name": "warm", "hostfile": str(hostfile(hosts)), "entrypoint": str(script), "stop_grace_seconds": 2,
            "restart": restart or {"max_restarts": 2, "backoff_seconds": 0.2}, "env": env, "fast_start": "off"}


def _agents(orch, job_id: str, attempt: int) -> dict[str, int]:
    """host -> the pid of the agent that ran the attempt's node there (started, or kept from before)."""
    out = {}
    for e in orch.events(job_id):
        if e.attempt == attempt and e.kind in ("agent_up", "agent_kept"):
            out[e.data["host"]] = e.data["pid"]
    return out


def _wait_event(orch, kind: str, count: int = 1, timeout: float = 60) -> str:
    """The id of the (one) job once it has ``count`` events of ``kind``."""
    from orchestrator.store import Store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (orch.state_dir / "orch.db").exists():
            store = Store(orch.state_dir / "orch.db")
            try:
                jobs = store.list_jobs()
                if jobs and len([e for e in store.events(jobs[0].id) if e.kind == kind]) >= count:
                    return jobs[0].id
            finally:
                store.close()
        time.sleep(0.2)
    raise AssertionError(f"no {count} {kind} event(s) within {timeout} s")


def test_the_restart_keeps_every_healthy_agent(orch, write_spec, hostfile, tmp_path) -> None:
    r = orch("run", str(write_spec(**_fields(hostfile, tmp_path, FAIL_TIMES="1"))), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    first, second = _agents(orch, job["id"], 1), _agents(orch, job["id"], 2)
    assert set(first) == {"node-0", "node-1"} and second == first  # the same processes: nothing restarted
    assert "attempt 2 reuses the agents of the attempt before on node-0, node-1 (warm: no new agent)" in \
        " ".join(r.stdout.split())
    assert [e for e in orch.events(job["id"]) if e.attempt == 2 and e.kind == "agent_up"] == []
    kept = orch.events(job["id"], "agent_kept")
    assert sorted(e.data["host"] for e in kept) == ["node-0", "node-1"]
    assert all(e.data["from_attempt"] == f"{job['id']}.1" for e in kept)
    (parked,) = orch.events(job["id"], "agents_parked")
    assert parked.attempt == 1 and parked.data["hosts"] == ["node-0", "node-1"]
    for rank in (0, 1):  # each rank of attempt 2 is a child of its node's agent of attempt 1
        log = orch("logs", job["id"], "--rank", str(rank), "--attempt", "2").stdout
        assert f"restart=1 agent={first[f'node-{rank}']}" in log
    assert_no_leftovers(job["id"])
    assert not [p for p in psutil.process_iter(["pid"]) if p.pid in first.values()]


def test_no_restart_no_warm_agent_left(orch, write_spec, hostfile, tmp_path) -> None:
    """max_restarts used up: the last failed attempt's agents end with it."""
    fields = _fields(hostfile, tmp_path, restart={"max_restarts": 1, "backoff_seconds": 0}, FAIL_TIMES="9")
    r = orch("run", str(write_spec(**fields)), timeout=120)
    assert r.returncode == 1
    (job,) = orch.json("list")
    assert [a["state"] for a in orch.json("status", job["id"])["attempts"]] == ["FAILED", "FAILED"]
    every = {pid for a in (1, 2) for pid in _agents(orch, job["id"], a).values()}
    assert len(every) == 2  # attempt 2 ran on attempt 1's agents
    assert_no_leftovers(job["id"])
    assert not [p for p in psutil.process_iter(["pid"]) if p.pid in every]


def test_a_cancel_during_the_backoff_ends_the_warm_agents(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _fields(hostfile, tmp_path, restart={"max_restarts": 2, "backoff_seconds": 30}, FAIL_TIMES="1")
    proc = orch.popen("run", str(write_spec(**fields)))
    try:
        job_id = _wait_event(orch, "restart_scheduled", timeout=60)
        pids = set(_agents(orch, job_id, 1).values())
        assert pids and all(psutil.pid_exists(p) for p in pids)  # parked, alive
        assert orch("cancel", job_id).returncode == 0
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert orch.json("status", job_id)["state"] == "FAILED"
    assert_no_leftovers(job_id)
    assert not [p for p in psutil.process_iter(["pid"]) if p.pid in pids]


def test_warm_agents_can_be_turned_off(orch, write_spec, hostfile, tmp_path) -> None:
    r = orch("run", str(write_spec(**_fields(hostfile, tmp_path, FAIL_TIMES="1"))), timeout=120,
             env={"ORCH_KEEP_WARM_S": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    first, second = _agents(orch, job["id"], 1), _agents(orch, job["id"], 2)
    assert set(first) == set(second) and not set(first.values()) & set(second.values())
    assert orch.events(job["id"], "agent_kept") == []
    assert_no_leftovers(job["id"])


def test_a_lost_node_is_replaced_and_the_rest_kept(orch, write_spec, hostfile, tmp_path) -> None:
    """node-1's agent is killed (its node lost): the restart runs on the spare, with node-0's agent kept."""
    fields = _fields(hostfile, tmp_path, hosts="node-0 slots=1\nnode-1 slots=1\nspare slots=1\n",
                     restart={"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True}, SLEEP_FIRST="60")
    fields["num_nodes"] = 2
    proc = orch.popen("run", str(write_spec(**fields)))
    try:
        job_id = _wait_event(orch, "ranks_started", timeout=60, count=2)
        victim = _agents(orch, job_id, 1)["node-1"]
        psutil.Process(victim).kill()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    first, second = _agents(orch, job_id, 1), _agents(orch, job_id, 2)
    assert set(second) == {"node-0", "spare"}
    assert second["node-0"] == first["node-0"] and second["spare"] != victim
    assert [e.data["host"] for e in orch.events(job_id, "agent_kept")] == ["node-0"]
    assert_no_leftovers(job_id)


TORCH_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    n = int(os.environ["ORCH_RESTART_COUNT"])
    print(f"step=1 loss={float(torch.ones(1).sum())} restart={n}", flush=True)
    if n == 0 and os.environ["RANK"] == "1":
        import time
        time.sleep(2)  # (every node has said its ranks started by then)
        sys.exit(3)
""")


def test_the_restart_forks_its_ranks_from_the_template_kept(orch, write_spec, hostfile, tmp_path) -> None:
    """fast_start on: attempt 2's ranks are forked from the templates attempt 1's agents started (nothing imports
    torch again), and the templates end with the job."""
    (tmp_path / "flaky_torch.py").write_text(TORCH_SCRIPT)
    spec = write_spec(name="warmfork", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")),
                      workdir=str(tmp_path), entrypoint="flaky_torch.py", fast_start="on", stop_grace_seconds=2,
                      restart={"max_restarts": 1, "backoff_seconds": 0}, env={"DS_ACCELERATOR": "cpu"})
    r = orch("run", str(spec), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    started = {(e.attempt, e.data["host"]): e.data["fast_start"] for e in orch.events(job["id"], "ranks_started")}
    for host in ("node-0", "node-1"):
        first, second = started[(1, host)], started[(2, host)]
        assert first["forked"] and second["forked"] and not first["kept"] and second["kept"]
        assert second["template"] == first["template"]
    kept = {e.data["host"]: e.data["template"] for e in orch.events(job["id"], "agent_kept")}
    assert kept == {host: started[(1, host)]["template"] for host in ("node-0", "node-1")}
    assert_no_leftovers(job["id"])
    assert not [p for p in psutil.process_iter(["pid"]) if p.pid in kept.values()]


def test_a_warm_agent_answers_stop_and_ends_with_its_link() -> None:
    """Between attempts (agents.before.stay_warm): a stop (one that crossed ``idle``, or a cancel before the next
    start) is answered ``stopped`` and the agent waits on; end of stream releases it; a start is returned."""
    import queue

    from agents.before import BeforeStart

    class Writer:
        def __init__(self) -> None:
            self.sent: list[dict] = []

        def send(self, msg: dict) -> bool:
            self.sent.append(msg)
            return True

    for last, expected in (({"type": "eof"}, None), ({"type": "start", "attempt_id": "j.2"}, "j.2")):
        inbox: queue.Queue = queue.Queue()
        for msg in ({"type": "stop", "reason": "attempt ended"}, {"type": "dump"}, {"type": "ping"}, last):
            inbox.put(("controller", msg))
        writer = Writer()
        before = BeforeStart(writer, inbox, {}, warm=True)
        got = before.wait(timeout=10)
        before.close()
        assert (got or {}).get("attempt_id") == expected
        assert writer.sent == [{"type": "stopped", "reason": "attempt ended", "exits": {}}]


def test_under_a_server_the_restart_keeps_the_agents(orch, write_spec, hostfile, tmp_path, server) -> None:
    """An orch server's agents listen for a successor (reattach): kept for the restart all the same; the job ends
    SUCCEEDED on them, and nothing of it is left."""
    proc, url = server
    fields = _fields(hostfile, tmp_path, FAIL_TIMES="1")
    job_id = orch.json("submit", str(write_spec(**fields)))["id"]
    wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 120, "the job succeeds")
    first, second = _agents(orch, job_id, 1), _agents(orch, job_id, 2)
    assert set(first) == {"node-0", "node-1"} and second == first
    assert_no_leftovers(job_id)
