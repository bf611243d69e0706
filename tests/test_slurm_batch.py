"""The login-node allocation: the sbatch request (pure), the spec's ``slurm.sbatch_args``, and the controller's
queued attempt (cancel while queued, a refused request) with the scheduler replaced at the provisioner seam.
The real thing, on the Slurm test cluster: tests/test_slurm_login.py."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from conftest import wait_for

from orchestrator.errors import ProvisionError, SpecError
from orchestrator.provisioners import LocalProvisioner
from orchestrator.provisioners.slurm import SlurmProvisioner
from orchestrator.provisioners.slurm_batch import _gpus_per_node, batch_argv, hold_script
from orchestrator.spec import spec_from_dict
from orchestrator.store import JobState
from orchestrator.supervision import Controller
from orchestrator.supervision.queued import allocation_size


def test_batch_argv_asks_for_the_pool() -> None:
    argv = batch_argv("orch-j-1", 3, 2, "/r/slurm-%j.out", hosts=["n1", "n2", "n3"], exclude=["n4"],
                      sbatch_args=["--partition=gpu", "--time=10"])
    assert argv == ["sbatch", "--parsable", "--job-name=orch-j-1", "--nodes=3", "--ntasks-per-node=2",
                    "--nodelist=n[1-3]", "--exclude=n4", "--chdir=/tmp", "--output=/r/slurm-%j.out",
                    "--partition=gpu", "--time=10"]
    mine = batch_argv("x", 1, 1, "/r/o", sbatch_args=["-o", "/shared/%j.log"])
    assert not any(a.startswith("--output") for a in mine) and mine[-2:] == ["-o", "/shared/%j.log"]
    assert not any(a.startswith(("--nodelist", "--exclude")) for a in batch_argv("x", 2, 1, "/r/o"))


@pytest.mark.integration
def test_the_batch_script_holds_while_agents_run_and_not_on_a_failed_squeue(tmp_path) -> None:
    """The hold script run by sh with squeue replaced by a script (the scheduler seam): two failed calls, two
    that list an agent step, then none. Failures are not idleness; agent steps reset the count."""
    calls = tmp_path / "calls"
    (tmp_path / "squeue").write_text(f"""#!/bin/sh
