"""The ray provisioner on a real multi-node Ray cluster (tests/raycluster.py): hostfile hosts to
Ray nodes, the pool of a job without a hostfile, ZeRO-2 training, bad input and a node lost while
provisioning. What every multi-host provisioner must do (node loss, a spare, cancel) is in
tests/test_provisioners.py, which runs on this cluster too.

One 4-node cluster (``ray4``: a head with no CPUs on the bridge address, one worker node with 2
CPUs per namespace host) serves the session; a test that kills a node or cuts a link calls
``ray4.reset()``. Ray's own health checks keep their defaults (a dead node is noticed after
~15 s, a cut one later). Hosts share the file system and the process table with this process, so
``assert_no_leftovers`` sees every host's processes and a process belongs to host i when
``/proc/<pid>/ns/net`` is host i's namespace. What is left on the cluster itself (named actors
of the job, placement groups, reserved CPUs) is read by a driver (tests/helpers_jobs.py).

Ranks are examples/train_gpt.py (tiny model, ZeRO-2) where training matters, else a small
script (``WHERE``) that reports where it runs: its network namespace, the address it reaches
the head from, its agent's namespace and the agent's parent (the actor's worker).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, assert_no_leftovers, wait_for

from orchestrator.checkpoints import inspect_tag

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_jobs as hj
import helpers_train

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
# Neither GLOO_SOCKET_IFNAME (each agent names the interface that routes to the master) nor PATH
# (orch puts the virtualenv's bin, with the `ninja` prebuild_ops used, first on every rank's PATH).
BASE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
GRACE = 5
CPUS = 2  # per worker node (the ray4 fixture's default)

# A rank that reports where it runs (one JSON file per rank) and exits 0.
WHERE = textwrap.dedent("""
    import json, os, socket, sys
    env = dict(os.environ)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((env["WHERE_PEER"], 9))          # no packet is sent: only the route is looked up
    agent = os.getppid()
    def ns(pid):
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    with open(f"/proc/{agent}/stat") as f:
        worker = int(f.read().rpartition(")")[2].split()[1])
    with open(f"/proc/{worker}/cmdline", "rb") as f:
        worker_cmd = f.read().replace(b"\\0", b" ").decode().strip()
    report = {"pid": os.getpid(), "netns": ns("self"), "ip": s.getsockname()[0], "env": env,
              "agent_pid": agent, "agent_netns": ns(agent), "worker_cmd": worker_cmd}
    os.makedirs(env["WHERE_OUT"], exist_ok=True)
    with open(os.path.join(env["WHERE_OUT"], f"rank{env['RANK']}.json"), "w") as f:
        json.dump(report, f)
""")


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    """Build (first time: minutes) or load DeepSpeed's CPU ops once, not in every rank at once."""
    helpers_train.prebuild_ops()


# --------------------------------------------------------------------------- helpers

def _ray(cluster: Any) -> dict:
    return {"provisioner": "ray", "ray": {"address": cluster.address}}


def _hosts(hostfile, cluster: Any, hosts: list[int] | tuple[int, ...] = (0, 1, 2), slots: int = 1) -> Path:
    """A hostfile of host names (they resolve to the nodes' addresses through /etc/hosts)."""
    return hostfile("".join(f"{cluster.net.names[i]} slots={slots}\n" for i in hosts))


