"""Hang detection (the spec's ``hang_timeout``): one rank of a real 2-node ZeRO-2 job blocks
forever before a collective (examples/train_gpt.py --hang-at-step); the attempt fails with
"no progress" within hang_timeout + 5 s, not after gloo's 30-minute collective timeout, and
every rank's stacks (py-spy) show where it was."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import helpers_train
from conftest import ROOT, assert_no_leftovers, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0", "--checkpoint-interval", "0"]
HANG_TIMEOUT = 5


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    helpers_train.prebuild_ops()


def test_a_rank_that_blocks_fails_the_attempt_with_its_stacks(orch, write_spec, hostfile) -> None:
    spec = write_spec(name="hang", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")),
                      workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                      args=["--steps", "100000", "--hang-at-step", "30", "--hang-rank", "1", "--no-report", *TINY],
                      deepspeed_config=str(EXAMPLES / "ds_zero2.json"), hang_timeout=HANG_TIMEOUT,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, stop_grace_seconds=3)
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 30, "the job")
        run_dir = Path(wait_for(lambda: orch.json("status", job_id).get("run_dir"), 30, "the run dir"))
        log1 = run_dir / "logs" / "rank-1.log"
        wait_for(lambda: log1.exists() and "[hang] rank=1" in log1.read_text(), 180, "rank 1 to hang")
        hung = time.monotonic()
        wait_for(lambda: orch.json("status", job_id)["state"] == "FAILED", HANG_TIMEOUT + 30, "FAILED")
        took = time.monotonic() - hung
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    detail = orch.json("status", job_id)
    cause = detail["cause"]
    print(f"\n[hang] FAILED {took:.1f} s after rank 1 hung (hang_timeout {HANG_TIMEOUT} s): {cause['message']}")
    assert proc.returncode == 1
    assert cause["kind"] == "no_progress" and cause["message"].startswith("no progress: ")
    assert took < HANG_TIMEOUT + 5, took
    assert cause["steps"] == {"0": 30, "1": 30}  # both stopped at step 30: rank 0 waits in its all-reduce
    assert sorted(cause["stacks"]) == ["0", "1"]
    stacks = {r: Path(p).read_text() for r, p in cause["stacks"].items()}
    assert "hang_forever" in stacks["1"] and "train_gpt.py" in stacks["1"], stacks["1"][:2000]
    assert "hang_forever" not in stacks["0"] and re.search(r"all_reduce|allreduce|backward|wait", stacks["0"]), \
        stacks["0"][:2000]
    assert f"cause: {cause['message']}" in " ".join(out.split())
    # every rank found stuck by its dump (rank 1 in its own code, rank 0 in the collective it waits in) is
    # SIGKILLed once the stacks are dumped, with no grace period: neither would finish on SIGTERM
    assert cause["kill"] == [0, 1]
    exits = {e.data["global_rank"]: e.data for e in orch.events(job_id, "rank_exit")}
    assert exits[1]["returncode"] == -9 and exits[1]["how"] == "signal SIGKILL", exits
    assert orch.events(job_id, "silence_wait") == []  # every rank's exit was known: no node was waited for
    assert_no_leftovers(job_id, timeout=5)
