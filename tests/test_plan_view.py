"""``orch plan`` of a large plan (issue 18): a summary by default, every node and rank with ``--all``,
the whole plan with ``--output json`` (orchestrator/face/cli/planview.py)."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import SCRIPTS

WORKER = str(SCRIPTS / "worker.py")


def _spec(write_spec, hostfile, nodes: int):
    hosts = hostfile("".join(f"n{i} slots=2\n" for i in range(nodes)))
    return write_spec(hostfile=str(hosts), entrypoint=WORKER, launcher="standard", env={"MY_VAR": "x y"})


def _plan(orch, *args: str) -> str:
    r = orch("plan", *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def test_a_plan_of_many_nodes_is_summarised(orch, write_spec, hostfile) -> None:
    out = _plan(orch, str(_spec(write_spec, hostfile, 40)))
    assert "Summary: 40 nodes, 80 ranks, 80 slots (2 per node)" in out
    nodes = out.split("\nNodes", 1)[1].split("Environment of rank 0", 1)[0]
    assert {int(m[1]) for m in re.finditer(r"^(\d+)\s+n(\d+)\s", nodes, re.M)} == {0, 1, 2, 37, 38, 39}
    assert "(34 nodes not shown)" in nodes
    env = out.split("Environment of rank 0, in full", 1)[1].split("\nRanks", 1)[0] + "\n"
    # rank 0's environment in full: the launcher's, orch's and the spec's variables, each on its line
    for line in ("RANK=0", "LOCAL_RANK=0", "GROUP_RANK=0", "WORLD_SIZE=80", "ORCH_NODE=n0", "MY_VAR='x y'"):
        assert f"\n  {line}\n" in env, line
    ranks = out.split("\nRanks", 1)[1].split("devices:", 1)[0]
    assert {int(m[1]) for m in re.finditer(r"^(\d+)\s+n\d+ \(\d+\)", ranks, re.M)} == {0, 1, 2, 77, 78, 79}
    assert "(74 ranks not shown)" in ranks
    assert re.search(r"^79\s+n39 \(39\)\s+1\s+1\s+.*GROUP_RANK=39", ranks, re.M)  # what differs from rank 0
    torchruns = re.findall(r"--node_rank=(\d+)", out.split("would run:", 1)[1])
    assert torchruns == ["0", "1", "2", "37", "38", "39"] and "... and 34 more commands" in out


def test_all_shows_every_node_rank_and_command(orch, write_spec, hostfile) -> None:
    spec = str(_spec(write_spec, hostfile, 40))
    out = _plan(orch, "--all", spec)
    assert "Summary:" not in out and "not shown" not in out and "more ranks" not in out
    nodes = out.split("\nNodes", 1)[1].split("Environment of every rank", 1)[0]
    assert {int(m[1]) for m in re.finditer(r"^(\d+)\s+n(\d+)\s", nodes, re.M)} == set(range(40))
    ranks = out.split("\nRanks", 1)[1].split("devices:", 1)[0]
    assert {int(m[1]) for m in re.finditer(r"^(\d+)\s+n\d+ \(\d+\)", ranks, re.M)} == set(range(80))
    assert re.findall(r"--node_rank=(\d+)", out.split("would run:", 1)[1]) == [str(i) for i in range(40)]
    plan = orch.json("plan", spec)  # --output json: always the whole plan
    assert len(plan["nodes"]) == 40 and sum(len(n["ranks"]) for n in plan["nodes"]) == 80
    assert plan["nodes"][39]["ranks"][1]["env"]["RANK"] == "79" and len(plan["real_commands"]) == 40


def test_a_plan_of_16_nodes_is_shown_whole(orch, write_spec, hostfile) -> None:
    out = _plan(orch, str(_spec(write_spec, hostfile, 16)))
    assert "Summary:" not in out and "Environment of every rank" in out and "not shown" not in out
    ranks = out.split("\nRanks", 1)[1].split("devices:", 1)[0]
    assert {int(m[1]) for m in re.finditer(r"^(\d+)\s+n\d+ \(\d+\)", ranks, re.M)} == set(range(32))


@pytest.mark.integration
def test_json_into_a_pipe_closed_early_stops_quietly(orch, write_spec, hostfile) -> None:
    """``orch plan -o json big.yaml | head -c 100``: the reader has its 100 bytes; orch stops without a
    traceback or a word, with the status of a command killed by SIGPIPE (141, as `cat` into `head`)."""
    spec = str(_spec(write_spec, hostfile, 200))  # ~0.8 MB of JSON: more than a pipe holds, so a write fails
    with subprocess.Popen(orch.cmd("plan", "--output", "json", spec), env=orch.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        head = proc.stdout.read(100)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=600)
    assert head.startswith(b'{"job_id": ') and len(head) == 100
    assert code == 141 and err == "", err
