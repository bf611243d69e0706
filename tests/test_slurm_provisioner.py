"""Integration: ``provisioner: slurm`` inside a real Slurm allocation (tests/slurmcluster.py).

``salloc -N 4 --ntasks-per-node=1 --no-kill orch run job.yaml`` on the test cluster (four namespace
hosts, each with a slurmd): the pool is the allocation (no hostfile), ``num_nodes: 2`` leaves the
third and fourth as spares, and every node's agent is an ``srun`` step of the allocation. Shown: ZeRO-2
training to completion (ranks under the slurm launcher, emulated and native srun; under the pdsh
launcher: the preemption test's resumed attempt); a node set DOWN by ``scontrol`` mid-training, and a
preemption's SIGTERM, is a node loss, nothing is left behind, and ``orch resume`` inside a new
allocation finishes (``--exclude``: on the spare); outside an allocation ``orch plan`` says how to see
the plan (submitting from there: tests/test_slurm_login.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, assert_no_leftovers, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
#: nodes of every job (the 4-node allocation's first ones: the rest are spares)
NODES = 2


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def _spec(write_spec, tmp_path: Path, *, launcher: str, steps: int, interval: int = 0, name: str, **extra) -> Path:
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    fields = dict(name=name, provisioner="slurm", num_nodes=NODES, launcher=launcher, workdir=str(EXAMPLES),
                  entrypoint="train_gpt.py", args=["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY],
                  deepspeed_config=config, checkpoint_dir=str(tmp_path / f"ckpt-{name}"), stop_grace_seconds=5,
                  env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, env_passthrough=["TORCH_EXTENSIONS_DIR"])
    fields.update(extra)
    return write_spec(**fields)


def _salloc(cluster, orch, *args: str, nodes: int = 4) -> list[str]:
    return ["salloc", "-N", str(nodes), "--ntasks-per-node=1", "--no-kill", *orch.cmd(*args)]


# (the pdsh launcher's run to completion in an allocation: test_preemption_sigterm_is_a_node_loss_and_resumes)
@pytest.mark.parametrize("launcher,mode", [("slurm", "emulated"), ("slurm", "native")])
def test_inside_an_allocation_trains(launcher, mode, slurm_cluster, orch, write_spec, tmp_path) -> None:
    spec = _spec(write_spec, tmp_path, launcher=launcher, steps=20, name=f"alloc-{launcher}-{mode}", launch_mode=mode)
    r = slurm_cluster.run(_salloc(slurm_cluster, orch, "run", str(spec), "--output", "json"), timeout=400,
                          check=False, env=orch.env())
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert detail["nodes"] == slurm_cluster.names[:NODES]  # the allocation, in Slurm's order; the rest spares
    run_dir = Path(detail["run_dir"])
    losses = helpers_train.attempt_losses(run_dir)
    assert [max(s for (r_, s) in losses if r_ == rank) for rank in range(NODES)] == [20] * NODES
    log = (run_dir / "logs" / "rank-1.log").read_text()
    assert "Traceback" not in log
    assert_no_leftovers(detail["id"], timeout=15)


def test_node_set_down_is_a_node_loss_and_resumes_on_the_spare(slurm_cluster, orch, write_spec, tmp_path) -> None:
    steps, interval, victim = 60, 10, 1
    spec = _spec(write_spec, tmp_path, launcher="pdsh", steps=steps, interval=interval, name="alloc-down")
    proc = subprocess.Popen(_salloc(slurm_cluster, orch, "run", str(spec)), env={**slurm_cluster.env, **orch.env()},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    down = slurm_cluster.names[victim]
    try:
        job_id = helpers_train.training_past(orch, interval + 2, ranks=NODES)
        t0 = time.monotonic()
        slurm_cluster.set_state(down, "DOWN", "orch test")
        wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", 60, "FAILED", interval=0.1)
        detect_s = time.monotonic() - t0
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = orch.json("status", job_id)
    print(f"\n[slurm provisioner] {down} set DOWN: FAILED after {detect_s:.2f} s; cause: {detail['cause']['message']}")
    assert detail["cause"]["kind"] == "node_lost" and detail["cause"]["node"] == down, detail["cause"]
    assert_no_leftovers(job_id, timeout=15)
    if slurm_cluster.node_state(down).startswith(("down", "drain")):  # ReturnToService=2 may have done it
        slurm_cluster.set_state(down, "RESUME")
    slurm_cluster.wait_idle(60)
    r = slurm_cluster.run(["salloc", "-N", str(NODES), "--ntasks-per-node=1", "--no-kill", "-x", down,
                           *orch.cmd("resume", job_id, "--exclude", down)], timeout=400, check=False, env=orch.env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = orch.json("status", job_id)
    resumed_on = done["attempts"][1]["nodes"]  # two of the three others, as Slurm chose
    assert done["state"] == "SUCCEEDED" and len(resumed_on) == NODES and down not in resumed_on, resumed_on
    assert int(done["attempts"][1]["resume_tag"].removeprefix("step_")) >= interval


def test_unavailable_names_the_nodes_sinfo_shows_out_of_service(slurm_cluster) -> None:
    """``SlurmProvisioner.unavailable`` against the real sinfo: a drained and a down node are named, in the order
    asked, the idle ones not; a host Slurm does not know is not named either."""
    from orchestrator.provisioners.slurm import SlurmProvisioner

    names = slurm_cluster.names
    prov = SlurmProvisioner(env=slurm_cluster.env)
    slurm_cluster.wait_idle(60)
    assert prov.unavailable(names) == []
    try:
        slurm_cluster.set_state(names[2], "DRAIN", "orch test")
        slurm_cluster.set_state(names[0], "DOWN", "orch test")
        assert prov.unavailable([names[3], names[2], names[1], names[0]]) == [names[2], names[0]]
        assert prov.unavailable([names[1], "no-such-node"]) == []
        assert prov.unavailable(["no-such-node", names[0]]) == [names[0]]  # scontrol's exit 1 still answers
    finally:
        for name in (names[0], names[2]):
            slurm_cluster.set_state(name, "RESUME")
        slurm_cluster.wait_idle(60)
    assert prov.unavailable(names) == [], slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout


def test_the_allocation_s_slots_come_from_slurm_s_variables_and_bad_ones_are_named(slurm_cluster) -> None:
    """``allocation_nodes`` with the real scontrol expanding the node list: GPUs per node win over tasks per node,
    tasks per node (``2(x3),1``) give each node its own count, else 1 each; a count that does not fit the node list,
    a malformed one and a node list scontrol cannot expand are errors that name the variable; ``check`` names the hosts
    of a pool that are outside the allocation."""
    from orchestrator.errors import ProvisionError
    from orchestrator.planning import ResourcePool
    from orchestrator.provisioners.slurm import SlurmProvisioner, allocation_nodes

    alloc = {**slurm_cluster.env, "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "w[1-4]"}
    assert allocation_nodes(alloc) == {"w1": 1, "w2": 1, "w3": 1, "w4": 1}
    assert allocation_nodes({**alloc, "SLURM_TASKS_PER_NODE": "2(x3),1"}) == {"w1": 2, "w2": 2, "w3": 2, "w4": 1}
    assert allocation_nodes({**alloc, "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_GPUS_PER_NODE": "gpu:8"}) == \
        {"w1": 8, "w2": 8, "w3": 8, "w4": 8}
    for tasks, says in (("2(x3)", "gives 3 node(s) but SLURM_JOB_NODELIST w[1-4] has 4"),
                        ("2(x", "SLURM_TASKS_PER_NODE: ")):
        with pytest.raises(ProvisionError, match=re.escape(says)):
            allocation_nodes({**alloc, "SLURM_TASKS_PER_NODE": tasks})
    with pytest.raises(ProvisionError, match=r"SLURM_JOB_NODELIST w\[4-1\] names no host .*Invalid hostlist"):
        allocation_nodes({**alloc, "SLURM_JOB_NODELIST": "w[4-1]"})  # (scontrol exits 0 on it)
    prov = SlurmProvisioner(env=alloc)
    prov.check(ResourcePool((("w2", (0,)), ("w4", (0,)))))
    with pytest.raises(ProvisionError, match=re.escape("host(s) v1, v2 are not in allocation 77 (its nodes: w1, w2")):
        prov.check(ResourcePool((("w1", (0,)), ("v1", (0,)), ("v2", (0,)))))


def test_plan_outside_an_allocation_says_how_to_see_one(orch, write_spec, tmp_path) -> None:
    spec = _spec(write_spec, tmp_path, launcher="pdsh", steps=1, name="no-alloc")
    env = {k: v for k, v in orch.env().items() if not k.startswith("SLURM_")}
    r = orch("plan", str(spec), env=env, replace_env=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert "SLURM_JOB_ID and SLURM_JOB_NODELIST are not set here" in err and "salloc -N <nodes> orch plan job.yaml" \
        in err, r.stderr


def test_preemption_sigterm_is_a_node_loss_and_resumes(slurm_cluster, orch, write_spec, tmp_path) -> None:
    """What Slurm does to a preempted job's steps (SIGTERM, then SIGKILL after its grace time), sent with
    ``scancel --signal=TERM <job>``: the agents stop their ranks and the attempt fails as a node loss."""
    steps, interval = 60, 10
    spec = _spec(write_spec, tmp_path, launcher="pdsh", steps=steps, interval=interval, name="alloc-preempt")
    proc = subprocess.Popen(_salloc(slurm_cluster, orch, "run", str(spec)), env={**slurm_cluster.env, **orch.env()},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        job_id = helpers_train.training_past(orch, interval + 2, ranks=NODES)
        slurm_job = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()[0]
        slurm_cluster.run(["scancel", "--signal=TERM", slurm_job])
        wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", 60, "FAILED", interval=0.1)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    cause = orch.json("status", job_id)["cause"]
    assert cause["kind"] == "node_lost" and "Slurm took" in cause["message"] and "SIGTERM" in cause["message"], cause
    assert_no_leftovers(job_id, timeout=15)
    slurm_cluster.wait_idle(60)
    r = slurm_cluster.run(_salloc(slurm_cluster, orch, "resume", job_id, nodes=4), timeout=400, check=False,
                          env=orch.env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = orch.json("status", job_id)
    assert done["state"] == "SUCCEEDED" and int(done["attempts"][1]["resume_tag"].removeprefix("step_")) >= interval
    # each attempt ran on its allocation's first NODES nodes, in Slurm's order (the rest spares), and the resumed one,
    # under the pdsh launcher, trained every rank to the last step with no traceback, and left nothing
    assert [a["nodes"] for a in done["attempts"]] == [slurm_cluster.names[:NODES]] * 2
    run_dir = Path(done["run_dir"])
    losses = helpers_train.attempt_losses(run_dir)
    assert [max(s for (r_, s) in losses if r_ == rank) for rank in range(NODES)] == [steps] * NODES
    assert "Traceback" not in (run_dir / "logs" / "rank-1.log").read_text()
    assert_no_leftovers(job_id, timeout=15)
