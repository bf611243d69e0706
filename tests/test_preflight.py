"""Preflight: every node checks the spec's Python, DeepSpeed, the workdir and entrypoint, the
checkpoint directory, the master port and shared storage before the first rank starts; a failing
check fails the attempt (``preflight_failed``) naming each node and check, and nothing starts.

Local agents (every "node" on this machine) for each failing check; real sshd hosts
(tests/nethosts.py) for the shared-storage check, where one host sees its own private copy of
the checkpoint directory's parent (a tmpfs in its sshd's own mount namespace). Ranks are
tests/scripts/worker.py (no DeepSpeed is imported: a spec with a ``deepspeed_config`` still gets
the DeepSpeed check). Preflight timings are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import helpers_train
from conftest import SCRIPTS, assert_no_leftovers, job_processes, start_test_network, wait_for
from orchestrator.supervision import Controller, prepare_plan
from orchestrator.errors import SpecError
from orchestrator.supervision.preflight import PreflightRound, skipped_checks
from orchestrator.provisioners import LocalProvisioner
from orchestrator.spec import spec_from_dict
from orchestrator.store import Store

WORKER = str(SCRIPTS / "worker.py")
TWO_NODES = "node-0 slots=1\nnode-1 slots=1\n"
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1}


# --------------------------------------------------------------------------- helpers

def _fields(hostfile: Path, tmp_path: Path, **over: Any) -> dict:
    fields = {"name": "pf", "hostfile": str(hostfile), "entrypoint": WORKER, "stop_grace_seconds": 2,
              "checkpoint_dir": str(tmp_path / "ckpt"), "env": {"WORKER_STEPS": "2", "WORKER_STEP_S": "0.05"}}
    fields.update(over)
    return fields


def _events(store: Store, job_id: str, kind: str) -> list[dict]:
    return [e.data for e in store.events(job_id) if e.kind == kind]


def _assert_nothing_started(store: Store, detail: dict) -> None:
    """No rank started anywhere: no rank event, no rank log, every rank 'not started', nothing left."""
    job_id = detail["id"]
    assert [e.kind for e in store.events(job_id) if e.kind in ("ranks_started", "rank_exit")] == []
    logs = Path(detail["run_dir"]) / "logs"
    assert sorted(p.name for p in logs.glob("rank-*.log")) == []
    assert all(r["state"] == "not started" and r["pid"] is None for r in detail["ranks"]), detail["ranks"]
    assert detail["attempts"][-1]["stopped_at"] is not None
    assert_no_leftovers(job_id, timeout=5)


def _assert_preflight_failed(store: Store, detail: dict, failing: dict[str, dict[str, list[str]]],
                             hosts: list[str]) -> dict:
    """The job FAILED with preflight_failed naming exactly ``failing`` (host -> check -> words of what
    was found), the preflight event agrees, nothing started; returns the cause."""
    cause = detail["cause"]
    assert detail["state"] == "FAILED" and cause["kind"] == "preflight_failed", cause
    assert cause["nodes"] == list(failing), cause
    assert cause["node"] == next(iter(failing))
    named = {(f["node"], f["check"]) for f in cause["failures"]}
    assert named == {(h, c) for h, checks in failing.items() for c in checks}, cause["failures"]
    for f in cause["failures"]:
        for needle in failing[f["node"]][f["check"]]:
            assert needle in f["message"], (needle, f)
        assert f["text"] == f"{f['node']} (node {f['node_rank']}): {f['message']}"
        # for people: nodes with the same finding share a line that names each of them
        (line,) = [ln for ln in cause["lines"] if ln.endswith(f": {f['message']}")]
        assert f"{f['node']}" in line.split(": ")[0] and line in cause["message"]
    assert cause["message"].startswith(f"preflight failed on {len(failing)} of {len(hosts)} node(s), so no "
                                       "rank was started: ")
    (event,) = _events(store, detail["id"], "preflight")
    assert event["passed"] is False
    statuses = {(n["host"], c["name"]): c["status"] for n in event["nodes"] for c in n["checks"]}
    for host, checks in failing.items():
        for check in checks:
            assert statuses[(host, check)] == "failed", (host, check, event)
    assert not [k for k, v in statuses.items() if v == "failed" and k[1] not in failing.get(k[0], {})], event
    _assert_nothing_started(store, detail)
    return cause


def _run_failing(orch, spec: Path, failing: dict[str, dict[str, list[str]]], hosts: list[str],
                 env: dict | None = None, argv_prefix: list[str] | None = None) -> dict:
    """``orch run`` (exit 1) that fails its preflight as ``failing`` says; checks what it printed
    and what ``orch status`` shows. Returns the cause."""
    if argv_prefix:
        r = subprocess.run([*argv_prefix, *orch.cmd("run", str(spec))], capture_output=True, text=True,
                           timeout=120, env=orch.env(env))
    else:
        r = orch("run", str(spec), timeout=120, env=env)
    out = f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.returncode == 1, out
    assert "Traceback" not in r.stdout + r.stderr, out
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    cause = _assert_preflight_failed(Store(orch.state_dir / "orch.db"), detail, failing, hosts)
    # orch run: the summary, then one line per finding (rich wraps long lines: compare words)
    lines = r.stdout.splitlines()
    at = lines.index(f"cause: {cause['summary']}:")
    assert all(line.startswith("  ") for line in lines[at + 1:at + 1 + len(cause["lines"])]), out
    words = " ".join(r.stdout.split())
    assert " ".join(f"cause: {cause['summary']}: {' '.join(cause['lines'])}".split()) in words, out
    status = " ".join(orch("status", job["id"]).stdout.split())
    assert " ".join(" ".join(cause["lines"]).split()) in status, status
    assert {n["host"]: n["state"] for n in detail["node_states"]} == \
        {h: "preflight_failed" if h in failing else "ended" for h in hosts}
    # what to do next: a spec check failing on every node is the spec's (a resume runs the stored spec,
    # so it gets no resume hint); anything else is fixed on the nodes, then resumed
    spec_checks = {"python", "workdir", "entrypoint", "network"}
    in_spec = {c for checks in failing.values() for c in checks if c in spec_checks
               and all(c in failing.get(h, {}) for h in hosts)}
    if in_spec:
        assert f"next: fix the spec ({', '.join(sorted(in_spec))} failed on every node) and run it again as a new " \
               "job: orch run SPEC; a resume would run the job's stored spec and fail the same way" in words, out
    else:
        assert f"then: orch resume {job['id']}" in words, out
    if in_spec and all(set(checks) <= in_spec for checks in failing.values()):
        assert "orch resume" not in words, out
    return cause


def _controller_run(state_dir: Path, fields: dict, timeout: float = 120, **kw: Any) -> tuple[Store, dict]:
    """Run a spec (files not checked on this machine, as on another node) with an in-process
    controller; returns the store and the job's detail once every process is gone."""
    from orchestrator.observe import job_detail
    c = Controller(state_dir, **kw)
    try:
        job = c.submit(spec_from_dict(fields, check_files=False))
        c.wait(job.id, timeout=timeout)
        assert not c.busy(job.id), "the job did not end"
    finally:
        c.close()
    store = Store(state_dir / "orch.db")
    return store, job_detail(store, job.id)


