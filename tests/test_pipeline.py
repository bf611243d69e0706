"""Pipeline parallelism under orch: examples/pipe_train.py (a ``deepspeed.pipe.PipelineModule`` in 2 stages,
``engine.train_batch``, ZeRO-1) on 2 local nodes x 1 slot, run through the real ``orch`` command from the
example's own spec (examples/pipeline.yaml, shortened).

Its rank 1 (the last stage) is SIGKILLed once it logged step 25 with a checkpoint every 10 steps and no restart
policy: the job ends FAILED. orch must find DeepSpeed's pipeline checkpoints (``layer_XX-model_states.pt`` per
layer, ``mp_rank_<stage>_model_states.pt`` and a ZeRO-1 partition per stage), refuse one with a layer file
missing, and ``orch resume`` must continue from the newest complete tag: every loss the resumed attempt logs for
a step the killed attempt also logged is equal, exactly (the string ``repr`` printed). Exact, not a tolerance:
the same world on the CPU (gloo, fp32, one thread per rank) does the same arithmetic in the same order, and
the resumed attempt restores every layer, the Adam moments, the LR schedule and the step; any difference
means something was not restored. The killed attempt is the uninterrupted run for those steps.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, assert_no_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_resume
import helpers_train

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
STEPS, INTERVAL, KILL_AT = 60, 10, 25


def _spec(tmp_path: Path, ckpt: Path) -> Path:
    """examples/pipeline.yaml with absolute paths, fewer steps, this test's checkpoint directory."""
    spec = yaml.safe_load((EXAMPLES / "pipeline.yaml").read_text())
    assert spec["num_gpus"] == 1 and spec["entrypoint"] == "pipe_train.py"  # 2 nodes x 1 slot: 2 stages
    spec.update(hostfile=str(ROOT / "hostfiles" / "local-2x2"), workdir=str(EXAMPLES),
                deepspeed_config=str(EXAMPLES / spec["deepspeed_config"]), checkpoint_dir=str(ckpt),
                args=["--steps", str(STEPS), "--checkpoint-interval", str(INTERVAL)], stop_grace_seconds=5)
    spec.pop("restart", None)  # no restart: the kill ends the job FAILED
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_killed_pipeline_job_resumes_from_its_layer_checkpoints_with_equal_losses(orch, tmp_path) -> None:
    helpers_train.prebuild_ops()
    ckpt = tmp_path / "ckpt"
    job = helpers_resume.run_and_kill(orch, _spec(tmp_path, ckpt), rank=1, at_step=KILL_AT)
    first = Path(orch.json("status", job)["run_dir"]) / "logs"
    killed_at = max(helpers_resume.losses(first / "rank-1.log"))
    status = orch.json("status", job)["checkpoints"]
    newest = status["next_resume"]
    step = int(newest.removeprefix("global_step"))
    assert status["format"] == "deepspeed" and step % INTERVAL == 0 and killed_at - INTERVAL <= step <= killed_at, \
        (status, killed_at)
    tag_dir = ckpt / newest
    written = sorted(p.name for p in tag_dir.iterdir())
    layers = [n for n in written if n.startswith("layer_")]
    assert layers == [f"layer_{i:02d}-model_states.pt" for i in range(8)], written  # 4 Linear/Embedding, 3 GELU
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= set(written)
    row = next(c for c in status["checkpoints"] if c["tag"] == newest)
    assert row["complete"] and row["recorded_files"] == len(written), row  # the agents hashed every file

    backup = tmp_path / "backup"
    shutil.copytree(tag_dir, backup)
    (tag_dir / "layer_05-model_states.pt").unlink()  # stage 1's first Linear
    preview = orch.json("resume", job, "--dry-run")
    assert preview["resume_tag"] == f"global_step{step - INTERVAL}", preview
    (skipped,) = [c for c in preview["checkpoints"]["checkpoints"] if c["tag"] == newest]
    assert not skipped["complete"] and any("layer_05-model_states.pt is missing" in p for p in skipped["problems"]), \
        skipped
    shutil.rmtree(tag_dir)
    shutil.copytree(backup, tag_dir, copy_function=shutil.copy2)

    r = orch("resume", job, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == newest, detail["attempts"]
    second = Path(detail["run_dir"]) / "logs"
    for rank in (0, 1):
        before, after = (helpers_resume.losses(d / f"rank-{rank}.log") for d in (first, second))
        assert min(after) == step + 1 and max(after) == STEPS, sorted(after)[:3]
        overlap = sorted(set(before) & set(after))
        assert overlap == list(range(step + 1, max(before) + 1)) and overlap, (rank, overlap)
        assert [after[s] for s in overlap] == [before[s] for s in overlap], rank
    assert_no_leftovers(job, timeout=5)
