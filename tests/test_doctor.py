"""``orch doctor``: every node's environment, clock and master port checked through the agents the job's
provisioner starts, judged across nodes, each failure naming the node and the check.

Local agents (two "nodes" on this machine) for the passing run, the JSON shape and bad input; real sshd
hosts (tests/nethosts.py) for 3 nodes: passing, then one host whose Python lacks DeepSpeed (a
``sitecustomize`` on that host's ``PYTHONPATH``, under the ``nossh`` launcher, that makes ``import deepspeed``
fail as if it were not installed), one whose clock is skewed (the agent's test seam
``ORCH_DOCTOR_CLOCK_OFFSET_S``), both set for that host alone by its sshd's ``SetEnv``, and one that cannot
reach the master port (a policy-routing rule in its network namespace that prohibits TCP to that port).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import psutil

from conftest import SCRIPTS, wait_for
from orchestrator.supervision.doctor_verdict import (DOCTOR_CHECKS, Limits, NodeAnswers, clock_offset, judge,
                                                      pair_rounds)

TWO_NODES = "node-0 slots=1\nnode-1 slots=1\n"
NO_DEEPSPEED = '''import sys


class _NoDeepSpeed:
    """This Python lacks DeepSpeed: import deepspeed fails as for a package not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoDeepSpeed())
