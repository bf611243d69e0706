"""Recovery from the controller's own death and from a crash in the middle of a checkpoint save,
with a real 2-node ZeRO-2 job (examples/train_gpt.py, local agents).

* ``kill -9`` of ``orch server`` mid-job, and the next server too late for the agents' window (1 s):
  the agents stop every rank, no job is lost from the store, and the next ``orch server`` fails the
  attempt with ``controller_lost`` and applies the job's restart policy: attempt 2 continues from the
  last complete checkpoint and succeeds.
* A rank killed while the checkpoint of step 15 is being written: the restart starts from
  ``step_10`` (never from the partial ``step_15``), says so, and every rank's loss at steps 11-15
  of attempt 2 equals attempt 1's.

A next server that comes in time re-attaches instead: the same rank processes train on, every step once, one
attempt. That is tested with local agents in tests/test_reattach.py (worker ranks, whose every step is counted),
with a gloo all-reduce rank over SSH on 3 hosts in tests/test_ssh.py and with DeepSpeed over SSH in the fault
matrix (controller_killed). The crash in a save is the fault matrix's save_crash, which tests/test_fault_matrix.py
leaves to this module.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

import helpers_train
from conftest import ROOT, assert_no_leftovers, job_processes, running_server, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "5"]
TRAIN = re.compile(r"\[train\] step=(\d+) rank=(\d+) loss=(\S+)")


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def _fields(hostfile, name: str, args: list[str], **extra) -> dict:
    return {"name": name, "hostfile": str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), "workdir": str(EXAMPLES),
            "entrypoint": "train_gpt.py", "args": [*args, *TINY], "deepspeed_config": str(EXAMPLES / "ds_zero2.json"),
            "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, "stop_grace_seconds": 3, **extra}


def _losses(orch, job_id: str, attempt: int) -> dict[tuple[int, int], str]:
    """(step, rank) -> loss text, from every rank's log of one attempt."""
    found = {}
    for rank in (0, 1):
        log = orch("logs", job_id, "--rank", str(rank), "--attempt", str(attempt)).stdout
        found.update({(int(s), int(r)): v for s, r, v in TRAIN.findall(log)})
    return found


@pytest.mark.timing
def test_a_killed_server_s_job_is_restarted_by_the_next_server(orch, write_spec, hostfile, monkeypatch) -> None:
    monkeypatch.setenv("ORCH_AGENT_REATTACH_S", "1")  # the next server comes too late to re-attach
    spec = write_spec(**_fields(hostfile, "crash", ["--steps", "200"],
                                restart={"max_restarts": 1, "backoff_seconds": 0}))
    with running_server(orch) as (proc, url):
        job_id = orch.json("submit", str(spec))["id"]
        ckpt = Path(orch.json("status", job_id)["checkpoint_dir"])
        wait_for(lambda: (ckpt / "step_10" / "orch_checkpoint.json").exists(), 240, "checkpoint step_10")
        ranks = job_processes(job_id, running="train_gpt.py")
        assert len(ranks) == 2
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in ranks), 10,
                 "the agents to stop their ranks")  # (the 1 s window, then the grace)
        stopped = time.monotonic() - killed
        assert_no_leftovers(job_id, timeout=5)
    lost_step = max(s for s, _ in _losses(orch, job_id, 1))
    with running_server(orch):
        wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 300, "attempt 2 to succeed")
    detail = orch.json("status", job_id)
    first, second = detail["attempts"]
    assert first["state"] == "FAILED" and first["cause"]["kind"] == "controller_lost"
    assert first["cause"]["server"].startswith("http://127.0.0.1:")
    assert second["state"] == "SUCCEEDED"
    resumed_from = int(second["resume_tag"].split("_")[1])
    assert resumed_from >= 10 and resumed_from % 5 == 0 and resumed_from <= lost_step
    kinds = [e.kind for e in orch.events(job_id)]
    assert kinds.count("restart_scheduled") == 1
    after = _losses(orch, job_id, 2)
    assert min(s for s, _ in after) == resumed_from + 1 and max(s for s, _ in after) == 200
    print(f"\n[controller crash] ranks stopped {stopped:.2f} s after kill -9 of orch server; attempt 2 resumed "
          f"from {second['resume_tag']} (lost at step {lost_step})")
    assert stopped < 5
    assert_no_leftovers(job_id)


def test_a_crash_during_a_save_resumes_from_the_previous_complete_checkpoint(orch, write_spec, hostfile) -> None:
    spec = write_spec(**_fields(hostfile, "midsave", ["--steps", "20", "--crash-in-save-at-step", "15",
                                                      "--crash-rank", "1"],
                                restart={"max_restarts": 1, "backoff_seconds": 0}))
    r = orch("run", str(spec), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    first, second = detail["attempts"]
    assert first["cause"]["kind"] == "rank_exit" and first["cause"]["global_rank"] == 1
    assert second["resume_tag"] == "step_10"
    out = " ".join(r.stdout.split())
    assert "starts from checkpoint step_10; skipped step_15: no orch_checkpoint.json: the save did not finish" in out
    (pending,) = [e for e in orch.events(job["id"]) if e.kind == "state" and e.data.get("to") == "PENDING"]
    assert pending.data["resume_tag"] == "step_10"
    assert [s["tag"] for s in pending.data["skipped_checkpoints"]] == ["step_15"]
    before, after = _losses(orch, job["id"], 1), _losses(orch, job["id"], 2)
    assert min(s for s, _ in after) == 11
    for step in range(11, 16):  # attempt 2 redid steps 11-15 from step_10: exactly what attempt 1 computed
        for rank in (0, 1):
            assert after[(step, rank)] == before[(step, rank)], (step, rank)
    ckpt = Path(detail["checkpoint_dir"])
    assert (ckpt / "step_15" / "orch_checkpoint.json").exists()  # attempt 2 saved it again, completely
    assert_no_leftovers(job["id"])
