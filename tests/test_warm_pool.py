"""Agents kept warm between jobs (issue 18: launch time): under ``orch server --keep-warm S`` a job's agents and
fork-server templates stay up S seconds after it ends, and the next job on the same hosts (same provisioner key)
takes them: no agent start, no import; they end once S passes or the server stops, and ``orch gc`` leaves them
alone meanwhile (local agents, real torch ranks)."""

from __future__ import annotations

import json
import textwrap
import time

import psutil
import pytest

from conftest import assert_no_leftovers, running_server, wait_for

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import os
    import torch
    print(f"step=1 loss={float(torch.ones(1).sum())} rank={os.environ['RANK']}", flush=True)
""")


def _spec(write_spec, hostfile, tmp_path, name: str, hosts: str = "node-0 slots=1\nnode-1 slots=1\n"):
    (tmp_path / "warm_torch.py").write_text(SCRIPT)
    return write_spec(name=name, hostfile=str(hostfile(hosts)), workdir=str(tmp_path), entrypoint="warm_torch.py",
                      fast_start="on", stop_grace_seconds=2, env={"DS_ACCELERATOR": "cpu"})


def _submit(orch, spec) -> str:
    job_id = orch.json("submit", str(spec))["id"]
    wait_for(lambda: orch.json("status", job_id)["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), 180,
             f"job {job_id} ends")
    assert orch.json("status", job_id)["state"] == "SUCCEEDED", orch("logs", job_id).stdout[-3000:]
    return job_id


def _agents(orch, job_id: str) -> dict[str, dict]:
    """host -> how the job's node there got its agent: ``{"kind": agent_up|agent_kept, **event data}``."""
    return {e.data["host"]: {"kind": e.kind, **e.data} for e in orch.events(job_id)
            if e.kind in ("agent_up", "agent_kept")}


def _started(orch, job_id: str) -> dict[str, dict]:
    """host -> the ``fast_start`` note of its ``ranks_started`` event."""
    return {e.data["host"]: e.data["fast_start"] for e in orch.events(job_id, "ranks_started")}