# --------------------------------------------------------------------------- the verdict (pure)

def _plan(tmp_path: Path, hosts: int, **over: Any) -> Any:
    hf = tmp_path / "hosts"
    hf.write_text("".join(f"node-{i} slots=1\n" for i in range(hosts)))
    spec = spec_from_dict(_fields(hf, tmp_path, **over), tmp_path)
    plan, _ = prepare_plan(spec, tmp_path / "state", "pf-000001", hold_port=False)
    return spec, plan


def _round(spec: Any, plan: Any) -> PreflightRound:
    clock = iter(range(1000))
    return PreflightRound(spec, plan, sys.executable, timeout_s=60, heartbeat_s=0.5, lease_s=15, nonce="n",
                          clock=lambda: float(next(clock)))


def _answer_checks(pf: PreflightRound, nodes: range) -> None:
    ok = [{"name": "checkpoint_dir", "status": "passed", "detail": "writable", "seconds": 0.01}]
    for n in nodes:
        pf.record(n, {"phase": "check", "checks": ok, "token": True, "seconds": 0.1})


def test_shared_storage_groups_name_the_odd_nodes(tmp_path) -> None:
    spec, plan = _plan(tmp_path, 4)
    pf = _round(spec, plan)
    assert set(pf.requests()) == {0, 1, 2, 3}
    assert pf.requests()[0]["master_port"] == {"addr": plan.master_addr, "port": plan.master_port}
    assert pf.requests()[1]["master_port"] is None
    _answer_checks(pf, range(4))
    assert pf.phase_complete()
    lists = pf.list_requests()
    assert sorted(lists) == [0, 1, 2, 3] and lists[0]["expect"] == [0, 1, 2, 3]
    for n, seen in {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2], 3: [3]}.items():
        pf.record(n, {"phase": "list", "seen": seen, "seconds": 0.01})
    event, cause = pf.verdict()
    assert event["passed"] is False and event["shared"]["groups"] == [
        {"nodes": [0, 1, 2], "sees": [0, 1, 2]}, {"nodes": [3], "sees": [3]}]
    assert cause["kind"] == "preflight_failed" and cause["nodes"] == ["node-3"] and cause["node_rank"] == 3
    (failure,) = cause["failures"]
    assert failure["check"] == "shared_checkpoint_dir" and failure["nodes"] == ["node-3"]
    assert failure["message"] == (
        f"checkpoint dir {plan.checkpoint_dir} is not the same directory on every node (it must be shared storage, "
        "as orch resumes from what any node saved): node-3 (node 3) sees only its own preflight file; "
        "node-0, node-1, node-2 (nodes 0, 1, 2) see only each other's preflight files")
    per_node = {n["host"]: [c for c in n["checks"] if c["name"] == "shared_checkpoint_dir"][0] for n in event["nodes"]}
    assert per_node["node-3"]["status"] == "failed" and "node(s) 0, 1, 2" in per_node["node-3"]["detail"]


