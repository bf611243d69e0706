"""A server that finds the RUNNING job of a dead ``orch server`` whose re-attach window has passed: it takes over
nothing, fails the job with ``controller_lost`` and schedules its restart (the controller's own trouble), in the
server's own process, with the store written as the dead server left it (``Controller.recover``,
``supervision/reattach.take_over``). The real thing, a killed server and a real DeepSpeed job, is
tests/test_recovery.py's timing test (whose next server may find the job already failed by a command instead);
the last test here starts a real ``orch server`` on such a store."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest
from conftest import assert_no_leftovers, running_server, wait_for

from orchestrator.errors import ProvisionError
from orchestrator.provisioners import LocalProvisioner
from orchestrator.spec import spec_from_dict
from orchestrator.store import JobState, Store
from orchestrator.supervision import Controller
from orchestrator.supervision.reattach import awaiting_reattach, take_over


class RefusingProvisioner(LocalProvisioner):
    """Would start no agent: a restart that got this far fails instead of starting processes."""

    def provision(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - any signature
        raise ProvisionError("this test starts no agent", reason="test")


def _dead_server_s_running_job(tmp_path, window_s: float = 60.0, last_alive_ago_s: float = 600.0) -> tuple:
    """The store as a server killed mid-job leaves it: a RUNNING job owned by a server that is gone (this
    process's pid with another start time), its alive file last touched ``last_alive_ago_s`` ago."""
    state = tmp_path / "state"  # (the ``state_dir`` fixture's, when a test also has one)
    state.mkdir(mode=0o700, exist_ok=True)
    state.chmod(0o700)
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = spec_from_dict({"name": "lost", "entrypoint": "train.py", "workdir": str(tmp_path),
                           "hostfile": None, "restart": {"max_restarts": 1, "backoff_seconds": 60}},
                          source="test")
    me = psutil.Process()
    alive = state / "controller-999999.alive"
    alive.touch()
    then = time.time() - last_alive_ago_s
    os.utime(alive, (then, then))
    owner = {"pid": me.pid, "host": socket.gethostname(), "create_time": me.create_time() - 1000,
             "url": "http://127.0.0.1:9", "reattach_s": window_s, "alive": str(alive)}
    store = Store(state / "orch.db")
    job = store.create_job("lost-1a2b3c", "lost", spec.to_dict(), owner=owner)
    store.set_state(job.id, JobState.PROVISIONING)
    store.add_attempt(job.id, 1, {"world_size": 1, "nodes": [{
        "host": "localhost", "node_rank": 0, "log_dir": str(tmp_path / "logs"),
        "ranks": [{"global_rank": 0, "local_rank": 0, "slot": 0}]}]},
        None)
    store.set_state(job.id, JobState.RUNNING)
    return state, store, job.id


def test_a_dead_server_s_job_whose_window_passed_is_not_taken_over(tmp_path) -> None:
    """take_over gives None (nothing to re-attach to: the agents stopped the ranks when the window passed)
    without asking for a provisioner; inside the window it would try."""
    _state, store, job_id = _dead_server_s_running_job(tmp_path)
    job = store.get_job(job_id)
    assert awaiting_reattach(job) == 0.0

    def no_provisioner(name, spec):  # noqa: ANN001, ANN202
        raise AssertionError("a job whose window passed needs no provisioner")
    assert take_over(store, job, None, {}, no_provisioner) is None
    assert store.get_job(job_id).state == JobState.RUNNING  # (failing it is recover_orphans' part)
    store.close()


def test_the_next_server_fails_the_dead_server_s_job_and_schedules_its_restart(tmp_path) -> None:
    """A server controller's ``recover()`` at its start: the job (window passed) becomes FAILED with
    ``controller_lost`` naming the dead server, it is returned as recovered, and its restart is scheduled
    whatever its policy's backoff (the controller's own trouble: at most 5 s) and owned by this server, which
    is busy with it; closing the server calls the restart off."""
    state, store, job_id = _dead_server_s_running_job(tmp_path)
    store.close()
    controller = Controller(state, owner_url="http://127.0.0.1:10",
                            provisioner_factory=lambda name, spec: RefusingProvisioner())
    try:
        assert controller.recover() == [job_id]
        job = controller.get(job_id)
        assert job.state == JobState.FAILED and job.cause["kind"] == "controller_lost", job.cause
        assert job.cause["server"] == "http://127.0.0.1:9"
        (scheduled,) = [e.data for e in controller.store.events(job_id) if e.kind == "restart_scheduled"]
        assert scheduled["controller_fault"] and scheduled["cause_kind"] == "controller_lost"
        assert 0 < scheduled["in_seconds"] <= 5.0
        assert controller.busy(job_id) and controller.get(job_id).owner["url"] == "http://127.0.0.1:10"
        assert controller.recover() == []  # decided once: a later look restarts nothing more
    finally:
        controller.close(timeout=10)
    kinds = [e.kind for e in Store(state / "orch.db").events(job_id)]
    assert kinds.count("restart_scheduled") == 1 and "restart_called_off" in kinds, kinds


@pytest.mark.integration
def test_orch_server_on_a_dead_server_s_store_says_so_and_its_restart_succeeds(orch, tmp_path) -> None:
    """A real ``orch server`` started on that store says, before it serves, which job's controller had gone away,
    how it marked it and that it is restarted; the restart (attempt 2: the spec's one local rank) succeeds."""
    state, store, job_id = _dead_server_s_running_job(tmp_path)
    store.close()
    assert state == orch.state_dir
    with running_server(orch) as (proc, _url):
        assert f"job {job_id}: its controller had gone away; marked FAILED (it is restarted)\n" in \
            proc.startup_lines, proc.startup_lines
        wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 60, "the restart to succeed")
        detail = orch.json("status", job_id)
        assert [a["state"] for a in detail["attempts"]] == ["FAILED", "SUCCEEDED"], detail["attempts"]
        assert_no_leftovers(job_id, timeout=10)
