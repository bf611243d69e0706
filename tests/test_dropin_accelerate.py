"""``orch accelerate-launch``: the accelerate launch command line, unchanged, under orch.

The parsers agree: every argument of the installed Accelerate's own parser
(``accelerate.commands.launch.launch_command_parser``) is either in ``orch accelerate-launch``'s with
the same option strings, destination, default, type and choices, or is an option of Accelerate's other
launches (FSDP, Megatron-LM, TPU, FP8, ...) that orch refuses by name; command lines parse to the same
values under both. Each argument becomes what it means (the file's key it overrides, the spec's
``accelerate`` section, ``deepspeed_config``, ...), with Accelerate's precedence. The ranks' argv and
environment against the real ``accelerate launch`` are compared in tests/test_accelerate_env.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import cli
from orchestrator.errors import SpecError
from orchestrator.face.cli.dropin import accelerate_parser
from orchestrator.spec.accelerate_cmd import LAUNCH_OPTIONS, accelerate_job, default_config_file, refused_family



def _theirs():
    from accelerate.commands.launch import launch_command_parser
    return launch_command_parser()


def _shape(action) -> dict:
    return {"options": sorted(action.option_strings), "takes_value": action.nargs != 0, "default": action.default,
            "type": action.type, "choices": list(action.choices) if action.choices else None,
            "required": action.required, "nargs": action.nargs if action.nargs != 0 else 0}


def test_parsers_agree_argument_by_argument() -> None:
    theirs = _theirs()
    ours = {a.dest: a for a in accelerate_parser()._actions}
    assert accelerate_parser().allow_abbrev == theirs.allow_abbrev
    mapped = {o.dest for o in LAUNCH_OPTIONS} | {"training_script", "training_script_args"}
    seen = set()
    for action in theirs._actions:
        if action.dest == "help":
            continue
        if action.dest in mapped:
            seen.add(action.dest)
            assert _shape(ours[action.dest]) == _shape(action), action.dest
        else:  # an option of another launch: refused, each string by what it is for
            assert action.option_strings and all(refused_family(s) for s in action.option_strings), action.dest
    assert seen == mapped  # nothing of ours that Accelerate does not have
    assert refused_family("--fsdp_version") == "FSDP" and refused_family("--lr") is None


CORPUS = [
    ["--config_file", "a.yaml", "t.py", "--lr", "1"],
    ["--config-file=a.yaml", "--num_processes", "4", "--num-machines", "2", "--main_process_ip", "10.0.0.1",
     "--main-process-port", "29600", "--machine_rank", "1", "t.py", "--num_processes", "9"],
    ["--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "bf16", "--offload_param_device", "cpu",
     "--gradient_accumulation_steps", "2", "--gradient_clipping", "0.5", "--zero3_init_flag", "true", "-m", "pkg.t"],
    ["--deepspeed_hostfile", "h", "--deepspeed_exclusion_filter", "b", "--deepspeed_multinode_launcher", "nossh",
     "--deepspeed_config_file", "ds.json", "-q", "--debug", "--no_python", "/bin/echo", "x"],
    ["-t", "3", "--log_dir", "/l", "--max_restarts", "2", "--monitor_interval", "1", "--dynamo_backend", "inductor",
     "--gpu_ids", "0,1", "--same_network", "--rdzv_backend", "c10d", "t.py"],
]


@pytest.mark.parametrize("argv", CORPUS, ids=lambda a: " ".join(a)[:40])
def test_parsers_agree_on_command_lines(argv: list[str]) -> None:
    theirs = vars(_theirs().parse_args(argv))
    ours = vars(accelerate_parser().parse_args(argv))
    assert {k: ours[k] for k in theirs if k in ours} == {k: v for k, v in theirs.items() if k in ours}


def _job(argv: list[str], cwd: Path, env: dict | None = None):
    ns, unknown = accelerate_parser().parse_known_args(argv)
    ns.unknown = unknown
    return accelerate_job(ns, str(cwd), env or {"HOME": str(cwd)}, local_slots=3)


ACCEL = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 2,
         "num_processes": 4, "main_process_ip": "10.0.0.9",
         "deepspeed_config": {"zero_stage": 2, "deepspeed_hostfile": "hostfile",
                              "deepspeed_inclusion_filter": "a@b", "deepspeed_multinode_launcher": "pdsh"}}


def test_flags_win_over_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "accel.yaml").write_text(yaml.safe_dump(ACCEL))
    # only the file: the spec names it (its lines stay in messages)
    job = _job(["--config_file", "conf/accel.yaml", "t.py", "--lr", "1"], tmp_path)
    assert job.fields == {"name": "t", "workdir": str(tmp_path), "entrypoint": "t.py", "args": ["--lr", "1"],
                          "accelerate_config": str(conf / "accel.yaml")}
    # top-level flags are laid over a copy; the settings' flags are the accelerate section; filters: one
    job = _job(["--config_file", "conf/accel.yaml", "--num_processes", "6", "--main_process_port", "29700",
                "--zero_stage", "3", "--mixed_precision", "bf16", "--deepspeed_exclusion_filter", "b:1",
                "--deepspeed_config_file", "ds.json", "t.py"], tmp_path)
    inline = job.fields["accelerate_config"]
    assert inline["num_processes"] == 6 and inline["main_process_port"] == 29700 and inline["num_machines"] == 2
    assert inline["deepspeed_config"]["deepspeed_hostfile"] == str(conf / "hostfile")  # from the file's directory
    assert job.fields["accelerate"] == {"zero_stage": 3, "mixed_precision": "bf16"}
    assert job.fields["exclude"] == "b:1" and "include" not in job.fields
    assert job.fields["deepspeed_config"] == str(tmp_path / "ds.json")
    # no file: --use_deepspeed and this machine's slots, as accelerate launch counts them
    job = _job(["--use_deepspeed", "--zero_stage", "2", "t.py"], tmp_path)
    assert job.fields["accelerate_config"] == {"compute_environment": "LOCAL_MACHINE",
                                               "distributed_type": "DEEPSPEED", "num_processes": 3}
    # accelerate config's default file is read when --config_file is not given
    default = Path(default_config_file({"HOME": str(tmp_path)}))
    default.parent.mkdir(parents=True)
    default.write_text(yaml.safe_dump({**ACCEL, "num_machines": 1}))
    job = _job(["t.py"], tmp_path)
    assert job.fields["accelerate_config"] == str(default) and any("default file" in n for n in job.notes)


def test_other_launches_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        _job(["--fsdp_version=2", "--megatron_lm_tp_degree=2", "t.py"], tmp_path)
    assert "--fsdp_version is for FSDP" in str(err.value) and "--megatron_lm_tp_degree is for Megatron-LM" in str(err.value)
    with pytest.raises(SpecError) as err:
        _job(["--cpu", "--use_fsdp", "t.py"], tmp_path)
    assert "--cpu is not supported: --cpu runs Accelerate without DeepSpeed" in str(err.value)
    assert "--use_fsdp is not supported" in str(err.value)
    # --gpu_ids other than 0..n-1: Accelerate would run on those devices alone; orch refuses, saying how
    (tmp_path / "one.yaml").write_text(yaml.safe_dump({**ACCEL, "num_machines": 1, "num_processes": 2}))
    (tmp_path / "t.py").write_text("print('hi')\n")
    from orchestrator.spec import spec_from_dict
    job = _job(["--config_file", "one.yaml", "--gpu_ids", "2,3", "t.py"], tmp_path)
    with pytest.raises(Exception) as err:
        spec_from_dict(job.fields, tmp_path)
    assert "gpu_ids" in str(err.value) and "CUDA_VISIBLE_DEVICES=2,3" in str(err.value)
    spec_from_dict(_job(["--config_file", "one.yaml", "--gpu_ids", "0,1", "t.py"], tmp_path).fields, tmp_path)
    with pytest.raises(SpecError) as err:
        _job(["t.py"], tmp_path)  # no file anywhere, no --use_deepspeed
    assert "would not use DeepSpeed" in str(err.value)


def test_orch_accelerate_launch_plans_without_a_micro_batch(tmp_path: Path) -> None:
    (tmp_path / "accel.yaml").write_text(yaml.safe_dump({**ACCEL, "num_machines": 1, "num_processes": 2}))
    (tmp_path / "t.py").write_text("print('hi')\n")
    env = {**os.environ, "ORCH_STATE_DIR": str(tmp_path / "state")}
    r = cli("-o", "json", "accelerate-launch", "--plan", "--config_file", "accel.yaml", "--gradient_clipping", "0.5",
            "t.py", "--lr", "1", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["world_size"] == 2 and plan["launcher"] == "standard"
    assert plan["deepspeed_autos"]["filled_by"] == "script"
    assert plan["deepspeed_config"]["train_micro_batch_size_per_gpu"] == "auto"
    assert plan["deepspeed_config"]["gradient_clipping"] == 0.5
    rank = plan["nodes"][0]["ranks"][1]
    assert rank["argv"][-3:] == [str(tmp_path / "t.py"), "--lr", "1"]
    assert rank["env"]["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    r = cli("accelerate-launch", "--fp8_backend", "te", "t.py", cwd=tmp_path, env=env)
    assert r.returncode == 2 and "--fp8_backend is for FP8 recipes" in r.stderr and "Traceback" not in r.stderr