def test_node_local_storage_everywhere_is_one_sentence(tmp_path) -> None:
    spec, plan = _plan(tmp_path, 3)
    pf = _round(spec, plan)
    _answer_checks(pf, range(3))
    pf.list_requests()
    for n in range(3):
        pf.record(n, {"phase": "list", "seen": [n], "seconds": 0.01})
    _event, cause = pf.verdict()
    assert cause["nodes"] == ["node-0", "node-1", "node-2"]
    assert cause["failures"][0]["message"].endswith(
        "each of the 3 nodes sees only its own preflight file, so the checkpoint dir is on node-local storage")


def test_every_node_sees_every_token_passes(tmp_path) -> None:
    spec, plan = _plan(tmp_path, 3)
    pf = _round(spec, plan)
    _answer_checks(pf, range(3))
    pf.list_requests()
    for n in range(3):
        pf.record(n, {"phase": "list", "seen": [0, 1, 2], "seconds": 0.01})
    event, cause = pf.verdict()
    assert cause is None and event["passed"] is True
    assert all(c["status"] == "passed" for n in event["nodes"] for c in n["checks"])
    assert set(event["phases"]) == {"check", "list"}


def test_nodes_still_checking_at_the_timeout_are_named_with_their_check(tmp_path) -> None:
    spec, plan = _plan(tmp_path, 2)
    now = [0.0]
    pf = PreflightRound(spec, plan, sys.executable, timeout_s=5, heartbeat_s=0.5, lease_s=15,
                        clock=lambda: now[0])
    _answer_checks(pf, range(1))
    pf.current[1] = "checkpoint_dir"  # from node 1's heartbeats
    now[0] = 4.9
    assert not pf.overdue()
    now[0] = 5.1
    assert pf.overdue()
    _event, cause = pf.verdict()
    assert [(f["node"], f["check"], f["message"]) for f in cause["failures"]] == [
        ("node-1", "checkpoint_dir", "the checkpoint_dir check did not finish within 5 s")]


def test_which_checks_apply(tmp_path) -> None:
    spec, plan = _plan(tmp_path, 2)
    features = {"zero_pp": "the DeepSpeed config turns on no ZeRO++ quantisation (zero_quantized_*) at stage 3",
                "nvme": "the DeepSpeed config offloads nothing to NVMe (offload_* device nvme at stage 3)"}
    assert skipped_checks(spec, plan) == {
        "deepspeed": "the spec has no deepspeed_config, so the job is not known to use DeepSpeed",
        "build_locks": "the job is not known to build DeepSpeed's ops",
        "ops": "the job is not known to build DeepSpeed's ops", **features}
    spec, plan = _plan(tmp_path, 2, deepspeed_config=DS_CONFIG)
    assert skipped_checks(spec, plan) == features  # tests/test_preflight_features.py: when they apply
    spec, plan = _plan(tmp_path, 1, deepspeed_config=DS_CONFIG)
    assert skipped_checks(spec, plan) == {"shared_checkpoint_dir": "one node: nothing to share with", **features}
    spec, plan = _plan(tmp_path, 2, no_python=True, entrypoint="true", deepspeed_config=DS_CONFIG,
                       preflight={"shared_checkpoint_dir": False})
    assert set(skipped_checks(spec, plan)) == {"python", "deepspeed", "build_locks", "ops", "shared_checkpoint_dir",
                                               "zero_pp", "nvme"}


