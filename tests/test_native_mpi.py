"""Integration: ``launch_mode: native`` under the real ``mpirun`` (Open MPI), ``mpiexec.hydra`` (MPICH), ``srun``.

ZeRO-2 training (examples/train_gpt.py, tiny, CPU/gloo) on two namespace hosts with sshd
(tests/helpers_mpi.py; a third and fourth are spares), one slot each, the ssh provisioner: node 0's agent
runs the real tool, which starts every rank (over its own ssh; srun through the test Slurm cluster's
slurmds, tests/slurmcluster.py); each node's agent adopts its ranks. Shown: training to completion
under the three tools natively (native mpirun's and srun's: the resumed attempts of the fault tests;
the emulated launchers train in tests/test_unchanged_scripts.py, openmpi and mpich, and
tests/test_slurm_provisioner.py, slurm inside an allocation); under native mpirun and native srun a
rank killed and a host lost are detected, leave no process on any host (ranks, agents, the tool's
own ``orted`` / ``hydra_pmi_proxy`` / ``slurmstepd``), and the job resumes from its last complete
checkpoint, natively again, and trains to completion.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, assert_no_leftovers, job_processes, wait_for

from helpers_mpi import native_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
#: nodes of every job: node 0 (whose agent runs the tool) and one it reaches over the tool's own ssh; the
#: hostfile's other hosts are spares
NODES = 2
#: the real tools' own processes: none may outlive a job
TOOL_PROCESSES = ("mpirun", "mpirun.openmpi", "orted", "mpiexec.hydra", "hydra_pmi_proxy", "srun", "slurmstepd")


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def _tool_processes(net) -> list[str]:
    """The real tools' processes on ``net``'s hosts (not another test's, on other hosts of this machine)."""
    out = []
    for i in range(len(net.names)):
        for pid in net.pids(i):
            try:
                p = psutil.Process(pid)
                if p.name() in TOOL_PROCESSES:
                    out.append(f"host {i}: {pid} {' '.join(p.cmdline())[:150]}")
            except psutil.NoSuchProcess:
                continue
    return out


def _spec(write_spec, mpi_hosts, tmp_path: Path, launcher: str, *, steps: int, interval: int = 0,
          name: str = "native", cluster=None, **extra) -> Path:
    net = mpi_hosts[0]
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if cluster is not None:  # srun on node 0 finds the test cluster (its env: the exports)
        env["SLURM_CONF"] = str(cluster.conf)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in net.names))  # 4 hosts, the last two spares
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    p = net.client_params()
    fields = dict(
        name=name, hostfile=str(hostfile), num_nodes=NODES, provisioner="ssh", launcher=launcher, launch_mode="native",
        launcher_args=[] if launcher == "slurm" else native_args(launcher, mpi_hosts), workdir=str(EXAMPLES),
        entrypoint="train_gpt.py",
        args=["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY], deepspeed_config=config,
        checkpoint_dir=str(tmp_path / f"ckpt-{name}"), env=env,
        env_passthrough=["TORCH_EXTENSIONS_DIR"], stop_grace_seconds=5,
        ssh={"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]})
    fields.update(extra)
    return write_spec(**fields)


def _steps(run_dir: Path, world: int) -> list[int]:
    losses = helpers_train.attempt_losses(run_dir)
    return [max((s for (r, s) in losses if r == rank), default=0) for rank in range(world)]


def _assert_clean(job_id: str, net) -> None:
    assert_no_leftovers(job_id, timeout=15)
    wait_for(lambda: not _tool_processes(net), 15, "the tool's own processes to end")


def _assert_launched(run_dir: Path, launcher: str) -> None:
    """The attempt of ``run_dir`` was started natively: node 0 ran the real tool, no other node ran one."""
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (run_dir / "logs" / "launcher.log").exists()  # node 0 ran the tool
    command = plan["nodes"][0]["native"]["command"]
    assert command["argv"][0] == {"slurm": "srun", "openmpi": "mpirun.openmpi", "mpich": "mpiexec.hydra"}[launcher]
    assert plan["nodes"][1]["native"]["command"] is None


# openmpi and slurm in native mode also train to completion in the kill and host-loss tests below: each of their
# resumed attempts is a native run that must succeed with every rank logging every step (_resume_and_finish)
def test_zero2_trains_to_completion_under_native_mpich(mpi_hosts, orch, write_spec, tmp_path) -> None:
    spec = _spec(write_spec, mpi_hosts, tmp_path, "mpich", steps=20, name="native-mpich")
    r = orch("run", str(spec), "--output", "json", timeout=400)
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    run_dir = Path(detail["run_dir"])
    assert _steps(run_dir, NODES) == [20] * NODES
    _assert_launched(run_dir, "mpich")
    _assert_clean(detail["id"], mpi_hosts[0])


def _wait_steps(orch, job_id: str, past: int, timeout: float = 180) -> Path:
    def run_dir() -> Path | None:
        d = orch.json("status", job_id)
        assert d["state"] not in ("FAILED", "SUCCEEDED", "CANCELLED"), d.get("cause")
        return Path(d["run_dir"]) if d["state"] == "RUNNING" and d.get("run_dir") else None
    path = wait_for(run_dir, 120, "the job RUNNING")
    wait_for(lambda: min(_steps(path, NODES)) > past, timeout, f"every rank past step {past}", interval=0.2)
    return path


def _rank_process(job_id: str, rank: int) -> psutil.Process:
    for p in job_processes(job_id):
        try:
            env = p.environ()
            if env.get("RANK") == str(rank) and "train_gpt.py" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no training process of rank {rank}")


def _fault_mid_training(orch, spec: Path, interval: int, inject) -> tuple[str, float]:
    """``orch run`` the spec, ``inject(job_id)`` once every rank is past its first checkpoint, wait for
    FAILED; the job's id and the seconds from the fault to FAILED."""
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        _wait_steps(orch, job_id, past=interval + 2)
        t0 = time.monotonic()
        inject(job_id)
        wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", 30, "FAILED", interval=0.05)
        detect_s = time.monotonic() - t0
        proc.communicate(timeout=60)
        assert proc.returncode == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return job_id, detect_s


def _resume_and_finish(orch, job_id: str, steps: int, launcher: str, *extra: str) -> dict:
    """``orch resume`` the job: its second attempt, started natively by ``launcher``, trains every rank from
    the tag after the first's last complete checkpoint to ``steps`` and succeeds."""
    r = orch("resume", job_id, *extra, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = orch.json("status", job_id)
    assert done["state"] == "SUCCEEDED" and [a["state"] for a in done["attempts"]] == ["FAILED", "SUCCEEDED"]
    tag = done["attempts"][1]["resume_tag"]
    start = int(tag.removeprefix("step_"))
    assert start > 0
    losses = helpers_train.attempt_losses(Path(done["run_dir"]))
    for rank in range(NODES):
        assert sorted(s for (r_, s) in losses if r_ == rank) == list(range(start + 1, steps + 1))
    _assert_launched(Path(done["run_dir"]), launcher)
    return done


@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_native_rank_killed_is_detected_and_resumable(launcher, mpi_hosts, slurm_cluster, orch, write_spec,
                                                      tmp_path) -> None:
    steps, interval = 60, 10
    spec = _spec(write_spec, mpi_hosts, tmp_path, launcher, steps=steps, interval=interval, name=f"kill-{launcher}",
                 cluster=slurm_cluster if launcher == "slurm" else None)
    job_id, detect_s = _fault_mid_training(orch, spec, interval,
                                           lambda job: _rank_process(job, 1).send_signal(signal.SIGKILL))
    cause = orch.json("status", job_id)["cause"]
    print(f"\n[native {launcher}] rank 1 SIGKILLed: FAILED after {detect_s:.2f} s; cause: {cause['message']}")
    assert cause["kind"] == "rank_exit" and cause["global_rank"] == 1 and "SIGKILL" in cause["message"], cause
    assert detect_s < 5
    _assert_clean(job_id, mpi_hosts[0])
    _resume_and_finish(orch, job_id, steps, launcher)
    _assert_clean(job_id, mpi_hosts[0])


@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_native_host_lost_is_detected_and_resumes_on_the_spare(launcher, mpi_hosts, slurm_cluster, orch, write_spec,
                                                               tmp_path) -> None:
    steps, interval, victim = 60, 10, 1
    net = mpi_hosts[0]
    spec = _spec(write_spec, mpi_hosts, tmp_path, launcher, steps=steps, interval=interval, name=f"lost-{launcher}",
                 cluster=slurm_cluster if launcher == "slurm" else None)
    try:
        job_id, detect_s = _fault_mid_training(orch, spec, interval, lambda job: net.kill_host(victim))
    finally:
        net.reset()  # which kills every slurmd too
        slurm_cluster.restart_dead()
    detail = orch.json("status", job_id)
    cause = detail["cause"]
    print(f"\n[native {launcher}] host {net.names[victim]} killed: FAILED after {detect_s:.2f} s; "
          f"cause: {cause['message']}")
    assert cause["kind"] == "node_lost" and cause["node"] == net.names[victim], cause
    assert detect_s < 5
    _assert_clean(job_id, mpi_hosts[0])
    done = _resume_and_finish(orch, job_id, steps, launcher, "--exclude", net.names[victim])
    assert done["attempts"][1]["nodes"] == [net.names[0], net.names[2]]
    _assert_clean(job_id, mpi_hosts[0])