def _train_spec(write_spec, hostfile, cluster: Any, tmp_path: Path, *, steps: int, interval: int = 0,
                launcher: str = "pdsh", name: str = "ray", hosts: tuple[int, ...] = (0, 1, 2), **extra: Any) -> Path:
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    fields = dict(
        name=name, hostfile=str(_hosts(hostfile, cluster, hosts)), **_ray(cluster), launcher=launcher,
        workdir=str(EXAMPLES), entrypoint="train_gpt.py",
        args=["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY],
        deepspeed_config=config, checkpoint_dir=str(tmp_path / f"ckpt-{name}"), env=dict(BASE_ENV),
        stop_grace_seconds=GRACE)
    fields.update(extra)
    return write_spec(**fields)


def _where_spec(write_spec, cluster: Any, tmp_path: Path, out_dir: Path, *, name: str = "where",
                hostfile_path: Path | None = None, **extra: Any) -> Path:
    script = tmp_path / "where.py"
    script.write_text(WHERE)
    fields: dict[str, Any] = dict(name=name, **_ray(cluster), launcher="pdsh", entrypoint=str(script),
                                  env={**BASE_ENV, "WHERE_OUT": str(out_dir), "WHERE_PEER": cluster.net.controller_addr},
                                  stop_grace_seconds=GRACE)
    if hostfile_path is not None:
        fields["hostfile"] = str(hostfile_path)
    fields.update(extra)
    return write_spec(**fields)


def _reports(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}


def _netns_inode(cluster: Any, i: int) -> int:
    return os.stat(f"/run/netns/{cluster.net.hosts[i].ns}").st_ino


def _in_host(cluster: Any, pid: int, i: int) -> bool:
    return hj.in_netns(pid, cluster.net.hosts[i].ns)


def _rank_pids(orch, job_id: str, world: int) -> dict[int, int]:
    """``{global rank: pid}`` from ``orch status --output json`` once every rank runs."""
    def pids() -> dict[int, int] | None:
        ranks = orch.json("status", job_id)["ranks"]
        got = {r["global_rank"]: r["pid"] for r in ranks if r["pid"]}
        return got if len(got) == world else None
    return wait_for(pids, 60, "every rank's pid", interval=0.2)


# --------------------------------------------------------------------------- 0. the cluster itself

def test_four_hosts(ray4) -> None:
    """The 4-host test cluster (tests/raycluster.py; its 3-host one is checked in tests/test_raycluster.py): every
    worker node at its host's address, a task pinned to a node runs in that host. First here, on a fresh cluster."""
    from test_raycluster import check_tasks_on_own_hosts
    print(f"\n4-host Ray cluster: start-up {ray4.setup_seconds:.1f} s {ray4.last_start_seconds}")
    assert [n["ip"] for n in ray4.nodes() if n["alive"] and not n["is_head"]] == ray4.net.addresses
    check_tasks_on_own_hosts(ray4)


# --------------------------------------------------------------------------- 1. hosts to Ray nodes

def test_hostfile_hosts_by_name_run_one_agent_actor_on_each_node(orch, write_spec, hostfile, ray4,
                                                                 tmp_path) -> None:
    cluster, net = ray4, ray4.net
    out_dir = tmp_path / "where"
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, hostfile_path=_hosts(hostfile, cluster))
    env = cluster.env()
    plan = orch.json("plan", str(spec), env=env)
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [(h, [0]) for h in net.names[:3]]
    assert plan["provisioner"] == "ray" and plan["master_addr"] == cluster.node_ip(0)
    r = orch("plan", str(spec), env=env)
    assert r.returncode == 0 and all(h in r.stdout for h in net.names[:3]), hj.out(r)

    r = orch("run", str(spec), env=env, timeout=120)
    assert r.returncode == 0, hj.out(r)
    reports = _reports(out_dir)
    assert sorted(reports) == [0, 1, 2]
    for rank, rep in reports.items():  # one node per rank: rank i runs on host i, and so does its agent
        assert rep["netns"] == rep["agent_netns"] == _netns_inode(cluster, rank), (rank, rep["ip"])
        assert rep["ip"] == cluster.node_ip(rank) == net.addresses[rank]
        assert rep["env"]["ORCH_NODE"] == net.names[rank] and rep["env"]["RANK"] == str(rank)
        assert rep["env"]["MASTER_ADDR"] == cluster.node_ip(0)
        assert rep["worker_cmd"].startswith("ray::OrchAgent"), rep["worker_cmd"]  # the agent is the actor's child
    (job,) = orch.json("list")
    store = hj.store(orch)
    agents = hj.agent_pids(store, job["id"])
    assert sorted(agents) == [0, 1, 2] and all(agents[i] == reports[i]["agent_pid"] for i in range(3))
    assert_no_leftovers(job["id"], timeout=1)
    hj.assert_hosts_clean(cluster.net, 1, cluster.session_ids)
    assert hj.ray_agent_workers(cluster) == []
    hj.assert_ray_cluster_clean(cluster, job["id"])


