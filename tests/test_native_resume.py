"""Resuming scripts that were never written for orch, from the checkpoints they write themselves.

tests/scripts/hf_trainer_train.py is an HF Trainer script (``--deepspeed`` with a config of "auto"s,
``save_steps``): orch finds its ``checkpoint-<N>`` under ``--output_dir`` and resumes it with
``--resume_from_checkpoint``; the logged losses after the resume equal the killed run's.
tests/scripts/accelerate_ds_train.py is an Accelerate script with its DeepSpeed plugin (ZeRO-2 on the CPU:
gloo) and ``save_state``: orch finds ``<project_dir>/checkpoints/checkpoint_<n>`` and passes the one to
load as the script's own ``--resume_from`` (``resume.args``).

tests/scripts/ds_tutorial_train.py is a DeepSpeed tutorial-style script (``engine.save_checkpoint(save_dir,
client_state=...)`` every 10 steps, ``engine.load_checkpoint(load_dir)`` at start, which loads the tag
DeepSpeed's ``latest`` names). On 2 local nodes its rank 1 is killed mid-run; ``orch resume`` must start
the next attempt from the newest complete, undamaged tag and the losses after it must equal those the
killed attempt had for the same steps (the script is deterministic). Damage of every kind is found
before any rank starts, named, and the resume falls back to the tag before; a crash on load marks a
tag bad so that the next automatic restart skips it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_no_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_resume
import helpers_train

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

SCRIPTS = ROOT / "tests" / "scripts"
TWO_NODES = "node-0 slots=1\nnode-1 slots=1\n"
#: The HF script's loss line, which may follow the Trainer's progress bar on the same line.
HF_STEP = r"(?:^|\])step=(\d+)"


def _ds_spec(write_spec, hostfile, ckpt: Path, steps: int = 80, **extra) -> Path:
    args = ["--steps", str(steps), "--save_dir", str(ckpt), "--load_dir", str(ckpt), "--save_interval", "10"]
    return write_spec(name="dstut", hostfile=str(hostfile(TWO_NODES)), launcher="pdsh", workdir=str(SCRIPTS),
                      entrypoint="ds_tutorial_train.py", args=args, deepspeed_args=True,
                      deepspeed_config=str(SCRIPTS / "ds_tutorial_zero2.json"), checkpoint_dir=str(ckpt),
                      stop_grace_seconds=5, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, **extra)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _preview(orch, job: str) -> dict:
    return orch.json("resume", job, "--dry-run")


def _skipped(preview: dict, tag: str) -> str:
    (entry,) = [c for c in preview["checkpoints"]["checkpoints"] if c["tag"] == tag]
    assert not entry["complete"], entry
    return "; ".join(entry["problems"])


def test_deepspeed_script_resumes_from_its_newest_undamaged_tag(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    ckpt = tmp_path / "ckpt"
    job = helpers_resume.run_and_kill(orch, _ds_spec(write_spec, hostfile, ckpt), rank=1, at_step=25)
    first = Path(orch.json("status", job)["run_dir"]) / "logs"
    killed_at = max(helpers_resume.losses(first / "rank-1.log"))
    status = orch.json("status", job)["checkpoints"]
    newest = status["next_resume"]
    step = int(newest.removeprefix("global_step"))
    assert status["format"] == "deepspeed" and killed_at - 10 <= step <= killed_at, (status, killed_at)
    row = next(c for c in status["checkpoints"] if c["tag"] == newest)
    assert row["recorded_files"] == 3  # mp_rank_00_model_states + an optimizer partition per rank
    previous = f"global_step{step - 10}"
    tag_dir = ckpt / newest
    shard, model = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag_dir / "mp_rank_00_model_states.pt"
    backup = tmp_path / "backup"
    shutil.copytree(tag_dir, backup)
    before = _tree(ckpt)

    def restore() -> None:
        shutil.rmtree(tag_dir)
        shutil.copytree(backup, tag_dir)

    helpers_resume.truncate(shard)
    p = _preview(orch, job)
    assert p["resume_tag"] == previous and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in _skipped(p, newest)
    assert "truncated" in _skipped(p, newest)
    restore()
    helpers_resume.flip_tensor_byte(shard)  # same size, zip directory intact: only the manifest sees it
    p = _preview(orch, job)
    assert p["resume_tag"] == previous
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: its bytes changed since the save" in _skipped(p, newest)
    restore()
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    p = _preview(orch, job)
    assert p["resume_tag"] == previous
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (written by data-parallel rank 0)" in _skipped(p, newest)
    restore()
    half = ckpt / f"global_step{step + 10}"  # a save cut short, which latest already names
    half.mkdir()
    (half / model.name).write_bytes(model.read_bytes()[:1000])
    (ckpt / "latest").write_text(half.name)
    p = _preview(orch, job)
    assert p["resume_tag"] == newest and "mp_rank_00_model_states.pt" in _skipped(p, half.name)
    assert p["latest"] == {"from": half.name, "to": newest}
    assert _tree(ckpt) == {**before, f"{half.name}/{model.name}": _tree(ckpt)[f"{half.name}/{model.name}"],
                           "latest": _tree(ckpt)["latest"]}  # --dry-run changed nothing
    shutil.rmtree(half)
    restore()

    r = orch("resume", job, "--dry-run", "--exclude", "node-1")  # no spare: one rank cannot load two partitions
    assert r.returncode == 2 and "but a resume would be refused:" in r.stdout, r.stdout + r.stderr
    refused = json.loads(orch("resume", job, "--dry-run", "--exclude", "node-1", "--output", "json").stdout)["refused"]
    assert "saved by 2 data-parallel ranks, but this attempt has 1" in refused, refused

    helpers_resume.flip_tensor_byte(model)  # the real resume must fall back to the tag before
    r = orch("resume", job, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"skipped {newest}: mp_rank_00_model_states.pt: its bytes changed" in r.stdout
    assert f"latest now names {previous}" in r.stdout
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == previous
    second = Path(detail["run_dir"]) / "logs"
    for rank in (0, 1):
        before_kill, after = (helpers_resume.losses(d / f"rank-{rank}.log") for d in (first, second))
        assert min(after) == step - 10 + 1 and max(after) == 80, sorted(after)[:3]
        overlap = sorted(set(before_kill) & set(after))
        assert len(overlap) >= 10 and all(after[s] == before_kill[s] for s in overlap), rank
    assert_no_leftovers(job, timeout=5)


def test_a_rank_that_crashes_loading_a_tag_makes_the_next_restart_skip_it(orch, write_spec, hostfile, tmp_path) -> None:
    """``hash: off`` records sizes only, so a file changed in place with its size kept passes every check
    before the start; the ranks then crash in ``torch.load`` (the endianness record is gone)."""
    helpers_train.prebuild_ops()
    ckpt = tmp_path / "ckpt"
    spec = _ds_spec(write_spec, hostfile, ckpt, resume={"hash": "off"},
                    restart={"max_restarts": 2, "backoff_seconds": 4, "backoff_factor": 1})
    proc = orch.popen("run", str(spec))
    try:
        job = helpers_resume.wait_listed(orch)
        helpers_resume.kill_rank_at(orch, job, rank=1, at_step=25)
        helpers_resume.wait_state(orch, job, "FAILED", attempt=1)
        tag = (ckpt / "latest").read_text().strip()
        helpers_resume.break_byteorder(ckpt / tag / "mp_rank_00_model_states.pt")
        out, err = proc.communicate(timeout=300)
    finally:
        helpers_resume.stop(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    detail = orch.json("status", job)
    starts = [a["resume_tag"] for a in detail["attempts"]]
    previous = f"global_step{int(tag.removeprefix('global_step')) - 10}"
    assert detail["state"] == "SUCCEEDED" and starts == [None, tag, previous], starts
    (bad,) = orch.events(job, "checkpoint_marked_bad")
    assert bad.attempt == 2 and bad.data["tag"] == tag and "crashed loading it" in bad.data["reason"]
    assert "Unknown endianness type" in bad.data["reason"], bad.data
    p = _preview(orch, job)  # attempt 3 saved the tag again: its bad mark is gone with the old files
    assert p["resume_tag"] == "global_step80" and not any("marked bad" in "; ".join(c["problems"])
                                                         for c in p["checkpoints"]["checkpoints"]), p
    assert_no_leftovers(job, timeout=5)


def test_hf_trainer_script_resumes_from_its_checkpoint_dirs(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    out = tmp_path / "out"
    args = ["--deepspeed", str(SCRIPTS / "hf_ds_zero2.json"), "--output_dir", str(out), "--max_steps", "60",
            "--save_steps", "10", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--report_to",
            "none", "--seed", "42"]
    spec = write_spec(name="hftrainer", hostfile=str(hostfile(TWO_NODES)), launcher="standard", workdir=str(SCRIPTS),
                      entrypoint="hf_trainer_train.py", args=args, stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    job = helpers_resume.run_and_kill(orch, spec, rank=1, at_step=25, log_rank=0, pattern=HF_STEP + " loss=")
    status = orch.json("status", job)
    first = Path(status["run_dir"]) / "logs" / "rank-0.log"
    view = status["checkpoints"]
    assert view["format"] == "hf_trainer" and view["dir"] == str(out), view
    newest = view["next_resume"]
    step = int(newest.removeprefix("checkpoint-"))
    row = next(c for c in view["checkpoints"] if c["tag"] == newest)
    assert row["complete"] and row["recorded_files"] >= 6, row  # weights, DS tag files, rng x2, trainer_state
    r = orch("resume", job, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"the script gets --resume_from_checkpoint {out / newest}" in r.stdout, r.stdout[-2000:]
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == newest
    before, after = (helpers_resume.losses(p, HF_STEP + r" loss=(\S+)")
                     for p in (first, Path(detail["run_dir"]) / "logs" / "rank-0.log"))
    assert min(after) == step + 1 and max(after) == 60, sorted(after)[:3]
    overlap = sorted(set(before) & set(after))
    assert overlap and all(after[s] == before[s] for s in overlap), [(s, before[s], after[s]) for s in overlap]
    assert_no_leftovers(job, timeout=5)


def test_accelerate_deepspeed_script_resumes_from_its_save_state_dirs(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    project = tmp_path / "project"
    args = ["--deepspeed_config", str(SCRIPTS / "ds_accelerate_zero2.json"), "--project_dir", str(project),
            "--steps", "60", "--save_every", "10"]
    spec = write_spec(name="accel", hostfile=str(hostfile(TWO_NODES)), launcher="standard", workdir=str(SCRIPTS),
                      entrypoint="accelerate_ds_train.py", args=args, stop_grace_seconds=5,
                      resume={"dir": str(project / "checkpoints"), "args": ["--resume_from", "{checkpoint}"]},
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    job = helpers_resume.run_and_kill(orch, spec, rank=1, at_step=25)
    status = orch.json("status", job)
    first = Path(status["run_dir"]) / "logs"
    view = status["checkpoints"]
    assert view["format"] == "accelerate", view
    newest = view["next_resume"]
    row = next(c for c in view["checkpoints"] if c["tag"] == newest)
    assert row["complete"] and row["dp_world_size"] == 2 and row["zero_stage"] == 2, row
    assert row["recorded_files"] >= 7  # pytorch_model/ (3), latest, scheduler, random_states x2, custom
    r = orch("resume", job, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"the script gets --resume_from {project / 'checkpoints' / newest}" in r.stdout, r.stdout[-2000:]
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == newest
    second = Path(detail["run_dir"]) / "logs"
    for rank in (0, 1):
        before, after = (helpers_resume.losses(d / f"rank-{rank}.log") for d in (first, second))
        start = min(after)
        assert start % 10 == 1 and start <= max(before) + 1 and max(after) == 60, (start, max(before))
        overlap = sorted(set(before) & set(after))
        assert overlap and all(after[s] == before[s] for s in overlap), rank
    assert_no_leftovers(job, timeout=5)
