"""Real DeepSpeed ZeRO training through orch: every stage, offload, kill a rank, resume exactly.

The job is examples/train_gpt.py (a byte-level GPT on the CPython standard library's
source) on 2 local "nodes", DS_ACCELERATOR=cpu with gloo. The model is shrunk by flags so
each launch is dominated by start-up (Python, torch and DeepSpeed imports), not training.

Each stage's uninterrupted run is the session's shared one (``zero_run``, tests/zero_runs.py:
60 steps, a checkpoint every 10, 2 nodes x 2 slots at ZeRO-2, else x 1, plus DeepSpeed's
consolidated model at the end, which tests/test_export.py compares its export with). It is both
what test_zero_stage_trains_across_two_nodes checks and what the kill-and-resume test's resumed
losses must equal: the victim is a job of the same spec (zero_runs.zero_spec) in a state dir of
its own, killed and resumed there; the shared run is only read.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import pytest

from conftest import assert_no_leftovers, wait_for
from orchestrator.checkpoints import inspect_tag

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402
import zero_runs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

REL_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    """Build (first time: minutes) or load DeepSpeed's CPU ops once, not in every rank at once."""
    helpers_train.prebuild_ops()


#: the job of every test (tests/zero_runs.py): STEPS steps, a checkpoint every INTERVAL
STEPS, INTERVAL = zero_runs.STEPS, zero_runs.INTERVAL


def _losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """``{(rank, step): loss}`` from every rank's log of one attempt."""
    return helpers_train.attempt_losses(run_dir)


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "2_offload"])
def test_zero_stage_trains_across_two_nodes(zero_run, stage) -> None:
    slots = zero_runs.slots(stage)
    run = zero_run(stage)
    orch, r, leftovers = run.orch, run.result, run.leftovers
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    world = 2 * slots
    assert [x["step"] for x in detail["ranks"]] == [STEPS] * world
    losses = _losses(Path(detail["run_dir"]))
    assert sorted(losses) == [(rank, step) for rank in range(world) for step in range(1, STEPS + 1)]
    assert all(math.isfinite(v) and 0 < v < 10 for v in losses.values())
    want_stage = 2 if stage == "2_offload" else stage
    for tag in (f"step_{s}" for s in range(INTERVAL, STEPS + 1, INTERVAL)):
        info = inspect_tag(Path(detail["checkpoint_dir"]) / tag)
        assert info.complete, info.problems
        assert (info.zero_stage, info.world_size, info.step) == (want_stage, world, int(tag[5:]))
    for rank in range(world):
        log = (Path(detail["run_dir"]) / "logs" / f"rank-{rank}.log").read_text()
        setup = next(line for line in log.splitlines() if line.startswith("[setup]"))
        assert f" zero_stage={want_stage} " in setup and f" world_size={world} " in setup
        assert f" node_rank={rank // slots} " in setup
        assert ("/DeepSpeedCPUAdam " in setup) == (stage == "2_offload"), setup
    assert leftovers == [], leftovers  # within 1 s of orch run's return


# ZeRO-2 (2 slots a node) and ZeRO-3: ZeRO-1 is the same optimizer as ZeRO-2 in DeepSpeed
# (deepspeed/runtime/zero/stage_1_and_2.py, gradients not partitioned) with the same checkpoint files
@pytest.mark.parametrize("stage,slots", [(2, 2), (3, 1)])
def test_kill_a_rank_then_resume_matches_an_uninterrupted_run(orch, tmp_path, zero_run, stage, slots) -> None:
    steps, interval = STEPS, INTERVAL
    world = 2 * slots
    assert slots == zero_runs.slots(stage)

    ref = zero_run(stage)  # the stage's uninterrupted run of the same job
    assert ref.result.returncode == 0
    expected = _losses(Path(ref.orch.json("status", ref.job_id)["run_dir"]))
    assert len(expected) == world * steps

    spec = zero_runs.zero_spec(stage, tmp_path, name="victim")
    assert zero_runs.spec_fields(spec) == zero_runs.spec_fields(ref.spec)  # the same job, only its name differs
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: [j["id"] for j in orch.json("list") if j["name"] == "victim"], 60, "the job")[0]
        detail = wait_for(lambda: (lambda d: d if d["state"] == "RUNNING" else None)(orch.json("status", job_id)),
                          120, "RUNNING")
        ckpt, run_dir = Path(detail["checkpoint_dir"]), Path(detail["run_dir"])
        victim = world - 1
        # the victim's pid before the checkpoint: asked for after it (an `orch status`, ~0.5 s), the kill came
        # after step 60 on 2 idle cores (~150 steps/s), and the test failed "the kill came too late"
        pid = wait_for(lambda: next((x["pid"] for x in orch.json("status", job_id)["ranks"]
                                     if x["global_rank"] == victim and x["pid"]), None), 60, "the victim's pid")
        # kill once a checkpoint is complete and training has moved past it
        wait_for(lambda: inspect_tag(ckpt / f"step_{interval}").complete and
                 max((s for (r, s) in _losses(run_dir)), default=0) > interval + 2, 180, "progress past step 10",
                 interval=0.02)
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    failed = orch.json("status", job_id)
    cause = failed["cause"]
    assert failed["state"] == "FAILED" and cause["kind"] == "rank_exit"
    assert cause["global_rank"] == victim and cause["node"] == "node-1" and "signal SIGKILL" in cause["message"]
    assert_no_leftovers(job_id, timeout=1)
    reached = max(s for (r, s) in _losses(run_dir))
    assert reached < steps, "the kill came too late to test a resume"

    r = orch("resume", job_id)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = orch.json("status", job_id)
    assert done["state"] == "SUCCEEDED" and [a["state"] for a in done["attempts"]] == ["FAILED", "SUCCEEDED"]
    tag = done["attempts"][1]["resume_tag"]
    start = int(tag.removeprefix("step_"))
    assert start >= interval and start % interval == 0 and start <= reached
    resumed = _losses(Path(done["run_dir"]))
    assert sorted(resumed) == [(rank, s) for rank in range(world) for s in range(start + 1, steps + 1)]
    worst = max(abs(resumed[k] - expected[k]) / abs(expected[k]) for k in resumed)
    exact = sum(resumed[k] == expected[k] for k in resumed)
    print(f"ZeRO-{stage} {world} ranks, killed at step {reached}, resumed from {tag}: {exact}/{len(resumed)} "
          f"losses bit-exact, largest relative difference {worst:.3g}")
    assert worst < REL_TOL, f"largest relative difference {worst:.3g} after resuming from {tag}"
    assert_no_leftovers(job_id, timeout=1)
