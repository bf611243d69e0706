"""The checkpoint formats orch reads without a marker of its own (DeepSpeed, HF Trainer, Accelerate), which
one ``auto`` detects, which checkpoint a resume picks (complete, undamaged by its manifest or its zip
CRCs, not marked bad), how the script is told, the ``latest`` rewrite, and the crash-on-load rule.

The files are real ``torch.save`` / JSON files laid out as each library writes them (names from the
installed libraries' code, see orchestrator/checkpoints/hf.py); the tests that run the libraries
themselves are tests/test_native_resume.py and tests/test_checkpoint_layout.py.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from agents.manifest import hash_file
from orchestrator.checkpoints.detect import detect_format, get_format
from orchestrator.checkpoints.formats import point_latest
from orchestrator.checkpoints.integrity import choose, verify
from orchestrator.errors import CheckpointError, SpecError
from orchestrator.spec import ResumeOptions, spec_from_dict
from orchestrator.supervision.resume import crashed_loading, tell_script


def _ds_header(step: int, dp: int = 2, stage: int = 2) -> dict:
    return {"module": {"w": torch.zeros(4)}, "optimizer": None, "param_shapes": [{"w": torch.Size([4])}],
            "global_steps": step, "dp_world_size": dp, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8"}


def ds_tag(root: Path, tag: str, step: int, dp: int = 2, latest: bool = True, stage: int = 2) -> Path:
    """A DeepSpeed ZeRO-``stage`` tag (0-2) as ``engine.save_checkpoint`` writes it for ``dp`` ranks."""
    d = root / tag
    d.mkdir(parents=True)
    torch.save(_ds_header(step, dp, stage), d / "mp_rank_00_model_states.pt")
    for r in range(dp if stage else 0):
        torch.save({"optimizer_state_dict": {"r": torch.full((64,), float(r))}}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    if latest:
        (root / "latest").write_text(tag)
    return d


def hf_checkpoint(root: Path, step: int, world: int = 2, deepspeed: bool = True) -> Path:
    """``checkpoint-<step>`` as ``transformers.Trainer._save_checkpoint`` writes it."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    if deepspeed:
        ds_tag(d, f"global_step{step}", step, world)
    else:
        torch.save({"state": {}}, d / "optimizer.pt")
        torch.save({"last_epoch": step}, d / "scheduler.pt")
    for i in range(world):
        torch.save({"cpu": torch.zeros(8, dtype=torch.uint8)}, d / f"rng_state_{i}.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return d


def accelerate_checkpoint(root: Path, n: int, step: int, world: int = 2) -> Path:
    """``checkpoint_<n>`` as ``Accelerator.save_state`` writes it (no DeepSpeed plugin)."""
    d = root / f"checkpoint_{n}"
    d.mkdir(parents=True)
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    torch.save({"state": {}}, d / "optimizer.bin")
    torch.save({"last_epoch": step}, d / "scheduler.bin")
    for i in range(world):
        torch.save({"step": step, "random_state": None}, d / f"random_states_{i}.pkl")
    return d


def flip_tensor_bytes(f: Path) -> str:
    """Change two bytes inside a torch file's first tensor (its size and zip directory stay); returns the entry."""
    with zipfile.ZipFile(f) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(f, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    with open(f, "r+b") as fh:
        fh.seek(info.header_offset + 30 + name_len + extra_len + 8)
        fh.write(b"\xff\xff")
    return info.filename


def _manifest(d: Path) -> dict:
    return {str(p.relative_to(d)): hash_file(str(p), str(p.relative_to(d)), "full").to_dict()
            for p in d.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- detection and formats


def test_auto_detects_each_format(tmp_path: Path) -> None:
    cases = {"ds": lambda r: ds_tag(r, "global_step10", 10), "hf": lambda r: hf_checkpoint(r, 10),
             "acc": lambda r: accelerate_checkpoint(r, 0, 10)}
    for name, make in cases.items():
        make(tmp_path / name)
    assert detect_format(tmp_path / "ds")[0] == "deepspeed"
    assert detect_format(tmp_path / "hf")[0] == "hf_trainer"
    assert detect_format(tmp_path / "acc")[0] == "accelerate"
    assert detect_format(tmp_path / "acc" / "checkpoint_0")[0] == "accelerate"  # a save_state dir itself
    (tmp_path / "ds" / "global_step10" / "orch_checkpoint.json").write_text("{}")
    assert detect_format(tmp_path / "ds")[0] == "orch"  # orch's marker wins
    assert detect_format(tmp_path / "nothing") == ("deepspeed", f"{tmp_path / 'nothing'} does not exist yet")


def test_deepspeed_tags_newest_first_with_their_layout(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        ds_tag(tmp_path, f"global_step{step}", step)
    (tmp_path / "tensorboard").mkdir()  # not a tag: no .pt file in it
    (tmp_path / "global_step30_universal").mkdir()  # orch's conversion: not a tag
    found = get_format("deepspeed").scan(tmp_path)
    assert [i.tag for i in found] == ["global_step30", "global_step20", "global_step10"]
    assert all(i.complete and i.dp_world_size == 2 and i.zero_stage == 2 for i in found)
    assert found[0].notes == ("DeepSpeed's latest names it",) and found[1].step == 20


def test_hf_trainer_checkpoint_rules(tmp_path: Path) -> None:
    good = hf_checkpoint(tmp_path, 20)
    fmt = get_format("hf_trainer")
    info = fmt.inspect(good)
    assert info.complete and info.step == 20 and info.dp_world_size == 2, info.problems
    (good / "rng_state_1.pth").unlink()
    assert fmt.inspect(good).problems == ("rng_state_1.pth is missing (the RNG state of process 1)",)
    (good / "rng_state_1.pth").write_bytes((good / "rng_state_0.pth").read_bytes())
    (good / "trainer_state.json").write_text("{not json")
    (bad_state,) = fmt.inspect(good).problems  # named once, by its own rule
    assert bad_state.startswith("trainer_state.json: not valid JSON"), bad_state
    half = hf_checkpoint(tmp_path, 30)
    (half / "trainer_state.json").unlink()  # the Trainer writes it last
    assert "trainer_state.json is missing" in fmt.inspect(half).problems[0]
    plain = hf_checkpoint(tmp_path / "plain", 10, world=1, deepspeed=False)
    (plain / "rng_state_0.pth").rename(plain / "rng_state.pth")  # one process: no index
    assert fmt.inspect(plain).complete, fmt.inspect(plain).problems
    (plain / "optimizer.pt").unlink()
    assert fmt.inspect(plain).problems == ("optimizer.pt is missing (the optimizer's state)",)


def test_accelerate_checkpoint_rules(tmp_path: Path) -> None:
    fmt = get_format("accelerate")
    for n in range(3):
        accelerate_checkpoint(tmp_path, n, step=(n + 1) * 10)
    found = fmt.scan(tmp_path)
    assert [(i.tag, i.step, i.complete) for i in found] == [("checkpoint_2", 30, True), ("checkpoint_1", 20, True),
                                                           ("checkpoint_0", 10, True)]
    (tmp_path / "checkpoint_2" / "random_states_0.pkl").unlink()
    assert fmt.inspect(tmp_path / "checkpoint_2").problems == (
        "random_states_0.pkl is missing (the RNG state and step of process 0)",)
    os.truncate(tmp_path / "checkpoint_1" / "model.safetensors", 20)
    assert "model.safetensors" in fmt.inspect(tmp_path / "checkpoint_1").problems[0]
    assert fmt.scan(tmp_path / "checkpoint_0")[0].tag == "checkpoint_0"  # resume.dir: one save_state dir
    assert fmt.watch_dir(tmp_path / "checkpoint_0") == (str(tmp_path), "checkpoint_0")


# --------------------------------------------------------------------------- the choice


def test_the_newest_complete_undamaged_tag_is_chosen(tmp_path: Path) -> None:
    tags = {step: ds_tag(tmp_path, f"global_step{step}", step) for step in (10, 20, 30)}
    manifests = {d.name: _manifest(d) for d in tags.values()}
    (tags[30] / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    flip_tensor_bytes(tags[20] / "zero_pp_rank_0_mp_rank_00_optim_states.pt")  # same size, zip intact
    c = choose(tmp_path, manifest=lambda tag: manifests.get(tag, {}))
    assert c.format == "deepspeed" and c.format_reason.startswith("detected")
    assert c.chosen.tag == "global_step10" and [s.tag for s in c.skipped] == ["global_step30", "global_step20"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in c.skipped[0].problems[0]
    assert c.damaged == ("global_step20",)
    assert c.checked["global_step10"] == "manifest (3 files, hashes)"
    c = choose(tmp_path, manifest=lambda tag: manifests.get(tag, {}), bad={"global_step10": "rank 1 crashed"})
    assert c.chosen is None and c.skipped[-1].problems == ("marked bad: rank 1 crashed",)


def test_verify_names_the_file_and_what_changed(tmp_path: Path) -> None:
    d = ds_tag(tmp_path, "global_step10", 10)
    info = get_format("deepspeed").inspect(d)
    recorded = _manifest(d)
    os.truncate(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 100)
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    problems = verify(info, recorded)
    assert problems[0].startswith("zero_pp_rank_0_mp_rank_00_optim_states.pt has 100 bytes,")
    assert problems[0].endswith("at the save (truncated)")
    assert problems[1].startswith("zero_pp_rank_1_mp_rank_00_optim_states.pt is gone")
    assert verify(info, {}) == []


def test_without_a_manifest_the_zip_crcs_are_checked(tmp_path: Path) -> None:
    d = ds_tag(tmp_path, "global_step10", 10)
    ds_tag(tmp_path, "global_step5", 5, latest=False)
    entry = flip_tensor_bytes(d / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    c = choose(tmp_path)
    assert c.chosen.tag == "global_step5"
    assert c.skipped[0].problems == (f"zero_pp_rank_1_mp_rank_00_optim_states.pt: its bytes changed since it was "
                                     f"saved (entry {entry} fails its CRC-32)",)
    assert choose(tmp_path, contents=False).chosen.tag == "global_step10"  # orch status: sizes only


# --------------------------------------------------------------------------- telling the script


def _spec(**resume) -> object:
    return spec_from_dict({"name": "r", "entrypoint": "train.py", "resume": resume}, check_files=False)


def test_the_script_is_told_by_the_format_default_or_the_spec(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, 20)
    c = choose(tmp_path)
    args, env = tell_script(_spec(), c)
    assert args == ("--resume_from_checkpoint", str(tmp_path / "checkpoint-20"))
    assert env == {"ORCH_RESUME_CHECKPOINT": str(tmp_path / "checkpoint-20")}
    args, env = tell_script(_spec(args=["--load", "{dir}", "--tag={tag}", "--step", "{step}"], env="CKPT"), c)
    assert args == ("--load", str(tmp_path), "--tag=checkpoint-20", "--step", "20")
    assert env["CKPT"] == str(tmp_path / "checkpoint-20")


def test_resume_section_is_checked() -> None:
    with pytest.raises(SpecError, match=r"resume.args.*names \{ckpt\}; the placeholders are \{checkpoint\}"):
        _spec(args=["--x", "{ckpt}"])
    with pytest.raises(SpecError, match="resume.env"):
        _spec(env="1BAD")
    with pytest.raises(SpecError, match="resume.format"):
        _spec(format="megatron")
    assert ResumeOptions().rewrites_latest("deepspeed") and not ResumeOptions().rewrites_latest("hf_trainer")
    assert not ResumeOptions(latest=False).rewrites_latest("deepspeed")


def test_latest_is_rewritten_atomically_only_when_it_names_another_tag(tmp_path: Path) -> None:
    ds_tag(tmp_path, "global_step10", 10)
    assert point_latest(tmp_path, "global_step10") is None
    assert point_latest(tmp_path, "global_step5") == {"path": str(tmp_path / "latest"), "from": "global_step10",
                                                      "to": "global_step5"}
    assert (tmp_path / "latest").read_text() == "global_step5" and not list(tmp_path.glob(".latest*"))
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # cannot be replaced by a file (a read-only directory would do, but not as root)
    with pytest.raises(CheckpointError, match="Cannot point DeepSpeed's .*latest at global_step10"):
        point_latest(tmp_path, "global_step10")


@pytest.mark.parametrize("tail, crashed", [
    (["[rank1]: Traceback (most recent call last):", '[rank1]:   File "x/engine.py", line 3, in load_checkpoint',
      "[rank1]: RuntimeError: size mismatch"], "RuntimeError: size mismatch"),
    (["Traceback (most recent call last):", '  File "/v/torch/serialization.py", line 2001, in _load',
      "ValueError: Unknown endianness type: x"], "ValueError: Unknown endianness type: x"),
    (["Traceback (most recent call last):", '  File "train.py", line 9, in step', "ZeroDivisionError: x"], None),
    (["step=3 loss=1.0"], None)])
def test_a_crash_on_load_is_told_by_its_traceback(tail: list[str], crashed: str | None) -> None:
    assert crashed_loading(tail) == crashed


def test_an_hf_scripts_output_dir_is_where_its_checkpoints_are(tmp_path: Path) -> None:
    from orchestrator.supervision.prepare import resume_dir_of
    base = {"name": "r", "entrypoint": "train.py", "workdir": str(tmp_path)}

    def where(**fields) -> str:
        return resume_dir_of(spec_from_dict({**base, **fields}, check_files=False), tmp_path / "state", "r-1")
    assert where(args=["--output_dir", "out", "--save_steps", "10"]) == str(tmp_path / "out")
    assert where(args=["--output-dir=/abs/out"]) == "/abs/out"
    assert where(args=["--output_dir", "out"], checkpoint_dir="/ck") == "/ck"
    assert where(args=["--output_dir", "out"], resume={"dir": "/r"}) == "/r"
    assert where(args=["--steps", "3"]) == str((tmp_path / "state" / "jobs" / "r-1" / "checkpoints").resolve())


def test_a_zero_checkpoint_of_another_format_resumes_only_at_its_world_size(tmp_path: Path) -> None:
    from orchestrator.supervision.resume import check_world
    info = get_format("deepspeed").inspect(ds_tag(tmp_path, "global_step10", 10, dp=2))
    check_world(info, 2)
    with pytest.raises(CheckpointError, match=r"saved by 2 data-parallel ranks, but this attempt has 3"):
        check_world(info, 3)
    check_world(get_format("deepspeed").inspect(ds_tag(tmp_path / "z0", "global_step10", 10, dp=2, stage=0)), 3)


def test_fresh_says_that_a_script_loading_latest_itself_is_not_started_over(tmp_path: Path) -> None:
    from orchestrator.supervision.resume import fresh_start_note
    spec = spec_from_dict({"name": "r", "entrypoint": "t.py", "checkpoint_dir": str(tmp_path)}, check_files=False)
    assert fresh_start_note(spec, tmp_path / "state", "r-1") is None
    ds_tag(tmp_path, "global_step10", 10)
    note = fresh_start_note(spec, tmp_path / "state", "r-1")
    assert note.startswith(f"--fresh: DeepSpeed's {tmp_path / 'latest'} names global_step10; a script that calls")


def test_files_the_manifest_lacks_are_checked_by_their_crcs(tmp_path: Path) -> None:
    """A node lost before its agent hashed its ranks' files leaves a partial manifest: the rest are checked too."""
    d = ds_tag(tmp_path, "global_step10", 10)
    ds_tag(tmp_path, "global_step5", 5, latest=False)
    partial = {k: v for k, v in _manifest(d).items() if "zero_pp_rank_1" not in k}
    entry = flip_tensor_bytes(d / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    c = choose(tmp_path, manifest=lambda tag: partial if tag == "global_step10" else {})
    assert c.chosen.tag == "global_step5" and entry in c.skipped[0].problems[0]


def test_a_fifo_named_like_a_shard_is_reported_not_waited_on(tmp_path: Path) -> None:
    d = ds_tag(tmp_path, "global_step10", 10)
    shard = d / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.unlink()
    os.mkfifo(shard)
    c = choose(tmp_path)  # would block forever opening it
    assert c.chosen is None and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in "; ".join(c.skipped[0].problems)
    from agents.manifest import CheckpointWatch
    out: list[dict] = []
    w = CheckpointWatch({"dir": str(tmp_path), "world_size": 2}, [0, 1], 0, lambda m: out.extend(m["files"]) or True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")  # written after the agent started
    w.stop(final_deadline_s=5)
    assert [f["name"] for f in out] == ["mp_rank_00_model_states.pt"]


def test_a_wrong_format_in_the_spec_is_pointed_out(tmp_path: Path) -> None:
    ds_tag(tmp_path, "global_step10", 10)
    c = choose(tmp_path, "hf_trainer")
    assert c.chosen is None and "looks like the deepspeed format" in c.format_reason


def test_placeholders_take_no_conversion_or_format() -> None:
    for bad in ("{checkpoint!r}", "{step:d}", "--x={step:>8}"):
        with pytest.raises(SpecError, match="a placeholder takes no conversion or format"):
            _spec(args=[bad])


def test_a_directory_gone_after_checkpoints_were_recorded_is_not_called_never_saved(tmp_path: Path) -> None:
    from orchestrator.store import Store
    from orchestrator.supervision.resume import check_reachable
    store = Store(tmp_path / "orch.db")
    store.create_job("j-1", "j", {})
    gone = tmp_path / "mnt" / "ckpt"
    store.record_checkpoint_files("j-1", 1, str(gone), 0, [{"tag": "global_step20", "name": "a.pt", "size": 1,
                                                            "mtime_ns": 1, "hash": None, "mode": "off"}])
    with pytest.raises(CheckpointError, match=r"recorded 1 checkpoint\(s\) in .*ckpt \(newest global_step20\), but "
                                              r"the directory is missing on this host: is its storage mounted"):
        check_reachable(store, "j-1", choose(gone))
    gone.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="holds none of them now"):
        check_reachable(store, "j-1", choose(gone))
    check_reachable(store, "j-2", choose(gone))  # nothing recorded: the usual rules (--fresh) apply
    store.close()


# --------------------------------------------------------------------------- pipeline parallelism


def pipe_tag(root: Path, step: int) -> Path:
    """A 2-stage ZeRO-1 ``PipelineEngine`` tag (data parallel 1) laid out as DeepSpeed 0.19.8 saves it: per
    stage ``mp_rank_<stage>_model_states.pt`` (``module`` None; ``param_shapes`` names layers ``<idx>.<param>``)
    and one optimizer partition; per layer ``layer_<idx>-model_states.pt`` (stage 0: layers 0-2, 1 an activation;
    stage 1: layers 3-4). As examples/pipe_train.py's real saves (tests/test_pipeline.py)."""
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    for stage, layers in ((0, (0, 2)), (1, (3, 4))):
        header = {"module": None, "optimizer": None, "global_steps": step, "dp_world_size": 1, "mp_world_size": 2,
                  "param_shapes": [{f"{i}.{p}": torch.Size([4]) for i in layers for p in ("weight", "bias")}],
                  "checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 1},
                  "ds_config": {"zero_optimization": {"stage": 1}}, "ds_version": "0.19.8"}
        torch.save(header, d / f"mp_rank_{stage:02d}_model_states.pt")
        torch.save({"optimizer_state_dict": {"s": torch.zeros(8)}}, d / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")
    for i in range(5):
        torch.save({} if i == 1 else {"weight": torch.zeros(4), "bias": torch.zeros(4)}, d / f"layer_{i:02d}-model_states.pt")
    (root / "latest").write_text(d.name)
    return d


def test_a_pipeline_tag_missing_a_layer_file_is_not_chosen(tmp_path: Path) -> None:
    older, newest = pipe_tag(tmp_path, 10), pipe_tag(tmp_path, 20)
    info = get_format("deepspeed").inspect(older)
    assert info.complete and (info.world_size, info.dp_world_size, info.zero_stage) == (2, 1, 1)  # 2 stages x dp 1
    (newest / "layer_03-model_states.pt").unlink()  # stage 1's first layer: named by its param_shapes
    c = choose(tmp_path)
    assert c.chosen.tag == "global_step10" and [s.tag for s in c.skipped] == ["global_step20"]
    assert c.skipped[0].problems == ("layer_03-model_states.pt is missing (a pipeline layer's weights, written by "
                                     "data-parallel rank 0 of its stage)",)
    (newest / "layer_03-model_states.pt").write_bytes(b"")  # an empty file where the layer was: damaged, not done
    assert choose(tmp_path).chosen.tag == "global_step10"
    os.truncate(older / "mp_rank_01_model_states.pt", 50)  # stage 1's header cut short: no tag is complete
    c = choose(tmp_path)
    assert c.chosen is None and any(p.startswith("mp_rank_01_model_states.pt") for p in c.skipped[1].problems), c.skipped


def test_a_pipeline_checkpoint_resumes_on_its_stages_times_its_data_parallel_ranks() -> None:
    """A 2-stage pipeline saved by 1 data-parallel rank (world 2) resumes on 2 ranks, not on 1 or 4."""
    from orchestrator.checkpoints.tags import CheckpointInfo
    from orchestrator.supervision.resume import check_world
    info = CheckpointInfo("global_step4", "/ck/global_step4", 4, world_size=2, zero_stage=1, dp_world_size=1,
                          format="deepspeed")
    check_world(info, 2)
    for world in (1, 3, 4):
        with pytest.raises(CheckpointError, match=r"saved by 1 data-parallel ranks x 2 model-parallel ranks, .* "
                                                  rf"has {world} ranks.*Resume on 2 ranks"):
            check_world(info, world)
