"""Integration: ``provisioner: slurm`` from a login node, on the real Slurm test cluster (tests/slurmcluster.py).

The controller runs here, in the root namespace, outside any allocation (no ``SLURM_JOB_ID``): each
attempt asks Slurm for its nodes with ``sbatch`` and waits while Slurm queues it. Shown, with a
blocker job holding every CPU so the request really queues: the job is PENDING with Slurm's reason,
then runs ZeRO-2 training to completion once the blocker ends (ranks under native srun, a step of the
allocation orch got), and the allocation is gone after; a
job submitted to an ``orch server`` on the login node and cancelled while queued (the dashboard saying
why it waits) is an ``scancel`` Slurm sees; a node set DOWN mid-training is a node loss whose
automatic restart asks Slurm again without that node and finishes from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, assert_no_leftovers, running_server, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
#: nodes of every job (of the cluster's 4)
NODES = 2
JOB_STATE_JS = "const h = document.querySelector('#job-header'); return h && h.dataset.state;"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def _spec(write_spec, tmp_path: Path, *, steps: int, interval: int = 0, name: str, pace_ms: float = 0,
          **extra) -> Path:
    """The module's ZeRO-2 job; ``pace_ms`` > 0: each step that long at least (a job left running, on idle cores)."""
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    args = ["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY]
    if pace_ms:
        args += ["--pace-ms", f"{pace_ms:g}"]
    fields = dict(name=name, provisioner="slurm", num_nodes=NODES, launcher="pdsh", workdir=str(EXAMPLES),
                  entrypoint="train_gpt.py", args=args,
                  deepspeed_config=config, checkpoint_dir=str(tmp_path / f"ckpt-{name}"), stop_grace_seconds=5,
                  env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, env_passthrough=["TORCH_EXTENSIONS_DIR"],
                  slurm={"sbatch_args": "--time=30"})
    fields.update(extra)
    return write_spec(**fields)


def _login_env(cluster, orch) -> dict[str, str]:
    """A login node's environment: Slurm's configuration, no allocation."""
    return {k: v for k, v in {**cluster.env, **orch.env()}.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _squeue(cluster) -> dict[str, tuple[str, str]]:
    """Every Slurm job: name -> (job id, state)."""
    out = cluster.run(["squeue", "-h", "-o", "%j|%i|%T"]).stdout
    return {name: (job, state) for name, job, state in (line.split("|") for line in out.splitlines() if line)}


def _orch_run(cluster, orch, spec: Path) -> subprocess.Popen:
    return subprocess.Popen(orch.cmd("run", str(spec), "--output", "json"), env=_login_env(cluster, orch),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _block(cluster) -> str:
    """A job holding every CPU of every node (2 each), so the next request queues; its id."""
    n = len(cluster.names)
    return cluster.run(["sbatch", "--parsable", "-N", str(n), "--ntasks-per-node=2", "--job-name=blocker",
                        "--output=/dev/null", "--wrap", "sleep 600"]).stdout.strip()


def test_queued_behind_a_busy_cluster_then_trains_and_releases(slurm_cluster, orch, write_spec, tmp_path) -> None:
    blocker = _block(slurm_cluster)
    wait_for(lambda: _squeue(slurm_cluster).get("blocker", ("", ""))[1] == "RUNNING", 30, "the blocker running")
    spec = _spec(write_spec, tmp_path, steps=20, name="login-queued", launcher="slurm", launch_mode="native")
    proc = _orch_run(slurm_cluster, orch, spec)
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        name = f"orch-{job_id}-1"
        wait_for(lambda: _squeue(slurm_cluster).get(name, ("", ""))[1] == "PENDING", 30, "the request queued")
        time.sleep(3)  # it stays queued while the blocker runs
        detail = orch.json("status", job_id)
        assert detail["state"] == "PENDING" and _squeue(slurm_cluster)[name][1] == "PENDING", detail
        # Slurm says "None" until its scheduler has looked at the job (seen on a loaded machine), then why it waits
        detail = wait_for(lambda: (lambda d: d if d["allocation"]["reason"] != "None" else None)(
            orch.json("status", job_id)), 30, "Slurm's reason for the wait")
        alloc = detail["allocation"]
        assert detail["state"] == "PENDING" and alloc["state"] == "PENDING", alloc
        assert alloc["reason"] in ("Resources", "Priority"), alloc
        assert alloc["slurm_job"] == _squeue(slurm_cluster)[name][0]
        text = orch("status", job_id).stdout
        assert f"waiting for Slurm: Slurm job {alloc['slurm_job']} PENDING ({alloc['reason']})" in text, text
        slurm_cluster.run(["scancel", blocker])
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_cluster.run(["scancel", blocker], check=False)
    detail = json.loads(out)
    print("\n[slurm login] " + "\n[slurm login] ".join(line for line in err.splitlines() if "Slurm" in line))
    assert proc.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), err[-3000:])
    assert "(Resources)" in err or "(Priority)" in err, err  # orch run said why it waits
    assert len(detail["nodes"]) == NODES and set(detail["nodes"]) <= set(slurm_cluster.names)
    granted = [e for e in orch.events(job_id, "allocation") if e.data["state"] == "RUNNING"]
    assert len(granted) == 1 and granted[0].data["waited_s"] >= 3
    losses = helpers_train.attempt_losses(Path(detail["run_dir"]))
    assert [max(s for (r_, s) in losses if r_ == rank) for rank in range(NODES)] == [20] * NODES
    wait_for(lambda: _squeue(slurm_cluster).get(name, ("", "gone"))[1] != "RUNNING", 30, "the allocation released")
    assert_no_leftovers(job_id, timeout=15)


def test_submitted_to_a_server_queued_shown_and_cancelled(slurm_cluster, orch, write_spec, tmp_path, browser,
                                                          monkeypatch) -> None:
    """``orch server`` on the login node, ``orch submit``: the dashboard says why the job waits, and
    ``orch cancel`` while queued is an ``scancel`` Slurm sees."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    blocker = _block(slurm_cluster)
    try:
        with running_server(orch) as (server, url):
            r = orch("submit", str(_spec(write_spec, tmp_path, steps=5, name="login-cancel")), "--server", url,
                     "--output", "json")
            assert r.returncode == 0, r.stderr
            job_id = json.loads(r.stdout)["id"]
            name = f"orch-{job_id}-1"
            wait_for(lambda: _squeue(slurm_cluster).get(name, ("", ""))[1] == "PENDING", 30, "the request queued")
            browser.get(server.login_url)
            browser.get(f"{url}/#/jobs/{job_id}")
            slurm_job = _squeue(slurm_cluster)[name][0]
            line = "const w = document.querySelector('#job-waiting'); return w ? w.textContent : '';"
            wait_for(lambda: browser.execute_script(line).startswith(f"waiting for Slurm: Slurm job {slurm_job} PENDING"),
                     15, "the dashboard's waiting line")
            assert browser.execute_script(JOB_STATE_JS) == "PENDING"
            r = orch("cancel", job_id, "--server", url)
            assert r.returncode == 0, r.stderr
            wait_for(lambda: orch.json("status", job_id, "--server", url)["state"] == "CANCELLED", 30, "CANCELLED")
            wait_for(lambda: _squeue(slurm_cluster).get(name, ("", "CANCELLED"))[1] in ("CANCELLED", "COMPLETING"),
                     15, "Slurm to see the scancel")
            detail = orch.json("status", job_id, "--server", url)
            assert detail["attempts"] == [] and detail["cause"]["kind"] == "cancelled", detail
            wait_for(lambda: browser.execute_script(JOB_STATE_JS) == "CANCELLED", 15, "the dashboard's CANCELLED")
            assert not browser.execute_script("return document.querySelector('#job-waiting')")
            # it never ran: a resume asks Slurm again, and runs once the blocker is gone
            r = orch("resume", job_id, "--server", url)
            assert r.returncode == 0 and "waits for the nodes it asked Slurm for" in r.stdout, r.stdout + r.stderr
            wait_for(lambda: _squeue(slurm_cluster).get(name, ("", ""))[1] == "PENDING", 30, "the new request queued")
            slurm_cluster.run(["scancel", blocker])
            wait_for(lambda: orch.json("status", job_id, "--server", url)["state"] == "SUCCEEDED", 240, "SUCCEEDED")
    finally:
        slurm_cluster.run(["scancel", blocker], check=False)
    slurm_cluster.wait_idle(60)


def test_a_node_set_down_restarts_in_a_new_allocation_without_it(slurm_cluster, orch, write_spec, tmp_path) -> None:
    steps, interval = 60, 10
    spec = _spec(write_spec, tmp_path, steps=steps, interval=interval, name="login-down",
                 restart={"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True})
    proc = _orch_run(slurm_cluster, orch, spec)
    try:
        job_id = helpers_train.training_past(orch, interval + 2, ranks=NODES, timeout=240)
        first = orch.json("status", job_id)["nodes"]
        down = first[1]
        t_down = time.time()
        slurm_cluster.set_state(down, "DOWN", "orch test")
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = json.loads(out)
    states = [(e.attempt, e.data["to"], e.at) for e in orch.events(detail["id"], "state")]
    failed = next(at for a, to, at in states if a == 1 and to == "FAILED")
    running = next(at for a, to, at in states if a == 2 and to == "RUNNING")
    print(f"\n[slurm login down] node DOWN -> FAILED {failed - t_down:.2f} s; FAILED -> attempt 2 RUNNING in a new "
          f"allocation {running - failed:.2f} s")
    try:
        assert detail["state"] == "SUCCEEDED", (detail.get("cause"), err[-3000:])
        one, two = detail["attempts"]
        # Slurm ends every step of the allocation at once: the down node is named (from scontrol) whichever agent's
        # SIGTERM or closed link came first
        assert one["cause"]["kind"] == "node_lost" and one["cause"]["node"] == down, one["cause"]
        assert down not in two["nodes"] and len(two["nodes"]) == NODES, two["nodes"]
        assert int(two["resume_tag"].removeprefix("step_")) >= interval
        argv = [e.data["command"] for e in orch.events(job_id, "allocation") if e.data["state"] == "SUBMITTED"]
        assert len(argv) == 2 and f"--exclude={down}" in argv[1] and not any("--exclude" in a for a in argv[0])
        assert_no_leftovers(job_id, timeout=15)
    finally:
        if slurm_cluster.node_state(down).startswith(("down", "drain")):
            slurm_cluster.set_state(down, "RESUME")
        slurm_cluster.wait_idle(60)


def test_a_controller_that_dies_leaves_no_allocation(slurm_cluster, orch, write_spec, tmp_path) -> None:
    """``orch run`` SIGKILLed mid-training: its agents' srun steps lose their link and stop the ranks, and the
    batch script, with no agent step left, ends the allocation by itself (``ORCH_SLURM_IDLE_S``: 6 s here)."""
    spec = _spec(write_spec, tmp_path, steps=100_000, name="login-killed", pace_ms=50)
    proc = subprocess.Popen(orch.cmd("run", str(spec)), env={**_login_env(slurm_cluster, orch), "ORCH_SLURM_IDLE_S": "6"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        wait_for(lambda: orch.json("status", job_id)["state"] == "RUNNING", 120, "RUNNING", interval=0.3)
        name = f"orch-{job_id}-1"
        end = time.monotonic() + 10  # longer than the idle time: the agents' steps keep the allocation
        while time.monotonic() < end:
            held, state = _squeue(slurm_cluster).get(name, ("", "gone"))[1], orch.json("status", job_id)["state"]
            assert (held, state) == ("RUNNING", "RUNNING"), (held, state, orch.events(job_id))
            time.sleep(1)
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        try:
            # one squeue answer per look: the job can leave squeue between two of them
            wait_for(lambda: _squeue(slurm_cluster).get(name, ("", "COMPLETED"))[1] == "COMPLETED",
                     60, "the allocation to end by itself")
        except AssertionError:
            steps = slurm_cluster.run(["squeue", "-h", "-s", "-o", "%i|%j|%T"]).stdout
            said = "".join(p.read_text() for p in Path(orch.json("status", job_id)["run_dir"]).glob("slurm-*.out"))
            raise AssertionError(f"the allocation is still held; steps:\n{steps}\nits batch script said:\n{said}")
        print(f"\n[slurm login] controller killed: allocation ended by itself after {time.monotonic() - t0:.1f} s")
        assert_no_leftovers(job_id, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_cluster.wait_idle(60)


def test_a_request_slurm_cannot_meet_says_so_and_times_out(slurm_cluster, orch, write_spec, tmp_path) -> None:
    spec = _spec(write_spec, tmp_path, steps=5, name="login-toobig", num_nodes=len(slurm_cluster.names) + 1,
                 slurm={"queue_timeout": 6})
    proc = _orch_run(slurm_cluster, orch, spec)
    out, err = proc.communicate(timeout=120)
    detail = json.loads(out)
    assert proc.returncode == 1 and detail["state"] == "FAILED", detail
    cause = detail["cause"]
    assert cause["kind"] == "allocation" and "PartitionNodeLimit" in cause["message"] and \
        "slurm.queue_timeout = 6 s" in cause["message"], cause
    assert "more nodes than the partition allows" in err and "it may never start as asked" in err, err
    assert detail["next_steps"] and "slurm.sbatch_args" in detail["next_steps"][0]
    wait_for(lambda: not any(n.startswith(f"orch-{detail['id']}") and st in ("PENDING", "RUNNING")
                             for n, (_, st) in _squeue(slurm_cluster).items()), 15, "the request cancelled")
