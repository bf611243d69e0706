"""Faults against the attempt's deadlines, on real processes: jobs that finish with a slow exit are not
taken for hung, a rank stuck before its first step (a torch extension build lock, in real DeepSpeed) fails
start-up naming what it waits on, and a SIGSTOPped rank is named, SIGKILLed and costs no grace period."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import helpers_train
from conftest import ROOT, SCRIPTS, assert_no_leftovers, job_processes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

WORKER = str(SCRIPTS / "worker.py")
EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "0"]


@pytest.mark.timing  # a 0.5 s hang_timeout: another test's load beside it could make a step look hung
def test_twenty_jobs_that_end_right_after_their_last_step_all_succeed(orch, server, write_spec, hostfile) -> None:
    """hang_timeout 0.5 s, and after its last step every rank spends 2 s in an atexit handler (an upload
    at exit): the watchdog fires in that time, the stacks show the ranks exiting, and they get more time."""
    spec = write_spec(name="finish", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=WORKER,
                      hang_timeout=0.5, stop_grace_seconds=2,
                      env={"WORKER_STEPS": "10", "WORKER_STEP_S": "0.05", "WORKER_EXIT_S": "2"})
    jobs = [orch.json("submit", str(spec))["id"] for _ in range(20)]

    def states() -> dict[str, str]:  # every job's state in one command (20 `orch status` took 10-20 s a round)
        return {j["id"]: j["state"] for j in orch.json("list", "--all")}
    ended = wait_for(lambda: (lambda s: s if all(s.get(j) in ("SUCCEEDED", "FAILED") for j in jobs) else None)(
        states()), 240, "20 jobs ended", interval=1)
    failed = {j: orch.json("status", j)["cause"] for j in jobs if ended[j] != "SUCCEEDED"}
    assert not failed, failed
    dismissed = [j for j in jobs if orch.events(j, "hang_dismissed")]
    assert dismissed, "the watchdog never fired: the test did not test the exit window"
    for j in dismissed:
        (e, *_) = orch.events(j, "hang_dismissed")
        assert all("exiting" in (d or "") for d in e.data["doing"].values()), e.data
    print(f"\n[finish] 20/20 SUCCEEDED; the watchdog fired in the exit window of {len(dismissed)} and was dismissed")
    for j in jobs:
        assert_no_leftovers(j, timeout=10)


def test_a_build_lock_that_never_goes_fails_the_preflight_naming_it(orch, write_spec, hostfile, tmp_path) -> None:
    """The lock of the op every DeepSpeed rank loads at start (deepspeed_shm_comm), in a private extensions dir,
    is young, so the build_locks check lets it be; the preflight's build of the op waits on it until its
    deadline (startup_timeout) and names it: no rank is started to wait on it."""
    helpers_train.prebuild_ops()
    ext = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    private = tmp_path / "ext"
    os.system(f"cp -a {ext} {private}")
    locks = [p.parent / "lock" for p in private.rglob("build.ninja") if p.parent.name.startswith("deepspeed_shm_comm")]
    assert locks, list(private.rglob("*"))[:20]
    for lock in locks:
        lock.write_text("")
    startup = 10
    spec = write_spec(name="lock", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), workdir=str(EXAMPLES),
                      entrypoint="train_gpt.py", args=["--steps", "20", *TINY],
                      deepspeed_config=str(EXAMPLES / "ds_zero2.json"), startup_timeout=startup,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(private)},
                      stop_grace_seconds=3)
    t0 = time.monotonic()
    r = orch("run", str(spec), timeout=240)
    took = time.monotonic() - t0
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    cause = detail["cause"]
    print(f"\n[startup] FAILED after {took:.1f} s (startup_timeout {startup} s): {cause['message']}")
    assert r.returncode == 1 and cause["kind"] == "preflight_failed", cause
    assert {f["check"] for f in cause["failures"]} == {"ops"} and cause["nodes"] == ["node-0", "node-1"], cause
    assert f"deepspeed_shm_comm failed to build: the build did not finish within {startup} s and was stopped: " \
           f"it waited on the build lock {locks[0]}, which did not go" in cause["message"], cause["message"]
    assert orch.events(job["id"], "ranks_started") == []  # no rank was started to wait on it
    assert all(lock.exists() for lock in locks)  # not ours: left for whoever holds it
    assert_no_leftovers(job["id"], timeout=10)


def test_a_stopped_rank_is_named_killed_at_once_and_costs_no_grace(orch, write_spec, hostfile, tmp_path) -> None:
    """SIGSTOP one rank of a 2-node job (hang_timeout 3 s, grace 30 s): the cause says it is stopped, and
    the attempt's processes are gone well within the grace period (SIGKILL for it, SIGCONT+SIGTERM for the rest)."""
    ready = tmp_path / "ready"
    spec = write_spec(name="stopped", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=WORKER,
                      hang_timeout=3, stop_grace_seconds=30,
                      env={"WORKER_STEPS": "100000", "WORKER_STEP_S": "0.05", "WORKER_READY_DIR": str(ready)})
    proc = orch.popen("run", str(spec))
    try:
        wait_for(lambda: len(list(ready.glob("*.ready"))) == 2, 60, "2 ranks running")
        (job,) = orch.json("list")
        wait_for(lambda: all((r.get("step") or 0) > 3 for r in orch.json("status", job["id"])["ranks"]), 30, "steps")
        rank1 = next(p for p in job_processes(job["id"], running="worker.py") if p.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    cause = orch.json("status", job["id"])["cause"]
    print(f"\n[stopped] FAILED and every process gone {took:.1f} s after SIGSTOP: {cause['message']}")
    assert cause["kind"] == "no_progress" and 1 in cause["ranks"], cause
    assert "rank 1: stopped by a signal (SIGSTOP or SIGTSTP)" in cause["message"], cause["message"]
    assert took < 3 + 10, took  # hang_timeout + dumps + stop, not the 30 s grace
    assert_no_leftovers(job["id"], timeout=5)


@pytest.fixture()
def small_disk(tmp_path):
    """A 24 MiB tmpfs: the state dir of a server whose disk fills up."""
    import subprocess
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_attempt_honestly_and_records_it_once_there_is_room(small_disk, write_spec, hostfile,
                                                                                   tmp_path) -> None:
    """The state dir's disk fills mid-training: the ranks are stopped (nothing can be recorded), the API says
    FAILED (store_full) with what is not recorded yet, a submit is 507 and the CLI says why, reads work;
    once space is freed the store catches up by itself."""
    import subprocess
    from conftest import Orch, running_server
    orch = Orch(small_disk / "state")
    ready = tmp_path / "ready"
    spec = write_spec(name="full", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=WORKER,
                      stop_grace_seconds=2,
                      env={"WORKER_STEPS": "1000000", "WORKER_STEP_S": "0.01", "WORKER_READY_DIR": str(ready)})
    with running_server(orch) as (proc, url):
        job = orch.json("submit", str(spec))["id"]
        wait_for(lambda: len(list(ready.glob("*.ready"))) == 2, 60, "2 ranks running")
        filler = small_disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
        t0 = time.monotonic()
        http = orch.http()
        detail = wait_for(lambda: (lambda d: d if d["state"] == "FAILED" else None)(
            http.get(f"{url}/api/jobs/{job}").json()), 120, "FAILED")
        print(f"\n[disk full] attempt FAILED {time.monotonic() - t0:.1f} s after the disk filled: {detail['cause']['message']}")
        assert detail["cause"]["kind"] == "store_full" and "cannot be written" in detail["cause"]["message"]
        assert "not recorded yet" in detail["unrecorded"]
        assert_no_leftovers(job, timeout=30)
        r = orch("submit", str(spec))
        assert r.returncode == 2 and "cannot be written" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert orch("list").returncode == 0
        assert proc.poll() is None
        filler.unlink()
        stored = wait_for(lambda: (lambda d: d if d["state"] == "FAILED" and d["attempts"][0]["stopped_at"] else None)(
            orch.json("status", job)), 30, "the store to catch up")
        assert stored["cause"]["kind"] == "store_full" and stored["attempts"][0]["stopped_at"]
        assert "unrecorded" not in http.get(f"{url}/api/jobs/{job}").json()