def test_ranks_do_not_get_what_orchs_own_ray_driver_put_in_its_environment(orch, write_spec, hostfile, ray4,
                                                                          tmp_path) -> None:
    """``ray.init`` sets ``PYTHONBREAKPOINT=ray.util.rpdb._driver_set_trace`` in the driver's
    ``os.environ``; the controller is that driver, and the pdsh launcher exports the controller's
    ``PYTHON*`` variables. Its environment as the user started it is what must be exported."""
    cluster = ray4
    out_dir = tmp_path / "where"
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, hostfile_path=_hosts(hostfile, cluster))
    env = cluster.env()
    env.pop("PYTHONBREAKPOINT", None)  # as the user started orch
    plan = orch.json("plan", str(spec), env=env)
    assert "PYTHONBREAKPOINT" not in plan["exports"], plan["exports"]
    assert "ray.util.rpdb" not in json.dumps(plan["real_commands"])
    r = orch("run", str(spec), env=env, timeout=120)
    assert r.returncode == 0, hj.out(r)
    for rank, rep in _reports(out_dir).items():
        assert rep["env"].get("PYTHONBREAKPOINT") != "ray.util.rpdb._driver_set_trace", rank


def test_address_auto_is_the_cluster_of_RAY_ADDRESS(orch, write_spec, hostfile, ray4, tmp_path) -> None:
    cluster = ray4
    out_dir = tmp_path / "where"
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, hostfile_path=_hosts(hostfile, cluster, (1, 2)),
                       ray={"address": "auto"})
    env = cluster.env()  # RAY_ADDRESS=<head>:<port>, as `ray start` users have it
    r = orch("run", str(spec), env=env, timeout=120)
    assert r.returncode == 0, hj.out(r)
    reports = _reports(out_dir)
    assert [reports[g]["ip"] for g in (0, 1)] == [cluster.node_ip(1), cluster.node_ip(2)]
    # without RAY_ADDRESS, auto finds the cluster running here as `ray status` does (its nodes have temp
    # dirs of their own, so Ray's default one does not name it): from the process table
    del env["RAY_ADDRESS"]
    plan = orch.json("plan", str(spec), env=env)
    assert plan["master_addr"] == cluster.node_ip(1) and [n["host"] for n in plan["nodes"]] == \
        [cluster.net.names[1], cluster.net.names[2]], plan


@pytest.mark.parametrize("case", ["all", "exclude", "include"])
def test_without_hostfile_the_pool_is_the_alive_nodes_with_cpus(orch, write_spec, ray4, tmp_path, case) -> None:
    cluster, net = ray4, ray4.net
    ips = [cluster.node_ip(i) for i in range(4)]
    filters, want = {}, {ip: list(range(CPUS)) for ip in ips}
    if case == "exclude":  # a whole node, and one slot of another
        filters = {"exclude": f"{ips[1]}@{ips[2]}:1"}
        want = {ips[0]: [0, 1], ips[2]: [0], ips[3]: [0, 1]}
    elif case == "include":
        filters = {"include": f"{ips[2]}:0@{ips[3]}"}
        want = {ips[2]: [0], ips[3]: [0, 1]}
    out_dir = tmp_path / "where"
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, name=case, **filters)
    env = cluster.env()
    plan = orch.json("plan", str(spec), env=env)
    got = {n["host"]: n["slots"] for n in plan["nodes"]}
    assert got == want, got
    assert net.controller_addr not in got  # the head has no CPUs: not in the pool
    assert plan["master_addr"] == plan["nodes"][0]["host"]
    r = orch("plan", str(spec), env=env)
    assert r.returncode == 0 and all(ip in r.stdout for ip in want) and net.controller_addr + " " not in r.stdout

    r = orch("run", str(spec), env=env, timeout=120)
    assert r.returncode == 0, hj.out(r)
    reports = _reports(out_dir)
    placed = {n["host"]: [rk["global_rank"] for rk in n["ranks"]] for n in plan["nodes"]}
    assert sorted(reports) == sorted(g for ranks in placed.values() for g in ranks)
    for host, ranks in placed.items():
        i = ips.index(host)
        for g in ranks:
            assert reports[g]["ip"] == host and reports[g]["netns"] == _netns_inode(cluster, i), (g, host)
            assert reports[g]["env"]["ORCH_NODE"] == host
    (job,) = orch.json("list")
    assert_no_leftovers(job["id"], timeout=1)
    hj.assert_hosts_clean(cluster.net, 1, cluster.session_ids)
    assert hj.ray_agent_workers(cluster) == []


