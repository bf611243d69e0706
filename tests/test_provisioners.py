"""What every multi-host provisioner must do, one body per scenario run on each (``ssh`` on real sshd hosts,
``ray`` on a real 4-node Ray cluster): a rank and an agent per host, node loss (a killed host, a cut link)
detected within seconds with nothing left behind, a lost node replaced by a spare, cancel.

What is controller-side (a resume's losses equal the run it resumes, the spare chosen, the checkpoint chosen)
needs real DeepSpeed once: the spare scenario trains examples/train_gpt.py (tiny, ZeRO-2) over ssh and checks
the losses. Everything else is provisioner-specific and runs tests/scripts/allreduce.py, a gloo all-reduce every
step: a killed peer breaks the survivors' collective at once and a cut one blocks it, as in training, at the cost
of ``import torch`` instead of DeepSpeed's start-up. Its ranks are exec'd (``fast_start: off``): a template
importing torch and DeepSpeed per node would cost more than the rank it forks.

Every "host" is a network namespace on this machine (tests/nethosts.py); hosts share the file system and the
process table with this process, so ``assert_no_leftovers`` sees every host's processes and a process belongs
to host i when ``/proc/<pid>/ns/net`` is host i's namespace. On Ray, what the cluster itself holds of a job
(named actors, placement groups, reserved CPUs) is read by a driver (``helpers_jobs.assert_ray_cluster_clean``).
Detection times are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import helpers_jobs as hj
import helpers_train
from conftest import ROOT, SCRIPTS, assert_no_leftovers, job_processes, wait_for
from orchestrator.checkpoints import inspect_tag, latest_complete

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
ALLREDUCE = SCRIPTS / "allreduce.py"
BASE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
GRACE = 5
#: nodes of the spare test's job; its hostfile's next host is the spare
NODES = 2
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]


@dataclass
class Site:
    """One provisioner's hosts: ``net`` (tests/nethosts.py) and, on Ray, the ``cluster`` over it."""

    kind: str
    net: Any
    cluster: Any = None

    def fields(self) -> dict:
        """The spec fields that send a job to these hosts."""
        if self.kind == "ray":
            return {"provisioner": "ray", "ray": {"address": self.cluster.address}}
        p = self.net.client_params()
        # a login over SSH gets sshd's default environment; the tests' private op cache is passed on by name
        return {"provisioner": "ssh", "ssh": {"user": p["user"], "identity_file": p["key_filename"],
                                              "known_hosts": p["known_hosts"]},
                "env_passthrough": ["TORCH_EXTENSIONS_DIR"]}

    def env(self, extra: dict | None = None) -> dict | None:
        """The environment ``orch`` runs with (on Ray: the cluster's ``RAY_ADDRESS``), plus ``extra``."""
        return self.cluster.env(extra) if self.kind == "ray" else extra

    def kill_host(self, i: int) -> None:
        """Every process of host i, its sshd (and Ray node) too."""
        if self.kind == "ray":
            self.cluster.kill_node(i, host=True)
        else:
            self.net.kill_host(i)

    def reset(self) -> None:
        if self.kind == "ray":
            self.cluster.reset()
            self.cluster.wait_alive()
        else:
            self.net.reset()

    def assert_hosts_clean(self, timeout: float = 10.0) -> None:
        hj.assert_hosts_clean(self.net, timeout, self.cluster.session_ids if self.kind == "ray" else ())

    def assert_clean(self, job_id: str, timeout: float = 10.0) -> None:
        """Nothing of the job on any host (polled up to ``timeout`` s); on Ray, nothing of it on the cluster."""
        self.assert_hosts_clean(timeout)
        if self.kind == "ray":
            hj.assert_ray_cluster_clean(self.cluster, job_id)


@pytest.fixture(params=["ssh", "ray"])
def site(request: pytest.FixtureRequest) -> Site:
    """The ``ssh`` site is ``net4``'s hosts, the ``ray`` one ``ray4``'s (a Ray node per host)."""
    if request.param == "ray":
        cluster = request.getfixturevalue("ray4")
        return Site("ray", cluster.net, cluster)
    return Site("ssh", request.getfixturevalue("net4"))


def _hosts(hostfile, site: Site, hosts: tuple[int, ...] = (0, 1, 2)) -> Path:
    return hostfile("".join(f"{site.net.names[i]} slots=1\n" for i in hosts))


