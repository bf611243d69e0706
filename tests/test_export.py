"""``orch export``: a job's ZeRO checkpoint as one fp32 state_dict that loads into the plain model.

Real jobs: the session's shared ZeRO runs (``zero_run``, tests/zero_runs.py): examples/train_gpt.py
under orch on 2 local "nodes" (DS_ACCELERATOR=cpu, gloo), one per ZeRO stage 0-3, 2 slots per node
at stage 2 (world size 4) and 1 at the others (world size 2), 60 steps with a checkpoint every 10
(step_10 ... step_60), the same jobs tests/test_training.py checks. Each job also leaves DeepSpeed's
consolidated model of its last step (``engine.save_16bit_model``: at ZeRO-3 the partitions
gathered from the live engine, at stages 0-2 the module's own ``state_dict()``; fp32 here, as
training is): the export of that step, which comes from the optimizer's fp32 master partitions
(stages 1-3) through DeepSpeed's zero_to_fp32, must equal it weight for weight. Bad requests
(unknown job or tag, incomplete tag, no checkpoint, unwritable output, damaged or 16-bit
stage-0 checkpoints) end in one message, exit status 2, no traceback. The shared runs are only read:
a test that adds a tag or damages a file does it in a copy (``ZeroRun.copy``, ``shutil.copytree``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from orchestrator.checkpoints import inspect_tag
from orchestrator.errors import ExportError
from orchestrator.checkpoints import export_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_runs import MODEL, ZeroRun

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
#: the world size of each stage's shared job (2 nodes x 2 slots at stage 2, x 1 at the others)
WORLD = {0: 2, 1: 2, 2: 4, 3: 2}


def _train_gpt():
    """examples/train_gpt.py as a module (its ByteGPT and corpus loader)."""
    spec = importlib.util.spec_from_file_location("train_gpt_for_export", EXAMPLES / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_gpt = _train_gpt()


def _fresh_model() -> torch.nn.Module:
    """A ByteGPT as the script builds it before training (same seed)."""
    torch.manual_seed(1234)
    return train_gpt.ByteGPT(**MODEL)


@pytest.fixture()
def trained(zero_run):
    """``trained(stage)``: the session's SUCCEEDED job of that ZeRO stage (tests/zero_runs.py), only job of its
    state dir: 60 steps, complete tags step_10 ... step_60, DeepSpeed's consolidated model in step_60."""
    def get(stage: int) -> ZeroRun:
        t = zero_run(stage)
        r = t.result
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        (job,) = t.orch.json("list")
        assert job["id"] == t.job_id
        return t

    return get


def _export(t: ZeroRun, out: Path, *extra: str) -> dict:
    r = t.orch("export", t.job_id, str(out), *extra, "--output", "json", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)  # stdout is the JSON alone: DeepSpeed's own output went elsewhere


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_export_loads_into_the_model_and_equals_deepspeeds_own_weights(trained, tmp_path, stage) -> None:
    t = trained(stage)
    out = tmp_path / "model.pt"
    res = _export(t, out)
    n_params = sum(p.numel() for p in _fresh_model().parameters())
    assert (res["job"], res["tag"], res["step"], res["zero_stage"], res["world_size"]) == \
        (t.job_id, "step_60", 60, stage, WORLD[stage])
    assert res["method"] == ("module_states" if stage == 0 else "zero_to_fp32")
    assert res["output"] == str(out) and res["bytes"] == out.stat().st_size > 4 * n_params
    assert (res["params"], res["dtypes"]) == (n_params, ["float32"]) and res["seconds"] > 0
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file was left behind"

    exported = torch.load(out, weights_only=True)
    model = train_gpt.ByteGPT(**MODEL)
    model.load_state_dict(exported, strict=True)  # every key, every shape of the unwrapped model

    # DeepSpeed's consolidated model of the same step (pytorch_model.bin, written by the script)
    reference = torch.load(t.ckpt / "step_60" / "pytorch_model.bin", weights_only=True)
    assert sorted(reference) == sorted(exported)
    for name, want in reference.items():
        got = model.state_dict()[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want.float()), f"{name}: max difference {(got - want.float()).abs().max().item()}"

    # ...and it is the trained model: not the initial weights, and it predicts the text better
    fresh = _fresh_model()
    changed = [n for n, p in fresh.state_dict().items() if not torch.equal(p, exported[n])]
    assert len(changed) == len(exported), f"unchanged by training: {set(exported) - set(changed)}"
    corpus, _ = train_gpt.load_corpus(200_000)
    windows = torch.stack([corpus[i: i + MODEL["seq_len"] + 1] for i in range(0, 64 * 997, 997)]).long()
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    with torch.no_grad():
        losses = [m.eval()(inputs, targets).item() for m in (fresh, model)]
    assert losses[1] < losses[0], losses


