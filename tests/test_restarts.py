"""The spec's restart policy: automatic restarts with backoff, which causes are retried, a lost
node left out for a spare, the restart count every rank sees, calling a restart off, and a
policy that cannot be satisfied refused at submit time (local agents, a small script)."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from conftest import assert_no_leftovers, wait_for

pytestmark = pytest.mark.integration

# A rank that fails (exit FAIL_CODE, rank FAIL_RANK) on the first FAIL_TIMES attempts, or on the
# first attempt sleeps (SLEEP_FIRST seconds) so that a test can take a node away.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    n = int(os.environ["ORCH_RESTART_COUNT"])
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(n)
    print(f"step=1 loss=1.0 restart={n} node={os.environ['ORCH_NODE']}", flush=True)
    if n == 0:
        time.sleep(float(os.environ.get("SLEEP_FIRST", "0")))
    if n < int(os.environ.get("FAIL_TIMES", "0")) and os.environ["RANK"] == os.environ.get("FAIL_RANK", "1"):
        sys.exit(int(os.environ.get("FAIL_CODE", "3")))
""")


def _spec(write_spec, hostfile, tmp_path, hosts: str = "node-0 slots=1\nnode-1 slots=1\n", *,
          restart: dict, **env: str):
    script = tmp_path / "flaky.py"
    script.write_text(SCRIPT)
    fields = {"name": "flaky", "hostfile": str(hostfile(hosts)), "entrypoint": str(script),
              "stop_grace_seconds": 2, "restart": restart, "env": env}
    return fields


def test_a_failed_rank_is_restarted_and_the_job_succeeds(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _spec(write_spec, hostfile, tmp_path, restart={"max_restarts": 2, "backoff_seconds": 0.2},
                   FAIL_TIMES="1")
    r = orch("run", str(write_spec(**fields)), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "restart 1 of 2 in 0 s (restart policy)" in out and "SUCCEEDED" in out
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert [a["state"] for a in detail["attempts"]] == ["FAILED", "SUCCEEDED"]
    assert detail["attempts"][0]["cause"]["kind"] == "rank_exit"
    assert detail["restarts"] == 1
    for rank in (0, 1):
        log = orch("logs", job["id"], "--rank", str(rank)).stdout
        assert f"restart=1 node=node-{rank}" in log  # both ranks of attempt 2 see the same count
    (ev,) = orch.events(job["id"], "restart_scheduled")
    assert ev.data == {"restart": 1, "max_restarts": 2, "in_seconds": 0.2, "exclude_hosts": [],
                       "cause_kind": "rank_exit"}
    # every rank's exit was known when attempt 1 failed: its teardown waited for no silent node
    assert orch.events(job["id"], "silence_wait") == []
    assert_no_leftovers(job["id"])


def test_restarts_stop_at_max_restarts_with_growing_backoff(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _spec(write_spec, hostfile, tmp_path,
                   restart={"max_restarts": 2, "backoff_seconds": 0.1, "backoff_factor": 3}, FAIL_TIMES="9")
    r = orch("run", str(write_spec(**fields)), timeout=120)
    assert r.returncode == 1
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert [a["state"] for a in detail["attempts"]] == ["FAILED"] * 3
    assert [e.data["in_seconds"] for e in orch.events(job["id"], "restart_scheduled")] == [
        pytest.approx(0.1), pytest.approx(0.3)]
    assert "no automatic restart: the job was restarted 2 time(s), its max_restarts" in " ".join(r.stdout.split())
    assert_no_leftovers(job["id"])


def test_only_the_listed_causes_and_exit_codes_are_restarted(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _spec(write_spec, hostfile, tmp_path,
                   restart={"max_restarts": 3, "backoff_seconds": 0, "retry_exit_codes": [7]}, FAIL_TIMES="9")
    r = orch("run", str(write_spec(**fields)), timeout=120)  # exits with 3: not restarted
    assert r.returncode == 1
    (job,) = orch.json("list")
    assert len(orch.json("status", job["id"])["attempts"]) == 1
    assert orch.events(job["id"], "restart_scheduled") == []
    fields = _spec(write_spec, hostfile, tmp_path, restart={"max_restarts": 3, "backoff_seconds": 0,
                                                            "retry_on": ["node_lost"]}, FAIL_TIMES="9")
    r = orch("run", str(write_spec(**fields)), timeout=120)  # a rank exit is not a node loss
    assert r.returncode == 1 and "restart 1" not in r.stdout


def test_a_lost_node_is_left_out_and_a_spare_takes_its_place(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _spec(write_spec, hostfile, tmp_path, "node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n",
                   restart={"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True},
                   SLEEP_FIRST="120")
    fields["num_nodes"] = 2
    proc = orch.popen("run", str(write_spec(**fields)))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 30, "the job")
        agents = wait_for(lambda: {e.data["node_rank"]: e.data["pid"] for e in orch.events(job_id, "agent_up")}
                          if len(orch.events(job_id, "agent_up")) == 2 else None, 60, "both agents")
        wait_for(lambda: orch.json("status", job_id)["state"] == "RUNNING", 60, "RUNNING")
        os.kill(agents[1], signal.SIGKILL)  # node-1's agent: its link closes, the node is lost
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out + err
    assert "restart 1 of 1 in 0 s without node-1 (restart policy)" in " ".join(out.split())
    detail = orch.json("status", job_id)
    first, second = detail["attempts"]
    assert first["cause"]["kind"] == "node_lost" and first["cause"]["node"] == "node-1"
    assert first["nodes"] == ["node-0", "node-1"] and second["nodes"] == ["node-0", "node-2"]
    assert detail["state"] == "SUCCEEDED" and detail["spec"]["exclude_hosts"] == ["node-1"]
    assert_no_leftovers(job_id)


@pytest.mark.timing
def test_cancel_during_the_backoff_calls_the_restart_off(orch, write_spec, hostfile, tmp_path) -> None:
    fields = _spec(write_spec, hostfile, tmp_path, restart={"max_restarts": 3, "backoff_seconds": 60},
                   FAIL_TIMES="9")
    proc = orch.popen("run", str(write_spec(**fields)))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 30, "the job")
        wait_for(lambda: orch.events(job_id, "restart_scheduled"), 60, "the restart to be scheduled")
        t0 = time.monotonic()
        r = orch("cancel", job_id)  # another process: through the store to `orch run`'s controller
        assert r.returncode == 0, r.stderr
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 1 and took < 10, (took, out, err)
    (ev,) = orch.events(job_id, "restart_called_off")
    assert ev.data == {"reason": "cancelled by the user"}
    detail = orch.json("status", job_id)
    assert detail["state"] == "FAILED" and len(detail["attempts"]) == 1
    assert_no_leftovers(job_id)


def test_exclude_failed_nodes_without_a_spare_is_explained_at_submit(orch, write_spec, hostfile, tmp_path) -> None:
    # with num_nodes unset the job would restart on the nodes left (tests/test_universal.py); a fixed
    # num_nodes with no host beyond it cannot be satisfied
    fields = _spec(write_spec, hostfile, tmp_path, restart={"max_restarts": 1, "exclude_failed_nodes": True})
    fields["num_nodes"] = 2
    spec = write_spec(**fields)
    for command in ("plan", "run"):
        r = orch(command, str(spec))
        assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
        err = " ".join(r.stderr.split())
        assert "restart.exclude_failed_nodes:" in err and "Add a spare host to the hostfile" in err, err
        assert "num_nodes is 2" in err
    assert orch.json("list") == []