def _allreduce_spec(write_spec, hostfile, site: Site, *, steps: int, name: str, step_s: float = 0.05,
                    hosts: tuple[int, ...] = (0, 1, 2), **extra: Any) -> Path:
    """A job of tests/scripts/allreduce.py, one rank per host of ``hosts`` (``steps`` 0: until stopped)."""
    fields = dict(name=name, hostfile=str(_hosts(hostfile, site, hosts)), **site.fields(), launcher="pdsh",
                  entrypoint=str(ALLREDUCE), fast_start="off", stop_grace_seconds=GRACE,
                  env={**BASE_ENV, "ALLREDUCE_STEPS": str(steps), "ALLREDUCE_STEP_S": str(step_s)})
    fields.update(extra)
    return write_spec(**fields)


def _assert_in_host(site: Site, pid: int, i: int) -> None:
    assert hj.in_netns(pid, site.net.hosts[i].ns), f"pid {pid} is not in host {i}"


# --------------------------------------------------------------------------- a rank and an agent per host

@pytest.mark.parametrize("site,launcher", [("ssh", "pdsh"), ("ssh", "nossh"), ("ray", "pdsh")], indirect=["site"])
def test_each_host_runs_its_agent_and_its_rank_to_the_end(orch, write_spec, hostfile, site, launcher) -> None:
    """Both ways of starting a node's ranks over SSH (pdsh: DeepSpeed's launch.py per node; nossh); on Ray, whose
    placement is its own, one."""
    steps = 8
    spec = _allreduce_spec(write_spec, hostfile, site, steps=steps, name="each", launcher=launcher)
    proc = orch.popen("run", str(spec), env=site.env())
    try:
        job_id = hj.job_id(orch)
        st = hj.store(orch)
        pids = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(hj.started_pids(st, job_id)), 60,
                        "every node's ranks started", interval=0.05)
        for rank, pid in pids.items():  # one rank per node: rank i runs on host i
            _assert_in_host(site, pid, rank)
            if site.kind == "ssh":  # and came in over SSH to host i
                env = psutil.Process(pid).environ()
                assert env["SSH_CONNECTION"].split()[2] == site.net.addresses[rank] and \
                    env["ORCH_NODE"] == site.net.names[rank], env.get("SSH_CONNECTION")
        agents = hj.agent_pids(st, job_id)
        assert sorted(agents) == [0, 1, 2]
        for node_rank, pid in agents.items():  # and so does its agent
            _assert_in_host(site, pid, node_rank)
        o, e = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{o[-3000:]}\n{e[-3000:]}"
    finally:
        hj.kill_group(proc)
    detail = orch.json("status", job_id)
    assert detail["state"] == "SUCCEEDED" and detail["nodes"] == site.net.names[:3]
    master = site.cluster.node_ip(0) if site.kind == "ray" else site.net.addresses[0]
    assert detail["master_addr"] == master
    assert [x["step"] for x in detail["ranks"]] == [steps] * 3
    seen = hj.losses(Path(detail["run_dir"]))
    assert sorted(seen) == [(rank, s) for rank in range(3) for s in range(1, steps + 1)]
    # the all-reduce reached every rank: each step's loss is the same on all three
    assert all(seen[(0, s)] == seen[(1, s)] == seen[(2, s)] for s in range(1, steps + 1))
    for rank in range(3):
        log = (Path(detail["run_dir"]) / "logs" / f"rank-{rank}.log").read_text()
        assert f"[setup] rank={rank} world_size=3 node_rank={rank} master={master}:" in log, log[-500:]
    assert_no_leftovers(job_id, timeout=1)
    site.assert_clean(job_id, timeout=1 if site.kind == "ssh" else 10)


# --------------------------------------------------------------------------- node loss