# --------------------------------------------------------------------------- 2. training

def test_zero2_training_on_three_ray_nodes(orch, write_spec, hostfile, ray4, tmp_path) -> None:
    cluster = ray4
    steps, interval = 6, 3
    spec = _train_spec(write_spec, hostfile, cluster, tmp_path, steps=steps, interval=interval)
    proc = orch.popen("run", str(spec), env=cluster.env())
    try:
        job_id = hj.job_id(orch)
        pids = _rank_pids(orch, job_id, 3)
        for rank, pid in pids.items():  # one rank per node: rank i runs on host i
            assert _in_host(cluster, pid, rank), (rank, pid)
        agents = hj.agent_pids(hj.store(orch), job_id)
        assert sorted(agents) == [0, 1, 2] and all(_in_host(cluster, pid, n) for n, pid in agents.items())
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    finally:
        hj.kill_group(proc)
    detail = orch.json("status", job_id)
    assert detail["state"] == "SUCCEEDED" and detail["nodes"] == cluster.net.names[:3]
    assert detail["master_addr"] == cluster.node_ip(0)
    assert [x["step"] for x in detail["ranks"]] == [steps] * 3
    losses = hj.losses(Path(detail["run_dir"]))
    assert sorted(losses) == [(rank, s) for rank in range(3) for s in range(1, steps + 1)]
    assert all(math.isfinite(v) and 0 < v < 10 for v in losses.values())
    for tag in ("step_3", "step_6"):
        info = inspect_tag(Path(detail["checkpoint_dir"]) / tag)
        assert info.complete, info.problems
        assert (info.zero_stage, info.world_size, info.step) == (2, 3, int(tag[5:]))
    for rank in range(3):
        log = (Path(detail["run_dir"]) / "logs" / f"rank-{rank}.log").read_text()
        setup = next(line for line in log.splitlines() if line.startswith("[setup]"))
        assert " zero_stage=2 " in setup and " world_size=3 " in setup and f" node_rank={rank} " in setup
    assert_no_leftovers(job_id, timeout=1)
    hj.assert_hosts_clean(cluster.net, 1, cluster.session_ids)
    hj.assert_ray_cluster_clean(cluster, job_id)


# --------------------------------------------------------------------------- 6. bad input

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("case", ["unreachable", "too_many_slots", "no_node", "head_has_no_cpus", "same_node"])
def test_bad_ray_input_is_one_clear_message_and_starts_nothing(orch, write_spec, hostfile, ray4, tmp_path,
                                                               case) -> None:
    cluster, net = ray4, ray4.net
    names, ips = net.names, [cluster.node_ip(i) for i in range(4)]
    out_dir = tmp_path / "where"
    text, extra = None, {}
    if case == "unreachable":
        port = _closed_port()
        extra = {"ray": {"address": f"127.0.0.1:{port}", "connect_timeout": 5}}
        needles = [f"cannot reach the Ray cluster at 127.0.0.1:{port}", "refused"]
    elif case == "too_many_slots":
        text = f"{names[0]} slots=1\n{names[1]} slots=4\n"
        needles = [f"host {names[1]} (Ray node {ips[1]}) has {CPUS} CPUs; the plan needs 4 slot(s) there"]
    elif case == "no_node":
        nowhere = net.controller_addr.rsplit(".", 1)[0] + ".99"  # in the hosts' subnet, no node there
        text = f"{names[0]} slots=1\n{nowhere} slots=1\n"
        needles = [f"host {nowhere} has no alive Ray node", *ips]  # the alive nodes are listed
    elif case == "head_has_no_cpus":
        text = f"{names[0]} slots=1\n{net.controller_name} slots=1\n"
        needles = [f"host {net.controller_name} (Ray node {net.controller_addr}) has 0 CPUs"]
    else:
        text = f"{names[0]} slots=1\n{ips[0]} slots=1\n"
        needles = [f"hosts {names[0]} and {ips[0]} are the same Ray node {ips[0]}"]
    hf = hostfile(text) if text is not None else _hosts(hostfile, cluster)
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, hostfile_path=hf, **extra)
    for command in ("plan", "run"):
        t0 = time.monotonic()
        r = orch(command, str(spec), env=cluster.env(), timeout=60)
        took = time.monotonic() - t0
        if case == "unreachable" and command == "plan":  # plan shows what it can, and says what it could not check
            assert r.returncode == 0, hj.out(r)
            assert "warning: the hosts were not checked against the Ray cluster: " + needles[0] in \
                " ".join(r.stderr.split()), r.stderr
            assert took < 30, took
            continue
        assert r.returncode == 2, (command, hj.out(r))
        assert "Traceback" not in r.stderr + r.stdout
        assert r.stderr.startswith("error:") and r.stderr.count("error:") == 1, r.stderr
        err = " ".join(r.stderr.split())
        for needle in needles:
            assert needle in err, (needle, r.stderr)
        if case in ("too_many_slots", "no_node", "head_has_no_cpus"):
            assert names[0] not in err  # only the bad host is named
        assert took < 30, took
    assert orch.json("list") == []
    assert not out_dir.exists()
    assert hj.ray_agent_workers(cluster) == []
    hj.assert_hosts_clean(cluster.net, 1, cluster.session_ids)