def _alive(pids) -> list[int]:
    return [p for p in pids if p and psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_the_next_job_takes_the_agents_and_templates_of_the_last(orch, write_spec, hostfile, tmp_path) -> None:
    """Job 2 on the same hosts runs on job 1's agents (agent_kept from job 1, the same pids) and forks its ranks
    from job 1's templates; a third job with one more host gets a new agent there only; orch gc leaves the kept
    agents alone; stopping the server ends them all."""
    with running_server(orch, "--keep-warm", "120"):
        first = _submit(orch, _spec(write_spec, hostfile, tmp_path, "one"))
        up = _agents(orch, first)
        assert {h: a["kind"] for h, a in up.items()} == {"node-0": "agent_up", "node-1": "agent_up"}
        templates = {h: n["template"] for h, n in _started(orch, first).items()}
        # (written once the job's agents are kept, which follows its SUCCEEDED)
        wait_for(lambda: (orch.state_dir / "warm-agents.json").exists(), 30, "the record of the kept agents")
        record = json.loads((orch.state_dir / "warm-agents.json").read_text())
        assert set(record["pids"]) == {a["pid"] for a in up.values()} | set(templates.values())

        second = _submit(orch, _spec(write_spec, hostfile, tmp_path, "two"))
        kept = _agents(orch, second)
        assert {h: (a["kind"], a["pid"], a.get("from_job")) for h, a in kept.items()} == \
            {h: ("agent_kept", up[h]["pid"], first) for h in up}
        for host, note in _started(orch, second).items():
            assert note["forked"] and note["kept"] and note["template"] == templates[host], note
        assert f"agents kept warm on node-0, node-1 (from job {first})" in orch("status", second).stdout
        assert [k["from_job"] for k in orch.json("status", second)["agents_kept"]] == [first, first]

        gc = orch.json("gc")
        assert not set(gc["killed"]) & set(record["pids"])
        assert any(k["job"] == first and "kept warm" in k["why"] for k in gc["kept"]), gc["kept"]
        assert len(_alive(record["pids"])) == len(record["pids"])

        third = _submit(orch, _spec(write_spec, hostfile, tmp_path, "three",
                                    "node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n"))
        got = _agents(orch, third)
        assert {h: a["kind"] for h, a in got.items()} == \
            {"node-0": "agent_kept", "node-1": "agent_kept", "node-2": "agent_up"}
        assert got["node-0"]["pid"] == up["node-0"]["pid"] and got["node-0"]["from_job"] == second
        everyone = set(record["pids"]) | {got["node-2"]["pid"], _started(orch, third)["node-2"]["template"]}
    wait_for(lambda: not _alive(everyone), 30, "the kept agents and templates end with the server")
    assert not (orch.state_dir / "warm-agents.json").exists()
    for job_id in (first, second, third):
        assert_no_leftovers(job_id)


def test_kept_agents_end_when_the_time_is_up(orch, write_spec, hostfile, tmp_path) -> None:
    """--keep-warm 8: the agents end a few seconds before 8 s pass (so no job takes one about to leave) while the
    server runs on; the next job starts new agents."""
    with running_server(orch, "--keep-warm", "8"):
        first = _submit(orch, _spec(write_spec, hostfile, tmp_path, "one"))
        pids = [a["pid"] for a in _agents(orch, first).values()] + \
            [n["template"] for n in _started(orch, first).values()]
        wait_for(lambda: not _alive(pids), 30, "the kept agents end")
        assert not (orch.state_dir / "warm-agents.json").exists()
        assert_no_leftovers(first)
        second = _submit(orch, _spec(write_spec, hostfile, tmp_path, "two"))
        assert {a["kind"] for a in _agents(orch, second).values()} == {"agent_up"}


def test_without_keep_warm_a_job_leaves_no_agent(orch, write_spec, hostfile, tmp_path) -> None:
    """The default (--keep-warm 0): a succeeded job's agents end with it, and the next job starts its own."""
    with running_server(orch):
        first = _submit(orch, _spec(write_spec, hostfile, tmp_path, "one"))
        assert_no_leftovers(first)
        second = _submit(orch, _spec(write_spec, hostfile, tmp_path, "two"))
        assert {a["kind"] for a in _agents(orch, second).values()} == {"agent_up"}
        assert not (orch.state_dir / "warm-agents.json").exists()


def test_a_shared_agent_is_taken_only_by_its_own_key() -> None:
    """WarmPool.take_shared: a host's kept agent goes to a job whose provisioner key there is the same (how it
    logs in, its interpreter), never to another; one about to stop waiting (within MARGIN_S) is ended instead."""
    from orchestrator.supervision.warm import Relay, WarmNode, WarmPool

    class Handle:  # the one seam: an agent's link
        def __init__(self) -> None:
            self.closed = False

        def close(self) -> None:
            self.closed = True

        def wait(self, timeout: float | None = None) -> bool:
            return self.closed

        def kill(self) -> None:
            self.closed = True

    pool = WarmPool(share_s=60)
    now = time.monotonic()
    nodes = [WarmNode("a", Handle(), Relay(None, 0), {"pid": 1}, job_id="j1", key=("ssh", "a", 22, "me"),
                      until=now + 60),
             WarmNode("b", Handle(), Relay(None, 1), {"pid": 2}, job_id="j1", key=("ssh", "b", 22, "me"),
                      until=now + 2)]
    pool._shared += nodes
    assert pool.take_shared({"a": ("ssh", "a", 22, "you"), "b": None}, "j2") == {}
    assert [n["host"] for n in pool.shared()] == ["a", "b"]
    assert pool.take_shared({"a": ("ssh", "a", 22, "me"), "b": ("ssh", "b", 22, "me")}, "j2") == {"a": nodes[0]}
    assert nodes[1].handle.closed and not nodes[0].handle.closed and pool.shared() == []
    pool.close()


class _Provisioner:
    """The one seam of the WarmPool tests below: what parks and hands on agents (a local one's key)."""

    def detach(self, node_rank: int) -> None:
        pass

    def forget(self, node_rank: int) -> None:
        pass

    def close(self) -> None:
        pass

    def warm_key(self, host: str) -> tuple:
        return ("local", "python")


class _EndedHandle:
    """An agent's link that has ended (closing it does nothing more)."""

    def close(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True


def test_a_job_right_after_the_last_waits_for_its_agents_to_come_back() -> None:
    """A job ends (its state is recorded) before its agents are stopped and parked: a job submitted at once on the
    same hosts waits for them (WarmPool.expect, up to WAIT_S) instead of starting new agents beside them."""
    import threading

    from orchestrator.supervision.warm import Relay, WarmNode, WarmPool

    pool = WarmPool(share_s=60)
    pool.expect("j1", {"a"})
    node = WarmNode("a", _EndedHandle(), Relay(None, 0), {"pid": 1})

    def teardown() -> None:
        time.sleep(1.0)
        pool.park("j1", 1, _Provisioner(), {"a": node}, keep_s=60)
        pool.retire("j1")
    threading.Thread(target=teardown).start()
    assert pool.take_shared({"a": ("local", "python")}, "j2") == {"a": node}
    assert pool.take_shared({"a": ("local", "python")}, "j3") == {}  # nothing expected now: no wait, none left
    pool.close()


def test_the_record_lists_the_shared_agents_a_job_runs_on_until_it_hands_them_back(tmp_path) -> None:
    """A kept agent's process carries the attempt id of the job that started it, so ``orch gc`` leaves it alone only
    while the record (``warm-agents.json``, read by housekeeping.kept_pids) lists it: it does while it waits, while
    a later job runs on it, and after that job hands it back; it leaves the record when that job lets it go."""
    import os
    import socket

    from orchestrator.supervision.housekeeping import kept_pids
    from orchestrator.supervision.warm import WARM_RECORD, Relay, WarmNode, WarmPool

    me = psutil.Process()
    record = tmp_path / WARM_RECORD
    pool = WarmPool(share_s=60, record=record,
                    owner={"pid": me.pid, "host": socket.gethostname(), "create_time": me.create_time()})
    node = WarmNode("a", _EndedHandle(), Relay(None, 0), {"pid": os.getpid(), "template": 4242})
    pool.park("j1", 1, _Provisioner(), {"a": node}, keep_s=60)
    pool.retire("j1")
    assert kept_pids(record) == {os.getpid(), 4242}
    assert pool.take_shared({"a": ("local", "python")}, "j2") == {"a": node}
    assert pool.shared() == [] and kept_pids(record) == {os.getpid(), 4242}  # j2 runs on them
    again = WarmNode("a", _EndedHandle(), Relay(None, 0), {"pid": os.getpid(), "template": 4242})
    pool.park("j2", 1, _Provisioner(), {"a": again}, keep_s=60)
    pool.retire("j2")
    assert [n["job_id"] for n in pool.shared()] == ["j2"] and kept_pids(record) == {os.getpid(), 4242}
    assert pool.take_shared({"a": ("local", "python")}, "j3") == {"a": again}
    pool.release("j3")  # j3 ended without handing them back (its agent was lost, say)
    assert kept_pids(record) == set() and not record.exists()
    pool.close()