n=$(($(cat {calls} 2>/dev/null || echo 0) + 1)); echo $n > {calls}
case $n in 1|2) exit 1;; 3|4) echo orch-agent-j-1-n1; echo hold;; *) echo hold;; esac
""")
    (tmp_path / "squeue").chmod(0o755)
    t0 = time.monotonic()
    said = subprocess.run(["sh", "-c", hold_script(2)], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                                                             "SLURM_JOB_ID": "7"}, timeout=60, check=True,
                          capture_output=True, text=True).stdout
    assert calls.read_text().strip() == "5", "two blind calls, two with an agent step, one idle period of 2 s"
    assert time.monotonic() - t0 >= 9
    assert [line.split(" ", 2)[2] for line in said.splitlines()] == [
        "squeue failed: ", "agent steps running", "no agent step: the allocation ends in 2 s unless one starts",
        "ending the allocation"], said


@pytest.mark.parametrize("args,gpus", [(["--gpus-per-node=8"], 8), (["--gpus-per-node", "a100:4"], 4),
                                       (["--gres=gpu:2"], 2), (["--gres=gpu:h100:8,shard:1"], 8),
                                       (["--time=5"], None)])
def test_gpus_per_node_read_from_the_request(args, gpus) -> None:
    assert _gpus_per_node(args) == gpus


def _spec(tmp_path, **fields):
    (tmp_path / "train.py").write_text("print('hi')\n")
    base = dict(name="q", entrypoint="train.py", workdir=str(tmp_path), provisioner="slurm", num_nodes=2)
    return spec_from_dict({**base, **fields}, source="test")


def test_sbatch_args_split_and_orch_owned_flags_refused(tmp_path) -> None:
    assert _spec(tmp_path, slurm={"sbatch_args": "--partition=gpu --time='1:00:00'"}).slurm.sbatch_args == [
        "--partition=gpu", "--time=1:00:00"]
    for bad, why in [("--nodes=4", "nodes from num_nodes"), ("-N4", "nodes from num_nodes"),
                     ("--ntasks-per-node=8", "ranks per node from num_gpus"), ("--job-name=x", "orch-<job id>"),
                     ("-w n1", "nodes from num_nodes"), ("--wrap=true", "its own script"), ("--array=1-2", "array"),
                     ("--test-only", "submit nothing"), ("-x n3", "exclude_hosts"), ("--exclude=n3", "exclude_hosts")]:
        with pytest.raises(SpecError, match=why):
            _spec(tmp_path, slurm={"sbatch_args": bad})
    assert _spec(tmp_path, slurm={"sbatch_args": "-o /shared/%j.out -D /shared --comment=x"}).slurm.sbatch_args[:2] == [
        "-o", "/shared/%j.out"]
    with pytest.raises(SpecError, match="queue_timeout"):
        _spec(tmp_path, slurm={"queue_timeout": 0})


def test_allocation_size_from_num_nodes_or_the_hostfile(tmp_path) -> None:
    assert allocation_size(_spec(tmp_path, num_gpus=4), lambda: []) == (2, 4, None)
    assert allocation_size(_spec(tmp_path), lambda: []) == (2, 1, None)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=4\n")
    pool = [("a", 2), ("b", 4)]
    assert allocation_size(_spec(tmp_path, hostfile=str(hostfile), num_nodes=-1), lambda: pool) == (2, 4, ["a", "b"])
    with pytest.raises(SpecError, match="num_nodes: outside a Slurm allocation"):
        allocation_size(_spec(tmp_path, num_nodes=-1), lambda: [])


def test_a_login_node_needs_sbatch_before_anything_is_stored(tmp_path) -> None:
    prov = SlurmProvisioner(env={"PATH": str(tmp_path)})  # no sbatch there
    assert prov.needs_allocation()
    with pytest.raises(ProvisionError, match="sbatch, which is not on PATH"):
        prov.check_allocation_request()
    controller = Controller(tmp_path / "state", provisioner_factory=lambda name, spec: prov)
    try:
        with pytest.raises(ProvisionError):
            controller.submit(_spec(tmp_path))
        assert controller.store.list_jobs() == []
    finally:
        controller.close()
    assert not SlurmProvisioner(env={"SLURM_JOB_ID": "7"}).needs_allocation()


class _Queue(LocalProvisioner):
    """A scheduler that queues until cancelled (``grant`` unset) or refuses (``refuse``)."""

    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.refuse = refuse
        self.asked: list[tuple] = []
        self.cancelled = threading.Event()

    def needs_allocation(self) -> bool:
        return True

    def check_allocation_request(self) -> None:
        pass

    def allocate(self, name, nodes, slots, output, hosts, exclude, note, cancelled):
        self.asked.append((name, nodes, slots, hosts, exclude))
        note("allocation", {"slurm_job": "9", "state": "PENDING", "reason": "Priority", "message": "queued"})
        if self.refuse:
            raise ProvisionError(self.refuse)
        cancelled.wait(30)
        self.cancelled.set()
        return None


def test_cancel_while_queued_cancels_the_request(tmp_path) -> None:
    queue = _Queue()
    controller = Controller(tmp_path / "state", provisioner_factory=lambda name, spec: queue)
    try:
        job = controller.submit(_spec(tmp_path, num_gpus=2))
        wait_for(lambda: queue.asked, 10, "the request")
        assert queue.asked == [(f"orch-{job.id}-1", 2, 2, None, [])]
        assert controller.busy(job.id) and controller.get(job.id).state == JobState.PENDING
        assert controller.store.attempts(job.id) == []
        controller.cancel(job.id)
        wait_for(lambda: not controller.busy(job.id), 10, "the cancel")
        assert queue.cancelled.is_set()
        done = controller.get(job.id)
        assert done.state == JobState.CANCELLED and done.cause["kind"] == "cancelled"
        assert [e.data["to"] for e in controller.store.events(job.id) if e.kind == "state"] == ["CANCELLED"]
    finally:
        controller.close()


def test_a_refused_request_fails_the_job_and_keeps_the_last_attempt(tmp_path) -> None:
    controller = Controller(tmp_path / "state", provisioner_factory=lambda name, spec: _Queue("sbatch: no partition"))
    try:
        job = controller.submit(_spec(tmp_path))
        wait_for(lambda: not controller.busy(job.id), 10, "the refusal")
        done = controller.get(job.id)
        assert done.state == JobState.FAILED and done.cause == {"kind": "allocation", "message": "sbatch: no partition"}
        assert done.attempt == 0 and controller.store.attempts(job.id) == []
    finally:
        controller.close()


def test_close_cancels_a_queued_attempt(tmp_path) -> None:
    queue = _Queue()
    controller = Controller(tmp_path / "state", provisioner_factory=lambda name, spec: queue)
    job = controller.submit(_spec(tmp_path))
    wait_for(lambda: queue.asked, 10, "the request")
    store_path = controller.state_dir / "orch.db"
    controller.close()
    assert queue.cancelled.is_set()
    from orchestrator.store import Store
    assert Store(store_path).get_job(job.id).state == JobState.CANCELLED


def test_ending_a_queued_attempt_leaves_the_last_attempt_as_it_was(tmp_path) -> None:
    from orchestrator.store import Store
    from orchestrator.supervision.orphans import waits_for_nodes
    store = Store(tmp_path / "orch.db")
    store.create_job("j", "j", {})
    assert waits_for_nodes(store, store.get_job("j"))  # submitted, nodes to come
    store.add_attempt("j", 1, {"nodes": []}, None)
    assert not waits_for_nodes(store, store.get_job("j"))  # attempt 1 is planned (PENDING before PROVISIONING)
    store.set_state("j", JobState.PROVISIONING)
    store.set_state("j", JobState.FAILED, cause={"kind": "node_lost", "message": "lost"})
    store.set_state("j", JobState.PENDING)  # a resume, queued for its nodes
    assert waits_for_nodes(store, store.get_job("j"))
    store.set_state("j", JobState.FAILED, cause={"kind": "allocation", "message": "refused"}, queued=True)
    job, first = store.get_job("j"), store.get_attempt("j", 1)
    assert job.cause["kind"] == "allocation" and job.attempt == 1
    assert first.state == JobState.FAILED and first.cause["kind"] == "node_lost"
    assert store.events("j")[-1].attempt == 2