def test_node_lost_while_provisioning_fails_the_attempt_and_leaves_nothing(orch, write_spec, hostfile, ray4,
                                                                           tmp_path) -> None:
    """The agents' interpreter is a wrapper that checks in, then waits at a gate: the victim's node is
    killed while every agent actor is placed and none has said hello; then the gate opens."""
    cluster, net = ray4, ray4.net
    victim = 2
    gate = tmp_path / "gate"
    gate.mkdir()
    wrapper = tmp_path / "python-at-gate"
    wrapper.write_text(f"#!/bin/sh\ntouch {gate}/in-$ORCH_AGENT_NODE_RANK\n"
                       f"while [ ! -e {gate}/open ]; do sleep 0.05; done\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    out_dir = tmp_path / "where"
    spec = _where_spec(write_spec, cluster, tmp_path, out_dir, hostfile_path=_hosts(hostfile, cluster),
                       python=str(wrapper))
    proc = orch.popen("run", str(spec), env=cluster.env({"ORCH_PROVISION_TIMEOUT_S": "20"}))
    try:
        job_id = hj.job_id(orch)
        wait_for(lambda: all((gate / f"in-{n}").exists() for n in range(3)), 60, "every agent at the gate")
        assert len(hj.ray_agent_workers(cluster)) == 3
        assert orch.json("status", job_id)["state"] == "PROVISIONING"
        t0 = time.monotonic()
        cluster.kill_node(victim, host=True)
        (gate / "open").touch()
        assert proc.wait(60) == 1
        took = time.monotonic() - t0
        out, _ = proc.communicate()
        detail = orch.json("status", job_id)
        cause = detail["cause"]
        print(f"\n[ray provisioning] node {net.names[victim]} killed before its agent's hello: FAILED, orch run "
              f"returned {took:.1f} s later; cause: {cause['message']}")
        assert detail["state"] == "FAILED" and cause["kind"] == "provision_failed", cause
        assert [n["node"] for n in cause["nodes"]] == [net.names[victim]] and cause["node"] == net.names[victim]
        assert "node may have died" in cause["message"] or "actor" in cause["message"], cause
        assert f"{net.names[victim]} (node {victim})" in " ".join(out.split())
        # no rank started anywhere
        assert not out_dir.exists()
        assert [e for e in hj.store(orch).events(job_id) if e.kind in ("ranks_started", "rank_exit")] == []
        assert all(x["state"] == "not started" and x["pid"] is None for x in detail["ranks"]), detail["ranks"]
        assert detail["attempts"][0]["stopped_at"] is not None
        assert_no_leftovers(job_id, timeout=1)
        hj.assert_hosts_clean(cluster.net, 5, cluster.session_ids)
        hj.assert_ray_cluster_clean(cluster, job_id)
    finally:
        (gate / "open").touch()
        hj.kill_group(proc)
        cluster.reset()