def test_preflight_spec_options(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.write_text(TWO_NODES)
    assert spec_from_dict(_fields(hf, tmp_path), tmp_path).preflight.enabled is True
    assert spec_from_dict(_fields(hf, tmp_path, preflight=False), tmp_path).preflight.enabled is False
    spec = spec_from_dict(_fields(hf, tmp_path, restart={"retry_on": ["preflight_failed"]}), tmp_path)
    assert spec.restart.retries({"kind": "preflight_failed"})
    assert not spec_from_dict(_fields(hf, tmp_path), tmp_path).restart.retries({"kind": "preflight_failed"})
    with pytest.raises(SpecError, match=r"preflight\.shared_storage: unknown field"):
        spec_from_dict(_fields(hf, tmp_path, preflight={"shared_storage": False}), tmp_path)


# --------------------------------------------------------------------------- local agents: each check

@pytest.mark.integration
@pytest.mark.deepspeed
def test_passing_preflight_records_every_check_and_starts_the_ranks(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()  # the tests' extensions dir holds the comm op: the ops check finds it
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=DS_CONFIG))
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight passed on 2 node(s) in " in r.stdout
    (job,) = orch.json("list")
    store = Store(orch.state_dir / "orch.db")
    (event,) = _events(store, job["id"], "preflight")
    assert event["passed"] is True
    got = {(n["host"], c["name"]): c["status"] for n in event["nodes"] for c in n["checks"]}
    assert got == {(h, c): "passed" for h in ("node-0", "node-1") for c in
                   ("python", "deepspeed", "workdir", "entrypoint", "checkpoint_dir", "network", "build_locks",
                    "ops", "shared_checkpoint_dir")} | {("node-0", "master_port"): "passed", ("node-1", "master_port"): "skipped"} \
        | {(h, c): "skipped" for h in ("node-0", "node-1") for c in ("zero_pp", "nvme")}
    details = {(n["host"], c["name"]): c["detail"] for n in event["nodes"] for c in n["checks"]}
    assert f"(Python {sys.version_info.major}.{sys.version_info.minor}." in details[("node-0", "python")]
    assert details[("node-1", "deepspeed")].startswith("deepspeed ")
    # the op every DeepSpeed rank loads, built once for the tests' extensions dir: found there, nothing started
    assert details[("node-0", "ops")] == f"deepspeed_shm_comm loaded from cache (in {os.environ['TORCH_EXTENSIONS_DIR']})"
    assert event["ops"] == [{"name": "deepspeed_shm_comm", "built": 0, "cached": 2, "not_needed": 0, "failed": 0,
                             "seconds": 0.0}]
    # local agents rendezvous on this machine's loopback: that is the interface, and it is said
    assert details[("node-0", "network")] == ("lo (127.0.0.1) routes to the master 127.0.0.1: GLOO_SOCKET_IFNAME and "
                                              "NCCL_SOCKET_IFNAME set to lo")
    # the preflight came before any rank, and the ranks then ran
    kinds = [e.kind for e in store.events(job["id"])]
    assert kinds.index("preflight") < kinds.index("ranks_started")
    assert sorted(os.listdir(tmp_path / "ckpt")) == []  # the tokens are gone
    print(f"\nlocal 2 nodes: preflight {event['seconds'] * 1000:.0f} ms (phases "
          f"{ {k: round(v * 1000) for k, v in event['phases'].items()} } ms)")
    assert_no_leftovers(job["id"], timeout=1)