def test_export_of_a_named_tag_and_the_default_skips_incomplete_tags(trained, tmp_path) -> None:
    t = trained(2)
    # the newest tag but one: 10 steps before the last (the weights nearest the last step's)
    older = _export(t, tmp_path / "step50.pt", "--tag", "step_50")
    assert (older["tag"], older["step"]) == ("step_50", 50)
    newer = torch.load(_export(t, tmp_path / "step60.pt")["output"], weights_only=True)
    step50 = torch.load(tmp_path / "step50.pt", weights_only=True)
    assert any(not torch.equal(step50[n], newer[n]) for n in newer), "step_50 and step_60 exported the same weights"
    # the file may also be named with --output (the format option takes anything but table/json as the file)
    # (a real orch process: the other exports here run the CLI's entry in this one, tests/conftest.py)
    r = t.orch("export", t.job_id, "--output", str(tmp_path / "as-option.pt"), timeout=300, subprocess_=True)
    assert r.returncode == 0, r.stderr
    same = torch.load(tmp_path / "as-option.pt", weights_only=True)
    assert all(torch.equal(same[n], newer[n]) for n in newer)
    r = t.orch("export", t.job_id)
    assert r.returncode == 2 and "Name the file to write" in r.stderr

    # a newer tag whose save did not finish (no marker) is skipped by default, refused by name (in a copy of
    # the job: the shared run is not changed)
    t = t.copy(tmp_path / "job")
    broken = t.ckpt / "step_70"
    shutil.copytree(t.ckpt / "step_60", broken)
    (broken / "orch_checkpoint.json").unlink()
    assert _export(t, tmp_path / "default.pt")["tag"] == "step_60"
    r = t.orch("export", t.job_id, str(tmp_path / "x.pt"), "--tag", "step_70")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"Checkpoint step_70 in {t.ckpt} is incomplete" in r.stderr
    assert "no orch_checkpoint.json" in r.stderr and "the newest complete one is step_60" in r.stderr
    assert not (tmp_path / "x.pt").exists()


def test_bad_requests_get_one_message_and_exit_status_2(trained, tmp_path) -> None:
    t = trained(2)
    cases = {
        ("nosuchjob", str(tmp_path / "a.pt")): "No job 'nosuchjob'",
        (t.job_id, str(tmp_path / "a.pt"), "--tag", "step_42"): "has no checkpoint tag 'step_42'",
        (t.job_id, str(tmp_path / "missing" / "a.pt")): f"{tmp_path / 'missing'} does not exist",
        (t.job_id, str(tmp_path)): "is a directory; give a file name",
        (t.job_id, "/sys/model.pt"): "Cannot write /sys/model.pt: Permission denied",
    }
    for argv, words in cases.items():
        r = t.orch("export", *argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert words in r.stderr and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
        j = t.orch.json("export", *argv)
        assert words in j["error"] and j["kind"] in ("NotFoundError", "ExportError"), j
    tags = ", ".join(f"step_{s} (complete)" for s in range(60, 0, -10))  # newest first
    assert f"its tags: {tags}." in t.orch("export", t.job_id, str(tmp_path / "a.pt"), "--tag", "nope").stderr
    assert not (tmp_path / "a.pt").exists()
    # a universal checkpoint (what orch converts for a resume on another world size) points at its source (in a
    # copy of the job: the shared run is not changed)
    t = t.copy(tmp_path / "job")
    universal = t.ckpt / "step_60_universal"
    universal.mkdir()
    (universal / "orch_universal.json").write_text('{"tag": "step_60_universal", "source_tag": "step_60"}')
    r = t.orch("export", t.job_id, str(tmp_path / "a.pt"), "--tag", "step_60_universal")
    assert r.returncode == 2 and "is a universal checkpoint" in r.stderr and "--tag step_60" in r.stderr, r.stderr


def test_a_job_that_saved_no_checkpoint(orch, write_spec, hostfile, tmp_path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('nothing to save')\n")
    spec = write_spec(name="nockpt", hostfile=str(hostfile("node-0 slots=1\n")), launcher="pdsh",
                      workdir=str(tmp_path), entrypoint="noop.py")
    assert orch("run", str(spec)).returncode == 0
    (job,) = orch.json("list")
    r = orch("export", job["id"], str(tmp_path / "m.pt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"Job {job['id']} saved no checkpoint" in r.stderr and "--save-final" in r.stderr


def test_damaged_and_16bit_stage0_checkpoints_are_refused_with_the_reason(trained, tmp_path) -> None:
    # a ZeRO-2 optimizer partition cut short after the marker was written
    ckpt = tmp_path / "z2"
    shutil.copytree(trained(2).ckpt, ckpt)
    part = ckpt / "step_60" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    part.write_bytes(part.read_bytes()[:1000])
    assert inspect_tag(ckpt / "step_60").complete  # by its files it looks complete
    with pytest.raises(ExportError, match=r"DeepSpeed could not read checkpoint .*step_60 \(ZeRO stage 2\): "):
        export_checkpoint(ckpt, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists() and not list(tmp_path.glob(".m.pt.*"))

    # ZeRO-0 trained in bf16: the module file holds 16-bit weights, the fp32 masters are elsewhere
    ckpt0 = tmp_path / "z0"
    shutil.copytree(trained(0).ckpt, ckpt0)
    states = ckpt0 / "step_60" / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)
    sd["module"] = {k: v.to(torch.bfloat16) for k, v in sd["module"].items()}
    torch.save(sd, states)
    with pytest.raises(ExportError, match="saved at ZeRO stage 0 with bfloat16 weights"):
        export_checkpoint(ckpt0, tmp_path / "m0.pt")
    assert export_checkpoint(ckpt0, tmp_path / "m50.pt", "step_50").method == "module_states"  # an older tag
