"""``orch stacks JOB [--rank N]``: what every running rank is doing now, from py-spy dumps through the job's
agents (under ``orch server``), or directly on this machine for an ``orch run`` job of local agents. The ranks
here sleep in a function of their own before their first step; the dump names that line."""

from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import running_server, wait_for

pytestmark = pytest.mark.integration

SCRIPT = '''import os, time


def wait_for_the_data():
    time.sleep(600)  # the line the stacks must name


print(f"rank {os.environ['RANK']} up", flush=True)
wait_for_the_data()
'''


def _spec(write_spec, hostfile, tmp_path, forked: bool = False):
    """The sleeper job; ``forked``: its script imports torch and its ranks are forked from a template
    (``fast_start: on``), whose own frames (agents/forktemplate.py) a dump must not show as the rank's."""
    (tmp_path / "sleeper.py").write_text(("import torch\n" if forked else "") + SCRIPT)
    return write_spec(name="sleepy", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")),
                      workdir=str(tmp_path), entrypoint="sleeper.py", stop_grace_seconds=1,
                      **({"fast_start": "on"} if forked else {}))


def _up(orch, job_id: str) -> bool:
    d = orch.json("status", job_id)
    return d["state"] == "RUNNING" and all("up" in (r.get("last_line") or "") for r in d["ranks"])


@pytest.mark.parametrize("forked", [False, True], ids=["exec", "forked"])
def test_orch_stacks_names_the_line_every_rank_sleeps_on(orch, write_spec, hostfile, tmp_path, forked) -> None:
    spec = _spec(write_spec, hostfile, tmp_path, forked)
    line = "sleeper.py:6" if forked else "sleeper.py:5"  # (the forked one's script starts with its import)
    with running_server(orch):
        job_id = orch.json("submit", str(spec))["id"]
        wait_for(lambda: _up(orch, job_id), 60, "both ranks up")
        report = orch.json("stacks", job_id)
        assert sorted(report["ranks"]) == ["0", "1"] and report["silent_nodes"] == []
        for rank, d in report["ranks"].items():
            assert d["where"].startswith("wait_for_the_data (") and line in d["where"], d
            assert os.path.isfile(d["file"]) and "wait_for_the_data" in open(d["file"]).read()
        # orch status shows where a rank is once it has made no progress for --stuck-after seconds
        status = wait_for(lambda: (lambda r: r if all(f"rank {n}: no progress for " in r.stdout for n in (0, 1))
                                   else None)(orch("status", job_id, "--stuck-after", "1")), 30,
                          "orch status to show both quiet ranks")
        assert "now in wait_for_the_data (" in status.stdout and line in status.stdout
        quiet = orch("status", job_id)  # the default, 60 s, has not passed: no dumps
        assert quiet.returncode == 0 and "no progress for" not in quiet.stdout
        one = orch("stacks", job_id, "--rank", "1")
        assert one.returncode == 0 and "rank 1: in wait_for_the_data (" in one.stdout and "rank 0" not in one.stdout
        r = orch("stacks", job_id, "--rank", "7")
        assert r.returncode == 2 and "has no rank 7 (world size 2)" in r.stderr
        orch("cancel", job_id, "--wait", "30")
        r = orch("stacks", job_id)
        assert r.returncode == 2 and "is CANCELLED, not running" in r.stderr


def test_orch_stacks_of_an_orch_run_job_dumps_here(orch, write_spec, hostfile, tmp_path) -> None:
    spec = _spec(write_spec, hostfile, tmp_path)
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        wait_for(lambda: _up(orch, job_id), 60, "both ranks up")
        r = orch("stacks", job_id, "--output", "json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert all(d["where"].startswith("wait_for_the_data (") for d in report["ranks"].values()), report
        assert sorted(report["ranks"]) == ["0", "1"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