# a killed host is seen at once (its connections reset); a cut link only by its missed heartbeats, within a few
# seconds of the bound asserted: that one runs alone (the timing tier, docs/testing.md)
@pytest.mark.parametrize("fault", ["kill_host", pytest.param("cut_link", marks=pytest.mark.timing)])
def test_node_loss_mid_run_fails_fast_and_leaves_nothing(orch, write_spec, hostfile, site, fault) -> None:
    lease, victim = 5, 1
    net = site.net
    spec = _allreduce_spec(write_spec, hostfile, site, steps=0, name=fault.replace("_", "-"))
    proc = orch.popen("run", str(spec), env=site.env({"ORCH_AGENT_LEASE_S": str(lease), "ORCH_NODE_TIMEOUT_S": "3",
                                                      "ORCH_HEARTBEAT_S": "0.5"}))
    try:
        job_id = hj.job_id(orch)
        hj.wait_training(orch, job_id, 3, past=1)
        pids = hj.started_pids(hj.store(orch), job_id)
        agents = hj.agent_pids(hj.store(orch), job_id)
        victim_procs = [p for p in job_processes(job_id) if hj.in_netns(p.pid, net.hosts[victim].ns)]
        assert {pids[victim], agents[victim]} <= {p.pid for p in victim_procs}  # its agent and rank run there
        wall0, t0 = time.time(), time.monotonic()
        if fault == "kill_host":
            site.kill_host(victim)
        else:
            net.cut_link(victim)
        detect_s = hj.time_to_state(orch, job_id, "FAILED", t0)
        if fault == "cut_link":  # its rank still runs: nothing could reach it, and its lease is not over
            assert [p for p in victim_procs if hj.alive(p.pid)], "the cut host's processes were gone before its lease"
        first = orch.json("status", job_id)["cause"]
        assert proc.wait(60) == 1
        stopped_s = time.monotonic() - t0
        shown, _ = proc.communicate()
        # the cause is final once the attempt has stopped: a killed host's peers may fail their collective
        # first (connection reset), and teardown then names the lost node as the root cause
        detail = orch.json("status", job_id)
        cause = detail["cause"]
        ended_s = detail["attempts"][0]["ended_at"] - wall0
        print(f"\n[{site.kind} node loss] {fault} of {net.names[victim]}: FAILED {detect_s:.2f} s after the fault "
              f"(store's ended_at: {ended_s:.2f} s); first cause: {first['message']}; final: {cause['message']}")
        assert cause["kind"] == "node_lost" and cause["node"] == net.names[victim], cause
        assert cause["node_rank"] == victim and net.names[victim] in cause["message"]
        assert detail["attempts"][0]["cause"] == cause
        if first["kind"] != "node_lost":  # a symptom first: a rank of another node, kept in the cause
            assert first["kind"] == "rank_exit" and first["node_rank"] != victim, first
            assert cause["first_symptom"] == first
        assert detect_s < 5, f"node loss detected after {detect_s:.2f} s"
        words = " ".join(shown.split())
        assert f"cause: {cause['message']}" in words, shown[-2000:]
        # the hint leaves the lost node out (a plain resume would try to reach it again)
        assert f"next: resume without the lost node: orch resume {job_id} --exclude {net.names[victim]} " in words, \
            shown[-2000:]
        others = [pid for rank, pid in pids.items() if rank != victim] + \
                 [pid for node, pid in agents.items() if node != victim]
        assert not any(hj.alive(pid) for pid in others)  # the other nodes' agents and ranks stopped
        if fault == "cut_link":
            # the cut host cannot be told: its agent stops its rank once the controller's lease runs out
            assert_no_leftovers(job_id, timeout=lease + GRACE + 10)
            gone_s = time.monotonic() - t0
            print(f"[{site.kind} node loss] the cut host's agent stopped its rank {gone_s:.1f} s after the cut "
                  f"(lease {lease} s, grace {GRACE} s); orch run returned after {stopped_s:.1f} s")
            assert gone_s > lease - 1  # it was the lease, not something else
        else:
            assert_no_leftovers(job_id, timeout=1)  # orch run returns once every reachable process is gone
            print(f"[{site.kind} node loss] orch run returned {stopped_s:.1f} s after the kill")
        site.assert_hosts_clean(timeout=1 if fault == "kill_host" else 10)
        if site.kind == "ray":
            _ray_after_node_loss(orch, site, spec, job_id, victim, fault, t0)
    finally:
        hj.kill_group(proc)
        site.reset()
    net.connect(victim).close()  # back for the next test


def _ray_after_node_loss(orch, site: Site, spec: Path, job_id: str, victim: int, fault: str, t0: float) -> None:
    """What Ray's cluster holds after the fault: orch killed the cut node's actor (Ray lists none of the job),
    but only that node's raylet can report its CPUs free, which it does once its link is back; a killed node,
    once Ray knows it is dead, makes a job naming its host refused up front."""
    cluster, net = site.cluster, site.net
    if fault == "cut_link":
        state = hj.ray_cluster_state(cluster, job_id, timeout=0)
        assert state["actors"] == [] and state["placement_groups"] == [], state
        cluster.restore_link(victim, wait=True)
    hj.assert_ray_cluster_clean(cluster, job_id, timeout=30)
    if fault == "kill_host":
        dead_s = cluster.wait_dead(victim) + (time.monotonic() - t0)
        print(f"[ray node loss] Ray itself marked the killed node dead {dead_s:.1f} s after the kill")
        r = orch("run", str(spec), env=cluster.env(), timeout=120)
        assert r.returncode == 2, hj.out(r)
        assert f"host {net.names[victim]} has no alive Ray node" in " ".join(r.stderr.split()), r.stderr
        assert [j["id"] for j in orch.json("list")] == [job_id]  # no new job