'''


OPS = {"async_io": {"installed": False, "compatible": True}, "cpu_adam": {"installed": True, "compatible": True},
       "fused_adam": {"installed": False, "compatible": False}}


def _report(**over: Any) -> dict:
    r = {"errors": [], "python": "3.11.7", "torch": "2.13.0", "cuda": None, "deepspeed": "0.19.8",
         "accelerator": "cpu", "gpus": 0, "memory": 8 << 30, "clock": 0.0, "ops": OPS,
         "disk": {"workdir": {"path": "/w", "free": 8 << 30}, "checkpoint_dir": {"path": "/c", "free": 8 << 30}}}
    r.update(over)
    return r


def _links(i: int, n: int, gbps: dict[tuple[int, int], float]) -> list[dict]:
    """Node i's link results: every pair of pair_rounds(n) with i, at gbps[(a, b)] (default 2.0 + a + b / 10)."""
    pairs = [tuple(p) for rnd in pair_rounds(n)[0] for p in rnd if i in p]
    return [{"peer": b if a == i else a, "gbps": gbps.get((a, b), 2.0 + a + b / 10), "seconds": 0.002,
             "bytes": 4 << 20, "correct": True} for a, b in pairs]


def _answers(n: int, gbps: dict[tuple[int, int], float] | None = None, **per_node: dict) -> list[NodeAnswers]:
    out = []
    for i in range(n):
        a = NodeAnswers(i, f"h{i}", report=_report(), clock=(100.0, 100.2, 100.1),
                        port={"status": "passed", "detail": "ok"},
                        allreduce={"status": "passed", "result": {
                            "busbw": 1e9 - i, "bytes": 4 << 20, "seconds": 0.01, "iters": 5, "correct": True,
                            "backend": "gloo", "links": _links(i, n, gbps or {}), "rounds": len(pair_rounds(n)[0]),
                            "rounds_done": len(pair_rounds(n)[0])}})
        for key, value in per_node.get(f"h{i}", {}).items():
            setattr(a, key, value)
        out.append(a)
    return out


def _doctor_agents() -> list[int]:
    """Pids of live processes marked as an ``orch doctor`` agent (``ORCH_AGENT_ATTEMPT_ID=doctor-...``)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("ORCH_AGENT_ATTEMPT_ID", "").startswith("doctor-") and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def assert_no_leftovers(timeout: float) -> None:
    wait_for(lambda: not _doctor_agents(), timeout, "every doctor agent to be gone")


def _failed(verdict: dict) -> set[tuple[str, str]]:
    return {(f["node"], f["check"]) for f in verdict["failures"]}


# --------------------------------------------------------------------------- the verdict (pure)

def test_verdict_names_the_odd_node_out_of_the_largest_group_of_versions() -> None:
    answers = _answers(4, h2={"report": _report(deepspeed="0.14.0", torch="2.1.0")})
    verdict = judge(answers, Limits())
    assert _failed(verdict) == {("h2", "versions")}
    (f,) = verdict["failures"]
    assert f["message"] == "torch 2.1.0, deepspeed 0.14.0 where 3 of 4 nodes have torch 2.13.0, deepspeed 0.19.8"
    assert f["text"].startswith("h2 (node 2) versions: ")
    ok = next(c for c in verdict["nodes"][0]["checks"] if c["name"] == "versions")
    assert ok["status"] == "passed" and "(as on 3 of 4 nodes)" in ok["detail"]
    assert verdict["passed"] is False and verdict["checks"][0] == "agent"


def test_verdict_names_the_slowest_all_reduce_and_a_failed_one() -> None:
    verdict = judge(_answers(3), Limits())
    details = [next(c for c in n["checks"] if c["name"] == "allreduce")["detail"] for n in verdict["nodes"]]
    assert details[2] == "bus bandwidth 1000.0 MB/s (4 MiB, 10.0 ms each); the slowest of 3 nodes"
    assert not details[0].endswith("nodes") and verdict["passed"] is True
    failed = judge(_answers(2, h1={"allreduce": {"status": "failed", "detail": "the all-reduce failed: no result"}}),
                   Limits())
    assert _failed(failed) == {("h1", "allreduce")}


def test_verdict_clock_skew_counts_the_round_trip() -> None:
    assert clock_offset(100.0, 100.2, 105.1) == pytest.approx((5.0, 0.1))
    # 2.5 s off but read over a 1.2 s round trip: within 2 s once the uncertainty (0.6 s) is counted
    answers = _answers(2, h0={"clock": (100.0, 101.2, 103.1)}, h1={"clock": (100.0, 100.02, 97.0)})
    verdict = judge(answers, Limits(max_skew_s=2.0))
    assert _failed(verdict) == {("h1", "clock")}
    assert verdict["failures"][0]["message"].startswith(
        "3.010 s behind the controller's clock (±0.010 s): more than 2 s")


def test_pair_rounds_test_every_pair_once_in_disjoint_rounds_and_ring_neighbours_above_16() -> None:
    assert pair_rounds(1) == ([], "no links (one node)")
    for n, rounds in ((2, 1), (3, 3), (4, 3), (5, 5), (16, 15), (17, 3), (18, 2)):
        schedule, scope = pair_rounds(n)
        pairs = [tuple(p) for rnd in schedule for p in rnd]
        assert len(schedule) == rounds and len(pairs) == len(set(pairs)), n
        for rnd in schedule:
            ends = [x for p in rnd for x in p]
            assert len(ends) == len(set(ends)), (n, rnd)  # a node is in one pair of a round at most
        if n <= 16:
            assert scope == "all pairs" and set(pairs) == {(a, b) for a in range(n) for b in range(a + 1, n)}
        else:
            assert scope == f"ring neighbours only (i <-> i+1 mod {n}): more than 16 nodes"
            assert set(pairs) == {tuple(sorted((i, (i + 1) % n))) for i in range(n)}


def test_verdict_names_the_slowest_link_and_fails_links_under_the_minimum_naming_both_nodes() -> None:
    verdict = judge(_answers(3, gbps={(0, 2): 0.5}), Limits())
    assert verdict["passed"] is True and verdict["backend"] == "gloo" and verdict["links_scope"] == "all pairs"
    assert [(x["a"], x["b"], x["gbps"]) for x in verdict["links"]] == [
        ("h0", "h1", 2.1), ("h0", "h2", 0.5), ("h1", "h2", 3.2)]
    assert verdict["slowest_link"] == {"a": "h0", "b": "h2", "gbps": 0.5}
    links = {n["host"]: next(c for c in n["checks"] if c["name"] == "links") for n in verdict["nodes"]}
    assert links["h0"]["detail"] == "2 link(s), slowest h0 <-> h2 0.5 GB/s; the slowest link of 3"
    assert links["h1"]["detail"] == "2 link(s), slowest h0 <-> h1 2.1 GB/s"
    failed = judge(_answers(3, gbps={(0, 2): 0.5}), Limits(min_link_gbps=1.0))
    assert _failed(failed) == {("h0", "links"), ("h2", "links")}
    assert {f["message"] for f in failed["failures"]} == {"h0 <-> h2 0.5 GB/s, under the minimum 1 GB/s"}
    # node 1's link tests stopped (killed at the deadline): its links were not measured, named on both ends
    answers = _answers(3)
    answers[1].allreduce["result"].update(links=[], rounds_done=0,
                                          links_error="the link tests did not finish within 36 s (after 0 of 3 rounds)")
    for a in (answers[0], answers[2]):
        a.allreduce["result"]["links"] = [x for x in a.allreduce["result"]["links"] if x["peer"] != 1]
    stopped = judge(answers, Limits())
    assert _failed(stopped) == {("h0", "links"), ("h1", "links"), ("h2", "links")}
    h1 = next(f for f in stopped["failures"] if f["node"] == "h1")["message"]
    assert h1.startswith("h0 <-> h1 not measured: the link tests did not finish within 36 s")
    assert [x["gbps"] for x in stopped["links"]] == [None, 2.2, None]


def test_verdict_ops_difference_is_a_warning_naming_the_ops() -> None:
    lacking = {**OPS, "async_io": {"installed": False, "compatible": False}}
    verdict = judge(_answers(3, h1={"report": _report(ops=lacking)}), Limits())
    assert verdict["passed"] is True and verdict["failures"] == []
    assert [(w["node"], w["check"]) for w in verdict["warnings"]] == [("h1", "ops")]
    assert verdict["warnings"][0]["message"] == (
        "not compatible here but on 2 of 3 nodes: async_io (3 ops, 1 compatible, 1 installed prebuilt)")
    ops = next(c for c in verdict["nodes"][0]["checks"] if c["name"] == "ops")
    assert ops == {"name": "ops", "status": "passed", "detail": "3 ops, 2 compatible, 1 installed prebuilt; "
                                                               "not compatible: fused_adam (as on 2 of 3 nodes)"}
    no_ds = judge(_answers(2, h1={"report": _report(ops=None, deepspeed=None)}), Limits())
    assert next(c for c in no_ds["nodes"][1]["checks"] if c["name"] == "ops")["status"] == "skipped"


def test_verdict_nodes_that_did_not_answer_are_named() -> None:
    answers = _answers(3, h1={"down": "its agent could not be started: refused"},
                       h2={"report": None, "clock": None, "port": None})
    verdict = judge(answers, Limits(timeout_s=7, min_memory_bytes=16 << 30))
    assert _failed(verdict) == {("h1", "agent"), ("h2", "environment"), ("h2", "clock"),
                                ("h2", "master_port_reachable"), ("h0", "memory")}
    h1 = verdict["nodes"][1]["checks"]
    assert [c["name"] for c in h1] == list(DOCTOR_CHECKS) and all(c["status"] == "skipped" for c in h1[1:])
    h2 = {c["name"]: c["detail"] for c in verdict["nodes"][2]["checks"]}
    assert h2["environment"] == "no report within 7 s"
    assert h2["master_port_reachable"] == "no answer to the master port check within 7 s"


# --------------------------------------------------------------------------- link tests (agents.doctor, no agent)

@pytest.mark.integration
def test_link_tests_killed_at_the_deadline_keep_what_they_measured() -> None:
    """Three NodeDoctors (this machine's processes, loopback): round 1 tests 0 <-> 1; round 2 is a schedule no pair
    can finish (node 0 is paired with both 1 and 2; it takes the last pair, 1 waits for it for ever), so it ends at
    ``timeout_s`` or at gloo's timeout before it: the all-reduce and round 1's link come back, and the rest is named."""
    import os
    import socket
    import sys
    import threading

    from agents.doctor import NodeDoctor
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    answers: dict[int, dict] = {}

    def node(rank: int) -> None:
        answers[rank] = NodeDoctor(dict(os.environ)).run({
            "phase": "allreduce", "python": sys.executable, "addr": "127.0.0.1", "port": port, "rank": rank,
            "world": 3, "timeout_s": 25, "rounds": [[[0, 1]], [[0, 1], [0, 2]]], "pair_iters": 1})
    threads = [threading.Thread(target=node, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(answers[r]["status"] == "passed" for r in range(3)), answers
    for r in range(3):
        result = answers[r]["result"]
        assert result["correct"] is True and result["backend"] == "gloo" and result["rounds_done"] == 1, result
        # round 2 ends either at the deadline (the script killed) or, first, when gloo's own timeout (0.8 of it) makes
        # the stuck exchange of node 2 raise and its script exit, which closes its peers' links: both name round 2
        err = result["links_error"]
        assert err == "the link tests did not finish within 25 s (after 1 of 2 rounds)" or (
            err.startswith("the link tests stopped after 1 of 2 rounds: ") and "exited with status" in err), result
    assert [x["peer"] for x in answers[1]["result"]["links"]] == [0]
    assert answers[0]["result"]["links"][0]["peer"] == 1 and answers[0]["result"]["links"][0]["correct"] is True
    assert [x["peer"] for x in answers[2]["result"]["links"]] in ([], [0])  # round 2's 0 <-> 2 may have finished


# --------------------------------------------------------------------------- scripted agents (in this process)

class _ScriptedAgent:
    """An agent handle that answers the doctor's requests at once, in this process; its preflight check sends a
    heartbeat naming the check it runs (``entrypoint``) and never finishes."""

    def __init__(self, node_rank: int, sink) -> None:  # noqa: ANN001
        self.n, self.sink, self.closed = node_rank, sink, False
        self.pid = None
        sink.put((node_rank, {"type": "hello"}))

    def send(self, msg: dict) -> bool:
        n, phase = self.n, msg.get("phase")
        if msg.get("type") == "preflight":
            self.sink.put((n, {"type": "heartbeat", "preflight": "entrypoint"}))
        elif msg.get("type") == "doctor":
            answer = {"report": {"report": _report()}, "clock": {"at": time.time()}, "unlisten": {},
                      "listen": {"status": "passed", "detail": "ok"},
                      "allreduce": {"status": "passed", "result": {"busbw": 1e9, "bytes": 4 << 20, "seconds": 0.01,
                                                                   "iters": 5, "correct": True, "backend": "gloo",
                                                                   "links": [], "rounds": 0, "rounds_done": 0}}}
            self.sink.put((n, {"type": "doctor_result", "phase": phase, **answer[phase]}))
        return not self.closed

    def close(self) -> None:
        self.closed = True

    def wait(self, timeout: float) -> bool:
        return self.closed

    def kill(self) -> None:
        self.closed = True

    def diagnostics(self) -> str:
        return ""


def test_a_preflight_check_that_does_not_finish_is_named_from_the_node_s_heartbeats(tmp_path, monkeypatch) -> None:
    """A node whose preflight is still running at the deadline fails with the check its heartbeats named
    (``entrypoint``), not with 'no preflight answer'; the other phases, answered, pass."""
    from orchestrator.provisioners import LocalProvisioner
    from orchestrator.spec import spec_from_dict
    from orchestrator.supervision.doctor import DoctorRun
    from orchestrator.supervision.prepare import prepare_plan

    class Scripted(LocalProvisioner):
        def start_agent(self, node, plan, events):  # noqa: ANN001, ANN202
            return _ScriptedAgent(node.node_rank, events)

        def sweep(self, plan, spare=()):  # noqa: ANN001, ANN202
            return []
    monkeypatch.setenv("ORCH_PORT_LOCK_DIR", str(tmp_path / "ports"))
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts").write_text("node-0 slots=1\n")
    spec = spec_from_dict({"name": "stalls", "entrypoint": "train.py", "workdir": str(tmp_path),
                           "hostfile": str(tmp_path / "hosts")}, source="test")
    plan, lease = prepare_plan(spec, tmp_path / "state", "doctor-stalls", provisioner=Scripted())
    try:
        verdict = DoctorRun(spec, plan, Scripted(), timeout_s=1.0).run()
    finally:
        lease.release()
    (failure,) = [f for f in verdict["failures"] if f["check"] == "entrypoint"]
    assert failure["node"] == "node-0" and "the entrypoint check did not finish within 1 s" in str(failure), failure
    assert not any(f["check"] == "preflight" for f in verdict["failures"]), verdict["failures"]


# --------------------------------------------------------------------------- local agents

@pytest.mark.integration
def test_local_two_nodes_pass_with_json(orch, hostfile) -> None:
    r = orch("doctor", str(hostfile(TWO_NODES)), "--output", "json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"nodes", "checks", "failures", "warnings", "backend", "links", "links_scope", "slowest_link",
                        "passed"}
    assert out["passed"] is True and out["failures"] == [] and out["warnings"] == []
    assert out["backend"] == "gloo" and out["links_scope"] == "all pairs"
    (link,) = out["links"]
    assert (link["a"], link["b"], link["correct"]) == ("node-0", "node-1", True) and link["gbps"] > 0
    assert out["slowest_link"] == {"a": "node-0", "b": "node-1", "gbps": link["gbps"]}
    assert [n["host"] for n in out["nodes"]] == ["node-0", "node-1"]
    assert out["checks"] == list(DOCTOR_CHECKS)
    for node in out["nodes"]:
        by_name = {c["name"]: c for c in node["checks"]}
        assert by_name["entrypoint"] == {"name": "entrypoint", "status": "skipped",
                                         "detail": "a hostfile alone names no entrypoint"}
        for name in ("agent", "python", "workdir", "checkpoint_dir", "network", "environment", "versions", "gpus",
                     "disk", "memory", "clock", "master_port_reachable", "shared_checkpoint_dir", "allreduce", "links",
                     "ops"):
            assert by_name[name]["status"] == "passed", (node["host"], by_name[name])
        assert by_name["links"]["detail"].startswith("1 link(s), slowest node-0 <-> node-1 ")
        assert by_name["ops"]["detail"].endswith("(the same on all 2 nodes)")
        report = node["report"]
        import deepspeed
        import torch
        assert (report["torch"], report["deepspeed"], report["accelerator"]) == \
            (torch.__version__, deepspeed.__version__, "cpu")
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        assert set(report["ops"]) == set(ALL_OPS) and report["ops"]["cpu_adam"]["compatible"] is True
    port = [next(c for c in n["checks"] if c["name"] == "master_port_reachable")["detail"] for n in out["nodes"]]
    assert port[0].startswith("listening on the master port ") and port[1].startswith("reached the master port ")
    allreduce = [next(c for c in n["checks"] if c["name"] == "allreduce")["detail"] for n in out["nodes"]]
    assert all(d.startswith("bus bandwidth ") and " MB/s (4 MiB, " in d for d in allreduce), allreduce
    assert sum(d.endswith("; the slowest of 2 nodes") for d in allreduce) == 1
    assert not list((orch.state_dir / "jobs").iterdir())  # nothing of the doctor's run is kept
    assert_no_leftovers(timeout=5)


@pytest.mark.integration
def test_local_table_and_skewed_clocks(orch, hostfile, write_spec) -> None:
    spec = write_spec(hostfile=str(hostfile(TWO_NODES)), entrypoint=str(SCRIPTS / "worker.py"),
                      env={"ORCH_DOCTOR_CLOCK_OFFSET_S": "-10"})  # the seam, through the spec's env to every node
    r = orch("doctor", str(spec), "--max-skew", "3", "--min-bandwidth", "1e6", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "orch doctor: 2 node(s) through the local provisioner" in r.stdout
    for host, rank in (("node-0", 0), ("node-1", 1)):
        assert f"FAILED {host} (node {rank}) clock: " in r.stdout
        # no link carries 10^6 GB/s: the one link fails on both its nodes, naming both
        assert f"FAILED {host} (node {rank}) links: node-0 <-> node-1 " in r.stdout
    assert r.stdout.count(" GB/s, under the minimum 1e+06 GB/s") == 2
    assert "behind the controller's clock" in r.stdout and ": more than 3 s" in r.stdout
    assert "all-reduce and link tests: gloo" in r.stdout
    assert "links (all pairs): node-0 <-> node-1 " in r.stdout and "slowest link: node-0 <-> node-1 (" in r.stdout
    assert "4 check(s) failed" in r.stdout


@pytest.mark.integration
def test_bad_input_exits_2_with_a_clear_message(orch, hostfile, tmp_path) -> None:
    missing = tmp_path / "no-such-hostfile"
    r = orch("doctor", str(missing), timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: orch doctor: {missing}: no such file (give a job spec or a hostfile)"
    bad = hostfile("node-0 slotz=1\n")
    r = orch("doctor", str(bad), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"Line 1 of hostfile {bad} is 'node-0 slotz=1'" in r.stderr
    r = orch("doctor", str(hostfile(TWO_NODES)), "--include", "node-9", "-o", "json", timeout=60)
    assert r.returncode == 2 and "node-9" in json.loads(r.stdout)["error"]


# --------------------------------------------------------------------------- ssh hosts

def _set_host_env(net: Any, i: int, env: dict[str, str]) -> None:
    """Host i's sshd sets ``env`` in every session (``SetEnv``; empty: none), restarted to take it."""
    h = net.host(i)
    lines = [ln for ln in h.sshd_config.read_text().splitlines() if not ln.startswith("SetEnv ")]
    if env:
        lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()))
    h.sshd_config.write_text("\n".join(lines) + "\n")
    h.sshd.terminate()
    h.sshd.wait(10)
    net.start_sshd(i)


def _ssh_spec(write_spec, hostfile, net: Any, tmp_path: Path, port: int) -> Path:
    p = net.client_params()
    return write_spec(
        # nossh: the ranks keep their node's PYTHONPATH (pdsh would export the controller's to every node)
        name="doc", hostfile=str(hostfile("".join(f"{n} slots=1\n" for n in net.names))), provisioner="ssh",
        launcher="nossh",
        entrypoint=str(SCRIPTS / "worker.py"), master_port=port, checkpoint_dir=str(tmp_path / "ckpt"),
        deepspeed_config={"train_micro_batch_size_per_gpu": 1}, env={"DS_ACCELERATOR": "cpu"},
        env_passthrough=["TORCH_EXTENSIONS_DIR"],
        ssh={"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]})


def _checks(out: dict) -> dict[tuple[str, str], dict]:
    return {(n["host"], c["name"]): c for n in out["nodes"] for c in n["checks"]}


@pytest.mark.integration
def test_ssh_three_hosts_pass_then_each_fault_is_named(orch, net3, write_spec, hostfile, tmp_path) -> None:
    port = 29611
    spec = _ssh_spec(write_spec, hostfile, net3, tmp_path, port)
    r = orch("doctor", str(spec), "-o", "json", "--timeout", "40", timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["passed"] is True, out["failures"]
    assert _checks(out)[(net3.names[0], "deepspeed")]["status"] == "passed"
    assert sum(_checks(out)[(h, "allreduce")]["detail"].endswith("; the slowest of 3 nodes") for h in net3.names) == 1
    # every pair of the 3 hosts tested (3 rounds of one pair), the slowest link named, and the op check on each
    assert out["backend"] == "gloo" and out["links_scope"] == "all pairs"
    assert {(x["a"], x["b"]) for x in out["links"]} == {(a, b) for i, a in enumerate(net3.names)
                                                          for b in net3.names[i + 1:]}
    assert all(x["gbps"] > 0 and x["correct"] for x in out["links"]), out["links"]
    low = out["slowest_link"]
    assert low["gbps"] == min(x["gbps"] for x in out["links"])
    assert sum(_checks(out)[(h, "links")]["detail"].endswith("; the slowest link of 3") for h in net3.names) >= 1
    assert all(_checks(out)[(h, "links")]["detail"].startswith("2 link(s), slowest ") for h in net3.names)
    assert all(_checks(out)[(h, "ops")]["status"] == "passed" for h in net3.names)

    site = tmp_path / "no-deepspeed"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_DEEPSPEED)
    h0, h1, h2 = net3.names
    try:
        _set_host_env(net3, 0, {"PYTHONPATH": str(site)})
        _set_host_env(net3, 1, {"ORCH_DOCTOR_CLOCK_OFFSET_S": "30"})
        subprocess.run(["ip", "-n", net3.host(2).ns, "rule", "add", "ipproto", "tcp", "dport", str(port),
                        "prohibit"], check=True)
        r = orch("doctor", str(spec), "-o", "json", "--timeout", "40", timeout=120)
    finally:
        subprocess.run(["ip", "-n", net3.host(2).ns, "rule", "del", "ipproto", "tcp", "dport", str(port),
                        "prohibit"], check=False)
        _set_host_env(net3, 0, {})
        _set_host_env(net3, 1, {})
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["passed"] is False
    assert {(f["node"], f["check"]) for f in out["failures"]} == {
        (h0, "deepspeed"), (h0, "environment"), (h0, "versions"), (h1, "clock"), (h2, "master_port_reachable")}
    checks = _checks(out)
    assert "does not find deepspeed" in checks[(h0, "deepspeed")]["detail"]
    assert "cannot import deepspeed: ModuleNotFoundError: No module named 'deepspeed'" in \
        checks[(h0, "environment")]["detail"]
    assert checks[(h0, "versions")]["detail"].startswith("deepspeed none where 2 of 3 nodes have deepspeed ")
    assert "ahead of the controller's clock" in checks[(h1, "clock")]["detail"]
    assert checks[(h2, "master_port_reachable")]["detail"].startswith(
        f"cannot reach the master port {net3.addresses[0]}:{port}: ")
    assert checks[(h0, "master_port_reachable")]["status"] == "passed"  # node 0 listened, lacking DeepSpeed or not
    assert checks[(h1, "master_port_reachable")]["status"] == "passed"
    assert checks[(h0, "allreduce")] == {"name": "allreduce", "status": "skipped",
                                         "detail": f"not every node reached the master port ({h2})"}
    assert checks[(h0, "links")]["detail"] == f"not every node reached the master port ({h2})"
    assert out["links"][0]["gbps"] is None and out["slowest_link"] is None and out["backend"] is None
    # the host lacking DeepSpeed reports no ops; the two others do
    assert checks[(h0, "ops")]["status"] == "skipped" and checks[(h1, "ops")]["status"] == "passed"
    assert_no_leftovers(timeout=10)


@pytest.mark.integration
def test_ssh_host_that_cannot_be_reached_is_named_within_the_timeout(orch, net3, write_spec, hostfile,
                                                                     tmp_path) -> None:
    spec = _ssh_spec(write_spec, hostfile, net3, tmp_path, 29612)
    h2 = net3.names[2]
    net3.cut_link(2)
    try:
        r = orch("doctor", str(spec), "-o", "json", "--timeout", "20", timeout=120)
    finally:
        net3.reset()
    out = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert {(f["node"], f["check"]) for f in out["failures"]} == {(h2, "agent")}, [f["text"] for f in out["failures"]]
    agent = _checks(out)[(h2, "agent")]["detail"]
    assert agent.startswith("its agent could not be started: ") and h2 in agent, agent
    assert _checks(out)[(net3.names[0], "allreduce")]["detail"] == f"not every node reached the master port ({h2})"
    assert_no_leftovers(timeout=10)