@pytest.mark.integration
def test_preflight_false_skips_it(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, preflight=False, python="/nonexistent/python3",
                                entrypoint=WORKER))
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 1  # the ranks themselves cannot start: spawn_failed, as before preflight existed
    (job,) = orch.json("list")
    assert orch.json("status", job["id"])["cause"]["kind"] == "spawn_failed"
    assert _events(Store(orch.state_dir / "orch.db"), job["id"], "preflight") == []
    assert_no_leftovers(job["id"], timeout=5)


@pytest.mark.integration
def test_python_missing_is_named_on_every_node(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python="/nonexistent/python3",
                                deepspeed_config=DS_CONFIG))
    why = ["python /nonexistent/python3 cannot be run: No such file or directory"]
    cause = _run_failing(orch, spec, {h: {"python": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])
    assert cause["failures"][0]["text"] == \
        "node-0 (node 0): python /nonexistent/python3 cannot be run: No such file or directory"
    assert cause["lines"] == [
        "node-0, node-1 (nodes 0, 1): python /nonexistent/python3 cannot be run: No such file or directory"]


@pytest.mark.integration
def test_deepspeed_missing_for_the_spec_python(orch, write_spec, hostfile, tmp_path) -> None:
    # the system's Python runs, but has no deepspeed
    python = "/usr/bin/python3"
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'deepspeed'" in probe.stderr  # the premise
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python=python, deepspeed_config=DS_CONFIG))
    why = [f"{python} does not find deepspeed: No module named 'deepspeed'"]
    _run_failing(orch, spec, {h: {"deepspeed": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_a_stale_build_lock_is_named_and_a_fresh_one_is_not(orch, write_spec, hostfile, tmp_path) -> None:
    """A lock a killed DeepSpeed op build left (older than 2 minutes, no build running in its directory) in
    the ranks' TORCH_EXTENSIONS_DIR fails the preflight by its path; a lock of a build starting now does not."""
    ext = tmp_path / "ext"
    lock = ext / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    os.utime(lock, (time.time() - 600, time.time() - 600))
    fields = _fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=DS_CONFIG)
    fields["env"]["TORCH_EXTENSIONS_DIR"] = str(ext)
    why = [f"stale torch extension build lock(s): {lock} (10 min old)", "delete them"]
    _run_failing(orch, write_spec(**fields), {h: {"build_locks": why} for h in ("node-0", "node-1")},
                 ["node-0", "node-1"])
    os.utime(lock, None)  # as young as a build that has just begun
    built = ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"  # the ops check finds its op built (worker.py
    built.parent.mkdir()                                          # ranks load none): no build in this test
    built.write_bytes(b"")
    r = orch("run", str(write_spec(**fields)), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.integration
def test_deepspeed_that_does_not_import_with_import_deepspeed(orch, write_spec, hostfile, tmp_path) -> None:
    # a deepspeed package that is found (first on PYTHONPATH) but fails on import
    broken = tmp_path / "broken" / "deepspeed"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('deepspeed broken on purpose')\n")
    fields = _fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=DS_CONFIG,
                     preflight={"import_deepspeed": True})
    fields["env"]["PYTHONPATH"] = str(broken.parent)
    spec = write_spec(**fields)
    why = ["cannot import deepspeed: ImportError: deepspeed broken on purpose"]
    _run_failing(orch, spec, {h: {"deepspeed": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_deepspeed_check_skipped_for_a_job_without_deepspeed_config(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python="/usr/bin/python3"))
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr  # worker.py needs no deepspeed
    (job,) = orch.json("list")
    (event,) = _events(Store(orch.state_dir / "orch.db"), job["id"], "preflight")
    (ds,) = [c for c in event["nodes"][0]["checks"] if c["name"] == "deepspeed"]
    assert ds["status"] == "skipped" and "no deepspeed_config" in ds["detail"]


@pytest.mark.integration
def test_workdir_missing(state_dir, hostfile, tmp_path) -> None:
    gone = tmp_path / "gone"
    fields = _fields(hostfile(TWO_NODES), tmp_path, workdir=str(gone))
    store, detail = _controller_run(state_dir, fields)
    _assert_preflight_failed(store, detail, {h: {"workdir": [f"workdir {gone} does not exist"]}
                                             for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_script_missing(state_dir, hostfile, tmp_path) -> None:
    fields = _fields(hostfile(TWO_NODES), tmp_path, entrypoint=str(tmp_path / "moved.py"))
    store, detail = _controller_run(state_dir, fields)
    _assert_preflight_failed(store, detail, {h: {"entrypoint": [f"script {tmp_path / 'moved.py'} does not exist"]}
                                             for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_module_not_found(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, module=True, entrypoint="no_such_module_xyz",
                                workdir=str(tmp_path)))
    why = ["module no_such_module_xyz is not found by", f"from workdir {tmp_path}",
           "No module named 'no_such_module_xyz'"]
    _run_failing(orch, spec, {h: {"entrypoint": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_no_python_executable_missing(state_dir, hostfile, tmp_path) -> None:
    fields = _fields(hostfile(TWO_NODES), tmp_path, no_python=True, entrypoint="no-such-tool-xyz",
                     deepspeed_config=DS_CONFIG)
    store, detail = _controller_run(state_dir, fields)
    why = ["executable 'no-such-tool-xyz' is not on the ranks' PATH"]
    _assert_preflight_failed(store, detail, {h: {"entrypoint": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])
    (event,) = _events(store, detail["id"], "preflight")
    skipped = {c["name"] for c in event["nodes"][0]["checks"] if c["status"] == "skipped"}
    assert {"python", "deepspeed"} <= skipped  # no_python: not the spec's Python's business


@pytest.mark.integration
def test_an_interface_the_nodes_lack_fails_the_network_check(orch, write_spec, hostfile, tmp_path) -> None:
    # the job names gloo's interface itself (it wins over orch's choice), but no node has it
    fields = _fields(hostfile(TWO_NODES), tmp_path)
    fields["env"]["GLOO_SOCKET_IFNAME"] = "orch-nonesuch0"
    spec = write_spec(**fields)
    why = ["GLOO_SOCKET_IFNAME=orch-nonesuch0 (the job's environment) names orch-nonesuch0, which this node has no "
           "interface of (its interfaces: ", "lo"]
    _run_failing(orch, spec, {h: {"network": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_checkpoint_dir_under_a_file(orch, write_spec, hostfile, tmp_path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, checkpoint_dir=str(afile / "ckpt")))
    why = [f"checkpoint dir {afile / 'ckpt'} cannot be created: Not a directory"]
    _run_failing(orch, spec, {h: {"checkpoint_dir": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"])


@pytest.mark.integration
def test_checkpoint_dir_read_only(orch, write_spec, hostfile, tmp_path) -> None:
    # a read-only tmpfs over the checkpoint dir, in a mount namespace of orch run's own (root ignores modes)
    ckpt = tmp_path / "ro-ckpt"
    ckpt.mkdir()
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, checkpoint_dir=str(ckpt)))
    mount = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o ro orch-test-ro {ckpt} && exec "$@"', "sh"]
    why = [f"checkpoint dir {ckpt} is not writable: Read-only file system"]
    _run_failing(orch, spec, {h: {"checkpoint_dir": why} for h in ("node-0", "node-1")}, ["node-0", "node-1"],
                 argv_prefix=mount)
    assert os.listdir(ckpt) == []  # the mount was orch run's only


class _ForeignListener(LocalProvisioner):
    """Local agents, but a foreign process takes the master port just after planning."""

    def __init__(self) -> None:
        super().__init__()
        self.sock: socket.socket | None = None

    def start_agent(self, node: Any, plan: Any, events: Any) -> Any:
        if node.node_rank == 0:
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do (TIME_WAIT is no bar)
            self.sock.bind(("127.0.0.1", plan.master_port))
            self.sock.listen()
        return super().start_agent(node, plan, events)


@pytest.mark.integration
def test_master_port_taken_after_planning(state_dir, hostfile, tmp_path) -> None:
    prov = _ForeignListener()
    try:
        fields = _fields(hostfile(TWO_NODES), tmp_path)
        store, detail = _controller_run(state_dir, fields, provisioner_factory=lambda name, spec: prov)
        port = detail["master_port"]
        why = [f"master port {port} (master 127.0.0.1) is in use by another process: Address already in use"]
        cause = _assert_preflight_failed(store, detail, {"node-0": {"master_port": why}}, ["node-0", "node-1"])
        assert cause["lines"] == [f"node-0 (node 0): {why[0]}"]
    finally:
        if prov.sock is not None:
            prov.sock.close()


def _hanging_python(tmp_path: Path) -> Path:
    """A 'python' that never answers."""
    path = tmp_path / "hanging-python"
    path.write_text("#!/bin/sh\nexec sleep 600\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.timing
@pytest.mark.integration
def test_a_check_that_hangs_fails_at_the_timeout_and_is_killed(orch, write_spec, hostfile, tmp_path) -> None:
    python = _hanging_python(tmp_path)
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python=str(python)))
    t0 = time.monotonic()
    cause = _run_failing(orch, spec, {h: {"python": ["did not", "within"]} for h in ("node-0", "node-1")},
                         ["node-0", "node-1"], env={"ORCH_PREFLIGHT_TIMEOUT_S": "4"})
    assert time.monotonic() - t0 < 30, "the preflight timeout did not end the attempt"
    assert str(python) in cause["failures"][0]["message"] or "python check" in cause["failures"][0]["message"]


def _job_id(orch) -> str:
    """The id of the one job in ``orch``'s store, once there is one."""
    store_path = orch.state_dir / "orch.db"
    return wait_for(lambda: store_path.exists() and [j.id for j in Store(store_path).list_jobs()], 60, "the job")[0]


def _job_checking(orch) -> str:
    """:func:`_job_id`, once both nodes run the (hanging) python check of ``_hanging_python``."""
    job_id = _job_id(orch)
    wait_for(lambda: len(job_processes(job_id, running="sleep")) == 2, 60,
             "both nodes' python checks to run")
    return job_id


@pytest.mark.timing
@pytest.mark.integration
def test_node_lost_during_preflight_is_detected_by_heartbeats(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python=str(_hanging_python(tmp_path))))
    proc = orch.popen("run", str(spec), env={"ORCH_PREFLIGHT_TIMEOUT_S": "120"})
    try:
        job_id = _job_id(orch)

        def agent_of_node_1_checking() -> Any:
            agents = [p for p in job_processes(job_id) if p.environ().get("ORCH_AGENT_NODE_RANK") == "1"]
            probes = job_processes(job_id, running="sleep")
            return agents[0] if agents and len(probes) == 2 else None
        agent = wait_for(agent_of_node_1_checking, 60, "both nodes' python checks to run")
        killed_at = time.monotonic()
        agent.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        detected = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out + err
    cause = orch.json("status", job_id)["cause"]
    assert cause["kind"] == "node_lost" and cause["node"] == "node-1", cause
    assert detected < 10, detected
    print(f"\nnode lost during preflight detected in {detected:.1f} s")
    assert_no_leftovers(job_id, timeout=10)  # the other node's check, and the lost one's, are gone


@pytest.mark.integration
def test_controller_killed_during_preflight_leaves_nothing(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python=str(_hanging_python(tmp_path))))
    proc = orch.popen("run", str(spec), env={"ORCH_PREFLIGHT_TIMEOUT_S": "120"})
    try:
        job_id = _job_checking(orch)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert_no_leftovers(job_id, timeout=10)  # agents read end-of-stream, call the checks off, remove tokens
    tokens = [p for p in (tmp_path / "ckpt").iterdir()] if (tmp_path / "ckpt").exists() else []
    assert tokens == []


@pytest.mark.timing
@pytest.mark.integration
def test_agents_give_up_a_silent_controller_during_preflight(orch, write_spec, hostfile, tmp_path) -> None:
    # the controller freezes (SIGSTOP) mid-preflight: no pings reach the agents, whose lease runs out
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, python=str(_hanging_python(tmp_path))))
    proc = orch.popen("run", str(spec), env={"ORCH_PREFLIGHT_TIMEOUT_S": "120", "ORCH_AGENT_LEASE_S": "2"})
    try:
        job_id = _job_checking(orch)
        proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: not job_processes(job_id), 15, "the agents and their checks to end on their own")
        gone = time.monotonic() - stopped_at
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
    # the lease (2 s) runs from the last ping, which left up to one heartbeat (0.5 s) before the SIGSTOP
    assert 2 - 0.5 <= gone < 10, gone
    assert proc.returncode == 1, out + err
    logs = Path(orch.json("status", job_id)["run_dir"]) / "agents"
    assert all("no word from the controller for 2 s before the start" in (logs / f"node-{n}.log").read_text()
               for n in (0, 1))
    assert os.listdir(tmp_path / "ckpt") == []  # each agent removed its token


# --------------------------------------------------------------------------- ssh hosts: shared storage

@pytest.fixture(scope="module")
def split_net(tmp_path_factory) -> Any:
    """3 namespace hosts; host 2 sees its own (empty) copy of ``split_net.private_parent``."""
    parent = tmp_path_factory.mktemp("private-parent")
    net = start_test_network(3, private_mounts={2: [str(parent)]})
    net.private_parent = parent
    try:
        yield net
    finally:
        net.close()


def _ssh_fields(net: Any, hostfile, tmp_path: Path, checkpoint_dir: Path, **over: Any) -> dict:
    p = net.client_params()
    hf = hostfile("".join(f"{n} slots=1\n" for n in net.names))
    fields = _fields(hf, tmp_path, provisioner="ssh", checkpoint_dir=str(checkpoint_dir),
                     deepspeed_config=DS_CONFIG,
                     ssh={"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]})
    fields["env"]["PATH"] = os.environ["PATH"]
    fields["env"]["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]  # the tests' own op cache
    fields.update(over)
    return fields


def _seen_by_host(net: Any, i: int, path: Path) -> list[str]:
    """``ls -A path`` as host i's sshd (and so its sessions) sees it."""
    r = subprocess.run(["nsenter", "-t", str(net.hosts[i].sshd.pid), "-m", "ls", "-A", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.integration
def test_ssh_host_with_its_own_checkpoint_dir_is_named(orch, write_spec, hostfile, split_net, tmp_path) -> None:
    net = split_net
    ckpt = net.private_parent / "ckpt"
    spec = write_spec(**_ssh_fields(net, hostfile, tmp_path, ckpt))
    r = orch("run", str(spec), timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    store = Store(orch.state_dir / "orch.db")
    cause = detail["cause"]
    assert cause["kind"] == "preflight_failed" and cause["nodes"] == [net.names[2]], cause
    (failure,) = cause["failures"]
    assert failure["check"] == "shared_checkpoint_dir" and failure["node"] == net.names[2]
    assert failure["message"] == (
        f"checkpoint dir {ckpt} is not the same directory on every node (it must be shared storage, as orch resumes "
        f"from what any node saved): {net.names[2]} (node 2) sees only its own preflight file; "
        f"{net.names[0]}, {net.names[1]} (nodes 0, 1) see only each other's preflight files")
    assert cause["lines"] == [failure["text"]] and failure["text"] in cause["message"]
    assert " ".join(f"cause: {cause['summary']}: {failure['text']}".split()) in " ".join(r.stdout.split())
    (event,) = _events(store, job["id"], "preflight")
    assert event["shared"]["groups"] == [{"nodes": [0, 1], "sees": [0, 1]}, {"nodes": [2], "sees": [2]}]
    assert {n["host"]: n["state"] for n in detail["node_states"]}[net.names[2]] == "preflight_failed"
    _assert_nothing_started(store, detail)
    # every node's token is gone, in the shared directory and in host 2's own copy
    assert os.listdir(ckpt) == [] and _seen_by_host(net, 2, ckpt) == []
    assert _seen_by_host(net, 0, ckpt) == []


@pytest.mark.integration
def test_ssh_shared_checkpoint_dir_passes(orch, write_spec, hostfile, split_net, tmp_path) -> None:
    net = split_net
    ckpt = tmp_path / "shared-ckpt"
    spec = write_spec(**_ssh_fields(net, hostfile, tmp_path, ckpt))
    r = orch("run", str(spec), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    store = Store(orch.state_dir / "orch.db")
    (event,) = _events(store, job["id"], "preflight")
    assert event["passed"] is True and event["shared"]["groups"] == [{"nodes": [0, 1, 2], "sees": [0, 1, 2]}]
    statuses = {(n["host"], c["name"]): c["status"] for n in event["nodes"] for c in n["checks"]}
    assert statuses[(net.names[1], "deepspeed")] == "passed" and statuses[(net.names[0], "master_port")] == "passed"
    assert os.listdir(ckpt) == []
    attempt = store.get_attempt(job["id"], 1)
    print(f"\nssh 3 hosts: preflight {event['seconds'] * 1000:.0f} ms (phases "
          f"{ {k: round(v * 1000) for k, v in event['phases'].items()} } ms); created -> running "
          f"{attempt.running_at - attempt.created_at:.2f} s")
    assert_no_leftovers(job["id"], timeout=5)