# --------------------------------------------------------------------------- a spare takes the lost node's place

def test_lost_node_resumes_on_a_spare(orch, write_spec, hostfile, site, tmp_path) -> None:
    """2 of 3 hosts (``num_nodes: 2``); host 1 is killed mid-run; ``orch resume --exclude`` it runs on host 0 and
    the spare 2, each with an agent of its own. Over ssh the job is real DeepSpeed training, resumed from the
    last complete checkpoint with every overlapping loss equal; on Ray the all-reduce job (what is Ray's own is the
    spare's actor, and the refusal of a plain resume that needs the lost node)."""
    net, victim = site.net, 1
    deepspeed = site.kind == "ssh"
    if deepspeed:
        helpers_train.prebuild_ops()
        steps, interval = 80, 20
        config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
        config["train_micro_batch_size_per_gpu"] = 4
        spec = write_spec(name="spare", hostfile=str(_hosts(hostfile, site, (0, 1, 2))), **site.fields(),
                          launcher="pdsh", workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                          args=["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY],
                          deepspeed_config=config, checkpoint_dir=str(tmp_path / "ckpt"), env=dict(BASE_ENV),
                          stop_grace_seconds=GRACE, num_nodes=NODES)
    else:
        steps = 40
        spec = _allreduce_spec(write_spec, hostfile, site, steps=steps, name="spare", hosts=(0, 1, 2), num_nodes=NODES)
    env = site.env()
    proc = orch.popen("run", str(spec), env=env)
    try:
        job_id = hj.job_id(orch)
        run_dir = hj.wait_training(orch, job_id, NODES, past=1)
        if deepspeed:
            ckpt = Path(hj.attempt(hj.store(orch), job_id, 1).plan["checkpoint_dir"])

            def between_checkpoints() -> bool:  # a complete checkpoint, and training well past it
                done = hj.last_steps(run_dir, NODES)
                assert max(done) < steps, "attempt 1 finished before the fault"
                return (inspect_tag(ckpt / f"step_{interval}").complete and min(done) > interval
                        and 3 <= min(done) % interval <= interval - 6 and max(done) - min(done) < 3)
            wait_for(between_checkpoints, 120, "training between two checkpoints", interval=0.02)
        else:
            wait_for(lambda: min(hj.last_steps(run_dir, NODES)) >= 3, 60, "every rank at step 3")
        site.kill_host(victim)
        assert proc.wait(60) == 1
        first = orch.json("status", job_id)
        assert first["state"] == "FAILED" and first["cause"]["kind"] == "node_lost", first["cause"]
        assert first["cause"]["node"] == net.names[victim] and first["nodes"] == net.names[:NODES]
        assert_no_leftovers(job_id, timeout=1)
        reached = hj.losses(run_dir)
        if deepspeed:  # the checkpoint the resume must start from: the newest complete one at the fault
            info, _ = latest_complete(ckpt)
            assert info is not None and info.step % interval == 0 and info.step < steps
        if site.kind == "ray":
            # a plain resume would need the lost node: refused before anything starts, whether Ray noticed already
            # (no alive node) or not yet (it lists the node, whose raylet no longer answers)
            t0 = time.monotonic()
            r = orch("resume", job_id, env=env, timeout=120)
            words = " ".join(r.stderr.split())
            assert r.returncode == 2, hj.out(r)
            assert f"host {net.names[victim]}" in words and ("has no alive Ray node" in words or
                                                            "does not answer" in words), words
            assert f"orch resume JOB --exclude {net.names[victim]}" in words, words
            refused_s = time.monotonic() - t0
            print(f"\n[ray resume] a plain resume needing the lost node was refused in {refused_s:.2f} s")
            assert refused_s < 15 and len(orch.json("status", job_id)["attempts"]) == 1
        r = orch("resume", job_id, "--exclude", net.names[victim], env=env, timeout=300)
        assert r.returncode == 0, hj.out(r)
    finally:
        hj.kill_group(proc)
        site.reset()
    done = orch.json("status", job_id)
    assert done["state"] == "SUCCEEDED" and [a["state"] for a in done["attempts"]] == ["FAILED", "SUCCEEDED"]
    second = done["attempts"][1]
    spare_nodes = [net.names[0], net.names[2]]  # the spare joined; the lost host is out
    assert second["nodes"] == spare_nodes and done["nodes"] == spare_nodes
    assert done["spec"]["exclude_hosts"] == [net.names[victim]]
    st = hj.store(orch)
    spare_agents = hj.agent_pids(st, job_id, 2)
    assert sorted(spare_agents) == [0, 1]
    agent_up = {e.data["node_rank"]: e.data["host"] for e in st.events(job_id)
                if e.attempt == 2 and e.kind == "agent_up"}
    assert agent_up[1] == net.names[2], agent_up  # node rank 1 of attempt 2 is the spare, with an agent of its own
    resumed = hj.losses(Path(done["run_dir"]))
    assert Path(done["run_dir"]) != run_dir
    if not deepspeed:  # no checkpoint: the resume starts again from step 1
        assert second["resume_tag"] is None
        assert sorted(resumed) == [(rank, s) for rank in range(NODES) for s in range(1, steps + 1)]
    else:
        tag = second["resume_tag"]
        assert tag == info.tag, (tag, info.tag)
        start = int(tag.removeprefix("step_"))
        for rank in range(NODES):
            logged = sorted(s for (r_, s) in resumed if r_ == rank)
            assert logged == list(range(start + 1, steps + 1)), (rank, logged[:3])  # tag+1 on: no restart from 0
            log = (Path(done["run_dir"]) / "logs" / f"rank-{rank}.log").read_text()
            assert f"[resume] rank={rank} tag={tag} global_step={start} " in log
        both = sorted(k for k in resumed if k in reached)
        assert both and all(s > start for (_, s) in both)
        assert {r_ for (r_, _) in both} == set(range(NODES))
        differ = [(k, reached[k], resumed[k]) for k in both if reached[k] != resumed[k]]
        print(f"\n[ssh resume] attempt 1 reached step {max(s for (_, s) in reached)}, attempt 2 resumed from {tag} "
              f"on {spare_nodes}: {len(both) - len(differ)}/{len(both)} overlapping losses identical")
        assert differ == [], differ[:5]
        for tag_ in (f"step_{s}" for s in range(interval, steps + 1, interval)):
            info_ = inspect_tag(ckpt / tag_)
            assert info_.complete, (tag_, info_.problems)
            assert (info_.zero_stage, info_.world_size, info_.step) == (2, NODES, int(tag_[5:]))
        for attempt_dir in (run_dir, Path(done["run_dir"])):  # ZeRO-2 across the nodes, rank i on node i
            for rank in range(NODES):
                log = (attempt_dir / "logs" / f"rank-{rank}.log").read_text()
                setup = next(line for line in log.splitlines() if line.startswith("[setup]"))
                assert " zero_stage=2 " in setup and f" world_size={NODES} " in setup and f" node_rank={rank} " in setup
    assert_no_leftovers(job_id, timeout=1)
    site.assert_clean(job_id)


# --------------------------------------------------------------------------- cancel

@pytest.mark.timing
def test_cancel_stops_every_rank_on_every_host_within_the_grace_period(orch, write_spec, hostfile, site) -> None:
    spec = _allreduce_spec(write_spec, hostfile, site, steps=0, name="cancel")
    env = site.env()
    proc = orch.popen("run", str(spec), env=env)
    try:
        job_id = hj.job_id(orch)
        hj.wait_training(orch, job_id, 3, past=1)
        pids = hj.started_pids(hj.store(orch), job_id)
        for rank, pid in pids.items():
            _assert_in_host(site, pid, rank)
        if site.kind == "ray":
            assert len(hj.ray_agent_workers(site.cluster)) == 3
        t0 = time.monotonic()
        r = orch("cancel", job_id, "--wait", "30", env=env, timeout=60)
        elapsed = time.monotonic() - t0
        assert r.returncode == 0 and "CANCELLED" in r.stdout, hj.out(r)
        assert_no_leftovers(job_id, timeout=1)
        print(f"\n[{site.kind} cancel] every process gone {elapsed:.1f} s after `orch cancel` started "
              f"(grace {GRACE} s)")
        assert elapsed < GRACE + (5 if site.kind == "ray" else 3)
        assert proc.wait(30) == 1
    finally:
        hj.kill_group(proc)
    detail = orch.json("status", job_id)
    assert detail["state"] == "CANCELLED" and detail["cause"]["kind"] == "cancelled"
    assert [x["state"] for x in detail["ranks"]] == ["stopped"] * 3, detail["ranks"]
    assert detail["attempts"][0]["stopped_at"] is not None
    assert not any(hj.alive(p) for p in pids.values())
    if site.kind == "ray":
        wait_for(lambda: hj.ray_agent_workers(site.cluster) == [], 10, "the actors' workers to exit")
    site.assert_clean(job_id, timeout=1 if site.kind == "ssh" else 10)
