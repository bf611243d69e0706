"""Accelerate config files as job settings (orchestrator.spec.accelerate), checked against
Accelerate 1.15 itself: its launch code (``_validate_launch_command`` + ``prepare_deepspeed_cmd_env``)
gives the environment and command ``accelerate launch`` would give, and its ``DeepSpeedPlugin``
gives the DeepSpeed config the script would use. Nothing is started (the CLI tests run ``orch plan``)."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path

import pytest
import yaml
from accelerate_oracle import accelerate_ds_config, accelerate_launch, printless

from orchestrator.spec import AccelerateSettings, job_deepspeed, load_accelerate_config
from orchestrator.errors import ConfigError, SpecError
from orchestrator.spec import spec_from_dict

# ------------------------------------------------------------------ the Accelerate guide's examples
# (shared/seeds/000_*.txt: the two plugin examples, the two config-file examples, scenarios 1-3)

EX_ZERO2 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
 gradient_accumulation_steps: 1
 gradient_clipping: 1.0
 offload_optimizer_device: none
 offload_param_device: none
 zero3_init_flag: true
 zero_stage: 2
distributed_type: DEEPSPEED
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""
EX_ZERO3_OFFLOAD = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""
EX_FILE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
 deepspeed_config_file: {file}
 zero3_init_flag: true
distributed_type: DEEPSPEED
fsdp_config: {{}}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""
ZERO2_JSON = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
             "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True,
                                              "adam_w_mode": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": 1, "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
ZERO3_OFFLOAD_JSON = {
    "fp16": ZERO2_JSON["fp16"],
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": ZERO2_JSON["scheduler"],
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
    "gradient_accumulation_steps": 1, "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
SCENARIO_1 = """\
command_file: null
commands: null
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: 'cpu'
  offload_param_device: 'cpu'
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
  deepspeed_config_file: 'ds_config.json'
distributed_type: DEEPSPEED
downcast_bf16: 'no'
dynamo_backend: 'NO'
fsdp_config: {}
gpu_ids: null
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_name: null
tpu_zone: null
use_cpu: false
"""
SCENARIO_1_JSON = {"bf16": {"enabled": True},
                   "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                                         "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
                   "gradient_clipping": 1.0, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": 10, "steps_per_print": 2000000}
SCENARIO_2 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ds_config.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
dynamo_backend: 'NO'
fsdp_config: {}
machine_rank: 0
main_training_function: main
megatron_lm_config: {}
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""
SCENARIO_3_JSON = {"bf16": {"enabled": "auto"},
                   "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                                         "offload_optimizer": {"device": "auto"}, "offload_param": {"device": "auto"}},
                   "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "steps_per_print": 2000000}
#: ``accelerate launch --mixed_precision="fp16" --zero_stage=3 --gradient_accumulation_steps=5 ...`` of scenario 3
SCENARIO_3_FLAGS = {"mixed_precision": "fp16", "zero_stage": 3, "gradient_accumulation_steps": 5,
                    "gradient_clipping": 1.0, "offload_param_device": "cpu", "offload_optimizer_device": "cpu",
                    "zero3_save_16bit_model": True}


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "zero_stage2_config.json").write_text(json.dumps(ZERO2_JSON))
    (tmp_path / "zero_stage3_offload_config.json").write_text(json.dumps(ZERO3_OFFLOAD_JSON))
    return tmp_path


def _write(directory: Path, name: str, text: str) -> Path:
    p = directory / name
    p.write_text(text)
    return p


def _spec(project: Path, accel: Path | dict, **fields):
    return spec_from_dict({"name": "acc", "entrypoint": "train.py", "accelerate_config": str(accel)
                           if isinstance(accel, Path) else accel, **fields}, project)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orch_side(spec, world: int, path: str = "/run/ds_config.json") -> tuple[dict, dict[str, str], tuple[str, ...]]:
    """orch's resolved config, the ACCELERATE_* (and PYTHONPATH) it gives every rank, its warnings."""
    job = job_deepspeed(spec, [world], os.environ)
    return job.config, job.env(path), job.warnings


# ------------------------------------------------------------------ the guide's examples


@pytest.mark.parametrize("text", [EX_ZERO2, EX_ZERO3_OFFLOAD], ids=["zero2", "zero3-offload"])
def test_plugin_examples_match_accelerate(project, text, monkeypatch) -> None:
    accel = _write(project, "accel.yaml", text)
    spec = _spec(project, accel, micro_batch_size=16)
    # one machine: torchrun with num_processes processes (Accelerate's single-machine DeepSpeed path)
    assert (spec.launcher, spec.num_nodes, spec.num_gpus, spec.no_local_rank, spec.hostfile) == (
        "standard", 1, 2, False, None)
    assert spec.deepspeed_config is None and spec.master_port == "auto"
    cmd, real_env = accelerate_launch(accel, {}, project, monkeypatch)
    assert cmd is None
    config, env, warnings = orch_side(spec, world=2)
    assert env == real_env
    assert config == accelerate_ds_config(real_env, project, monkeypatch, micro=16, world=2)
    zero = config["zero_optimization"]
    assert config["fp16"] == {"enabled": True, "auto_cast": True} and config["train_batch_size"] == 32
    if zero["stage"] == 2:  # zero3_init_flag: true at stage 2 is turned off by Accelerate, with a warning
        assert any("zero3_init_flag" in w for w in warnings)
    else:
        assert zero["offload_param"] == {"device": "cpu", "nvme_path": None}
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("json_name", ["zero_stage2_config.json", "zero_stage3_offload_config.json"])
def test_config_file_examples_are_refused_for_their_mixed_precision(project, json_name, monkeypatch) -> None:
    """The guide's config-file examples also set mixed_precision: fp16, which Accelerate 1.15 refuses
    beside a DeepSpeed config file (the guide predates that check); so does orch, naming the key."""
    accel = _write(project, "accel.yaml", EX_FILE.format(file=json_name))
    with pytest.raises(SpecError) as err:
        _spec(project, accel, micro_batch_size=24, hidden_size=1600)
    assert [p for p, _ in err.value.problems] == ["accelerate_config.mixed_precision"]
    assert "accel.yaml line 11" in str(err.value) and "fp16.enabled / bf16.enabled" in str(err.value)
    _, real_env = accelerate_launch(accel, {}, project, monkeypatch)
    from accelerate.utils import DeepSpeedPlugin
    with monkeypatch.context() as m:  # Accelerate itself: the same refusal, in the script
        for k, v in real_env.items():
            m.setenv(k, v)
        with pytest.raises(ValueError, match="When using `deepspeed_config_file`"):
            DeepSpeedPlugin()


@pytest.mark.parametrize("json_name, hidden", [("zero_stage2_config.json", 1600),
                                               ("zero_stage3_offload_config.json", 1280)])
def test_config_file_examples_without_mixed_precision_match_accelerate(project, json_name, hidden,
                                                                       monkeypatch) -> None:
    accel = _write(project, "accel.yaml", EX_FILE.format(file=json_name).replace("mixed_precision: fp16\n", ""))
    spec = _spec(project, accel, micro_batch_size=24, hidden_size=hidden)
    assert spec.deepspeed_config == str(project / json_name)
    _, real_env = accelerate_launch(accel, {}, project, monkeypatch)
    config, env, warnings = orch_side(spec, world=2)
    # the script reads orch's resolved copy instead of the file the Accelerate config names
    assert real_env.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE") == json_name
    assert env.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE") == "/run/ds_config.json"
    assert env == real_env
    assert printless(config) == accelerate_ds_config({**real_env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": json_name},
                                                      project, monkeypatch, micro=24, world=2, hidden=hidden)
    assert config["optimizer"]["params"]["lr"] == "auto"  # the script's DummyOptim fills it
    assert any("DummyOptim" in w for w in warnings)
    assert config["zero_optimization"]["reduce_bucket_size"] == hidden * hidden


def test_scenario_1_is_refused_naming_every_conflicting_key(project) -> None:
    _write(project, "ds_config.json", json.dumps(SCENARIO_1_JSON))
    accel = _write(project, "accel.yaml", SCENARIO_1)
    with pytest.raises(ConfigError) as err:
        load_accelerate_config(accel)
    keys = ["gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device", "offload_param_device",
            "zero3_save_16bit_model", "zero_stage"]
    assert [p for p, _ in err.value.problems] == [f"deepspeed_config.{k}" for k in keys]
    text = str(err.value)
    assert text.startswith(f"Accelerate config {accel} has 6 problems:\n")
    assert "deepspeed_config.zero_stage (line 11): is set beside a DeepSpeed config file (ds_config.json)" in text
    assert "set zero_optimization.stage in the DeepSpeed config file instead" in text
    with pytest.raises(SpecError) as err:  # from a job spec: the same problems, under accelerate_config
        _spec(project, accel)
    assert [p for p, _ in err.value.problems] == [f"accelerate_config.deepspeed_config.{k}" for k in keys]


def test_scenario_2_resolves_as_documented(project, monkeypatch) -> None:
    _write(project, "ds_config.json", json.dumps(SCENARIO_1_JSON))
    accel = _write(project, "accel.yaml", SCENARIO_2)
    spec = _spec(project, accel, micro_batch_size=2)
    assert spec.num_gpus == 4
    _, real_env = accelerate_launch(accel, {}, project, monkeypatch)
    config, env, _ = orch_side(spec, world=4)
    # the guide's output: bf16 on, fp16 added as off, accumulation 10, the rest as written
    assert config == {**SCENARIO_1_JSON, "fp16": {"enabled": False}, "train_batch_size": 2 * 10 * 4,
                      "train_micro_batch_size_per_gpu": 2}
    assert printless(config) == accelerate_ds_config(real_env, project, monkeypatch, micro=2, world=4)
    assert {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_config.json"} == real_env


def test_scenario_3_flags_fill_the_autos(project, monkeypatch) -> None:
    _write(project, "ds_config.json", json.dumps(SCENARIO_3_JSON))
    accel = _write(project, "accel.yaml", SCENARIO_2)
    spec = _spec(project, accel, micro_batch_size=2, accelerate=SCENARIO_3_FLAGS)  # flags do not count as ambiguous
    _, real_env = accelerate_launch(accel, SCENARIO_3_FLAGS, project, monkeypatch)
    config, env, _ = orch_side(spec, world=4)
    assert config == {"bf16": {"enabled": False}, "fp16": {"enabled": True, "auto_cast": True},
                      "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
                      "gradient_clipping": 1.0, "train_batch_size": 2 * 5 * 4, "train_micro_batch_size_per_gpu": 2,
                      "gradient_accumulation_steps": 5, "steps_per_print": 2000000}
    assert printless(config) == accelerate_ds_config(real_env, project, monkeypatch, micro=2, world=4)
    assert {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_config.json"} == real_env


def test_scenario_3_as_written_is_refused_for_nvme_without_a_path(project) -> None:
    """The guide's scenario 3 passes --offload_optimizer_device nvme and no NVMe path: Accelerate
    starts it (DeepSpeed fails later, with nowhere to swap to); orch refuses it while planning."""
    _write(project, "ds_config.json", json.dumps(SCENARIO_3_JSON))
    accel = _write(project, "accel.yaml", SCENARIO_2)
    spec = _spec(project, accel, micro_batch_size=2, accelerate={**SCENARIO_3_FLAGS, "offload_optimizer_device": "nvme"})
    with pytest.raises(ConfigError) as err:
        orch_side(spec, world=4)
    assert [p for p, _ in err.value.problems] == ["zero_optimization.offload_optimizer.nvme_path"]
    assert str(err.value).startswith(f"DeepSpeed config {project / 'ds_config.json'} has 1 problem:")


# ------------------------------------------------------------------ the ambiguity rule


@pytest.mark.parametrize("key, value", [("gradient_accumulation_steps", 2), ("gradient_clipping", 1.0),
                                        ("zero_stage", 2), ("offload_optimizer_device", "none"),
                                        ("offload_param_device", "cpu"), ("zero3_save_16bit_model", False),
                                        ("offload_optimizer_nvme_path", "/nvme"), ("offload_param_nvme_path", "/nv")])
def test_each_setting_beside_a_config_file_is_refused(project, key, value) -> None:
    _write(project, "ds.json", json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}))
    section = {"deepspeed_config_file": "ds.json", "zero3_init_flag": False}
    text = yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": {**section, key: value}})
    with pytest.raises(ConfigError) as err:
        load_accelerate_config(_write(project, "a.yaml", text))
    assert [p for p, _ in err.value.problems] == [f"deepspeed_config.{key}"]
    # without it: accepted (deepspeed_config_file and zero3_init_flag are what Accelerate asks then)
    load_accelerate_config(_write(project, "b.yaml", yaml.safe_dump({"distributed_type": "DEEPSPEED",
                                                                      "deepspeed_config": section})))


def test_settings_beside_the_specs_own_deepspeed_config_are_refused(project) -> None:
    accel = _write(project, "accel.yaml", EX_ZERO2)
    with pytest.raises(SpecError) as err:
        _spec(project, accel, deepspeed_config="zero_stage2_config.json")
    assert len(err.value.problems) == 6  # five section keys (not zero3_init_flag) and mixed_precision
    assert all("zero_stage2_config.json" in m for _, m in err.value.problems)
    inline = dict(ZERO2_JSON, fp16={"enabled": False})
    with pytest.raises(SpecError, match="given inline in the job spec"):
        _spec(project, accel, deepspeed_config=inline)


# ------------------------------------------------------------------ bad files: every problem, with lines


def test_every_problem_of_a_file_is_listed_with_its_line(project) -> None:
    accel = _write(project, "accel.yaml", textwrap.dedent("""\
        distributed_type: MULTI_GPU
        deepspeed_config:
          zero_stage: 5
          offload_param_device: disk
          zero_stagee: 2
        num_machines: 2
        num_processes: 3
        bogus: 1
        """))
    with pytest.raises(ConfigError) as err:
        load_accelerate_config(accel)
    problems = dict(err.value.problems)
    assert set(problems) == {"deepspeed_config.zero_stage", "deepspeed_config.offload_param_device",
                             "deepspeed_config.zero_stagee", "bogus"}  # types first; then the rules
    text = str(err.value)
    assert "deepspeed_config.zero_stage (line 3): Input should be less than or equal to 3; got 5" in text
    assert "deepspeed_config.offload_param_device (line 4): Input should be 'none', 'cpu' or 'nvme'" in text
    assert "deepspeed_config.zero_stagee (line 5): unknown key" in text and "zero_stage, gradient_accumulation" in text
    assert "bogus (line 8): unknown key" in text and "distributed_type" in problems["bogus"]
    fixed = accel.read_text().replace("zero_stage: 5", "zero_stage: 2").replace("disk", "cpu").replace(
        "  zero_stagee: 2\n", "").replace("bogus: 1\n", "")
    with pytest.raises(ConfigError) as err:
        load_accelerate_config(_write(project, "accel.yaml", fixed))
    assert dict(err.value.problems).keys() == {"distributed_type", "num_processes"}
    assert "distributed_type (line 1): is 'MULTI_GPU'; orch runs DeepSpeed jobs only" in str(err.value)
    assert "num_processes (line 6): 3 is not a multiple of num_machines 2" in str(err.value)
    good = fixed.replace("MULTI_GPU", "DEEPSPEED").replace("num_processes: 3", "num_processes: 4")
    assert load_accelerate_config(_write(project, "accel.yaml", good)).num_machines == 2


def test_unreadable_files(project) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_accelerate_config(project / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML at line 3"):
        load_accelerate_config(_write(project, "bad.yaml", "a: 1\nb: [\n"))
    with pytest.raises(ConfigError, match="distributed_type.*is missing"):
        load_accelerate_config(_write(project, "empty.yaml", ""))
    with pytest.raises(SpecError) as err:  # in a spec: one problem of the spec, no traceback
        _spec(project, project / "nope.yaml")
    assert [p for p, _ in err.value.problems] == ["accelerate_config"]


def test_the_accelerate_section_needs_an_accelerate_config(project) -> None:
    with pytest.raises(SpecError) as err:
        spec_from_dict({"name": "a", "entrypoint": "train.py", "accelerate": {"zero_stage": 3}}, project)
    assert [p for p, _ in err.value.problems] == ["accelerate"]
    with pytest.raises(SpecError, match=r"accelerate\.zero_stage: Input should be less than or equal to 3"):
        _spec(project, _write(project, "a.yaml", EX_ZERO2), accelerate={"zero_stage": 4})


# ------------------------------------------------------------------ merging into the spec


def test_the_spec_wins_over_the_file(project) -> None:
    text = EX_ZERO2.replace("num_machines: 1", "num_machines: 2").replace("num_processes: 2", "num_processes: 4") \
        .replace("main_process_port: null", "main_process_port: 29601") \
        .replace("main_process_ip: null", "main_process_ip: 10.0.0.1") \
        .replace(" zero_stage: 2\n", " zero_stage: 2\n deepspeed_hostfile: hosts-a\n")
    accel = _write(project, "accel.yaml", text)
    for name in ("hosts-a", "hosts-b"):
        _write(project, name, "n0 slots=2\nn1 slots=2\nn2 slots=2\n")
    spec = _spec(project, accel)
    assert (spec.hostfile, spec.launcher, spec.num_nodes, spec.num_gpus, spec.master_addr, spec.master_port,
            spec.no_local_rank) == (str(project / "hosts-a"), "pdsh", 2, 2, "10.0.0.1", 29601, True)
    mine = _spec(project, accel, hostfile="hosts-b", launcher="standard", master_port="auto", num_nodes=3,
                 master_addr="10.9.9.9")
    assert (mine.hostfile, mine.launcher, mine.num_nodes, mine.num_gpus, mine.master_addr, mine.master_port,
            mine.no_local_rank) == (str(project / "hosts-b"), "standard", 3, 2, "10.9.9.9", "auto", False)
    assert spec_from_dict(spec.to_dict()) == spec  # a stored spec means the same thing (the merge is idempotent)
    filtered = _spec(project, accel, include="n1@n2")
    assert (filtered.include, filtered.num_nodes, filtered.num_gpus) == ("n1@n2", -1, -1)


@pytest.mark.parametrize("launcher, section, expect", [
    ("pdsh", {}, {"no_local_rank": True, "num_nodes": 2, "num_gpus": 2}),
    ("nossh", {}, {"no_local_rank": False, "num_nodes": 2, "num_gpus": 2}),
    ("pdsh", {"deepspeed_exclusion_filter": "n1:1"}, {"exclude": "n1:1", "num_nodes": -1, "num_gpus": -1}),
    ("pdsh", {"deepspeed_inclusion_filter": "n0@n1"}, {"include": "n0@n1", "num_nodes": -1, "num_gpus": -1}),
])
def test_multi_machine_mapping_matches_accelerates_deepspeed_command(project, launcher, section, expect,
                                                                     monkeypatch) -> None:
    port = _free_port()
    _write(project, "hosts", "n0 slots=2\nn1 slots=2\n")
    data = {"distributed_type": "DEEPSPEED", "num_machines": 2, "num_processes": 4, "main_process_ip": "10.0.0.1",
            "main_process_port": port, "mixed_precision": "no",
            "deepspeed_config": {"zero_stage": 2, "deepspeed_hostfile": str(project / "hosts"),
                                 "deepspeed_multinode_launcher": launcher, **section}}
    accel = _write(project, "accel.yaml", yaml.safe_dump(data))
    spec = _spec(project, accel, micro_batch_size=1)
    for key, value in expect.items():
        assert getattr(spec, key) == value, key
    cmd, real_env = accelerate_launch(accel, {}, project, monkeypatch)
    # the command Accelerate runs, rebuilt from orch's spec
    rebuilt = ["deepspeed", "--hostfile", spec.hostfile]
    rebuilt += ["--node_rank", "0", "--no_ssh"] if launcher == "nossh" else ["--no_local_rank", "--launcher", launcher]
    if spec.exclude:
        rebuilt += ["--exclude", spec.exclude]
    elif spec.include:
        rebuilt += ["--include", spec.include]
    else:
        rebuilt += ["--num_gpus", str(spec.num_gpus)]
    rebuilt += ["--master_addr", spec.master_addr, "--master_port", str(spec.master_port), "train.py", "--x"]
    assert cmd == rebuilt
    _, env, _ = orch_side(spec, world=4)
    assert env == real_env


def test_notes_on_keys_orch_does_not_use(project) -> None:
    text = EX_ZERO2.replace("machine_rank: 0", "machine_rank: 1").replace("use_cpu: false", "use_cpu: true") \
        + "gpu_ids: 0,1\n"
    spec = _spec(project, _write(project, "accel.yaml", text), micro_batch_size=1)
    warnings = job_deepspeed(spec, [2], {}).warnings
    assert any("machine_rank 1 is not used" in w for w in warnings)
    assert any("gpu_ids '0,1' is not used" in w for w in warnings)
    assert any("use_cpu is not used" in w for w in warnings)
    quiet = job_deepspeed(_spec(project, _write(project, "b.yaml", EX_ZERO3_OFFLOAD), micro_batch_size=1), [2], {})
    assert quiet.warnings == ()


def test_nvme_paths_reach_the_script(project) -> None:
    """Accelerate's plugin reads ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH but its launcher never sets
    them; orch does, so the path given in the Accelerate config is not lost."""
    data = {"distributed_type": "DEEPSPEED", "num_processes": 1,
            "deepspeed_config": {"zero_stage": 3, "offload_param_device": "nvme", "offload_param_nvme_path": "/nv"}}
    spec = _spec(project, _write(project, "a.yaml", yaml.safe_dump(data)), micro_batch_size=1)
    config, env, _ = orch_side(spec, world=1)
    assert config["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": "/nv"}
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] == "/nv"
    data["deepspeed_config"].pop("offload_param_nvme_path")
    spec = _spec(project, _write(project, "a.yaml", yaml.safe_dump(data)), micro_batch_size=1)
    with pytest.raises(ConfigError, match="offload_param.nvme_path: parameter offload to NVMe needs"):
        orch_side(spec, world=1)


def test_settings_precedence_flags_over_file() -> None:
    cfg = load_accelerate_config({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                                  "deepspeed_config": {"zero_stage": 1, "gradient_clipping": 0.5}})
    s = cfg.settings(AccelerateSettings(zero_stage=3))
    assert (s.zero_stage, s.gradient_clipping, s.mixed_precision) == (3, 0.5, "bf16")
    assert s.explicit == {"zero_stage", "gradient_clipping", "mixed_precision"}


def test_model_config_gives_the_hidden_size(project) -> None:
    (project / "model").mkdir()
    (project / "model" / "config.json").write_text(json.dumps({"hidden_sizes": [32, 64]}))
    _write(project, "ds.json", json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
                                           "train_micro_batch_size_per_gpu": 2}))
    accel = _write(project, "a.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config: {deepspeed_config_file: ds.json}\n")
    spec = _spec(project, accel, model_config="model")
    assert spec.model_config_path == str(project / "model") and spec.to_dict()["model_config"] == str(project / "model")
    assert job_deepspeed(spec, [2], {}).config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert job_deepspeed(spec.model_copy(update={"hidden_size": 8}), [2], {}).config[
        "zero_optimization"]["reduce_bucket_size"] == 64  # hidden_size wins over model_config
    with pytest.raises(SpecError) as err:
        _spec(project, accel, model_config="missing")
    assert [p for p, _ in err.value.problems] == ["model_config"]


# ------------------------------------------------------------------ the command line


def test_orch_plan_from_an_accelerate_config_and_a_script(project, orch) -> None:
    accel = _write(project, "accel.yaml", EX_ZERO2)
    r = orch("plan", "--accelerate-config", str(accel), "--micro-batch-size", "4", str(project / "train.py"),
             "--lr", "0.1", "--output", "json")  # everything after the script is the script's, as in accelerate launch
    assert r.returncode == 0 and r.stdout.startswith("Plan for job 'train'")  # a table: --output went to the script
    assert "train.py --lr 0.1 --output json" in r.stdout.replace("\n", " ")
    r = orch("plan", "--output", "json", "--accelerate-config", str(accel), "--micro-batch-size", "4",
             "--zero-stage", "1", str(project / "train.py"), "--lr", "0.1")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["job_name"] == "train" and plan["launcher"] == "standard" and plan["world_size"] == 2
    rank = plan["nodes"][0]["ranks"][1]
    assert rank["argv"][-3:] == [str(project / "train.py"), "--lr", "0.1"]
    assert rank["env"]["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "1" and rank["env"]["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert rank["env"]["ORCH_DEEPSPEED_CONFIG"] == plan["deepspeed_config_path"]
    assert plan["deepspeed_config"]["zero_optimization"]["stage"] == 1  # --zero-stage wins over the file's 2
    assert plan["deepspeed_config"]["train_batch_size"] == 8
    assert any("zero3_init_flag" in w for w in plan["warnings"])
    table = orch("plan", "--accelerate-config", str(accel), "--micro-batch-size", "4", str(project / "train.py"))
    assert table.returncode == 0 and "DeepSpeed config, resolved" in table.stdout
    assert '"train_micro_batch_size_per_gpu": 4' in table.stdout


def test_orch_plan_of_a_spec_with_options_after_it(project, orch) -> None:
    accel = _write(project, "accel.yaml", EX_ZERO2)
    spec = _write(project, "job.yaml", f"name: j\nentrypoint: train.py\naccelerate_config: {accel}\n"
                                       "accelerate: {zero_stage: 1}\n")
    r = orch("plan", str(spec), "--output", "json", "--micro-batch-size", "2", "--gradient-clipping", "0.5")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    # the section is amended by the flags, not replaced
    assert plan["deepspeed_config"]["zero_optimization"]["stage"] == 1
    assert plan["deepspeed_config"]["gradient_clipping"] == 0.5 and plan["deepspeed_config"]["train_batch_size"] == 4
    r = orch("plan", str(spec), "--micro-batch-size", "2", "--lr", "1")
    assert r.returncode == 2 and "Unexpected arguments after the job spec" in r.stderr and "--lr 1" in r.stderr
    # no micro batch: as under accelerate launch, the script's Accelerate fills the batch sizes in prepare()
    r = orch("plan", str(spec), "--output", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["deepspeed_autos"]["filled_by"] == "script"
    assert {"train_micro_batch_size_per_gpu", "train_batch_size"} <= set(plan["deepspeed_autos"]["left_auto"])
    assert plan["deepspeed_config"]["train_micro_batch_size_per_gpu"] == "auto"
    assert plan["deepspeed_config"]["zero_optimization"]["stage"] == 1


# ------------------------------------------------------------------ into the plan


def test_the_plan_gives_every_rank_the_accelerate_environment(project) -> None:
    import collections

    from orchestrator.planning import PlanInputs, make_plan, resolve_pool
    accel = _write(project, "accel.yaml", EX_ZERO2)
    spec = _spec(project, accel, micro_batch_size=2, env={"ACCELERATE_GRADIENT_CLIPPING": "0.5", "PYTHONPATH": "/mine",
                                                          "PYTORCH_NVML_BASED_CUDA_CHECK": "0"})
    job = job_deepspeed(spec, [2], {"PYTHONPATH": "/controller"})
    inputs = PlanInputs(job_id="acc-1", master_port=29555, run_dir="/runs/acc/attempt-1", checkpoint_dir="/ck",
                        python="/usr/bin/python3", deepspeed_config=job.config,
                        accelerate_env_defaults=job.env_defaults(), config_warnings=job.warnings)
    inputs = __import__("dataclasses").replace(inputs, accelerate_env=job.env(inputs.deepspeed_config_path))
    plan = make_plan(spec, resolve_pool(collections.OrderedDict(localhost=2), num_gpus=spec.num_gpus), inputs)
    env = plan.nodes[0].ranks[1].env
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"  # the spec's env wins
    assert env["PYTHONPATH"] == f"/mine:{project}"  # accelerate launch appends its directory to the PYTHONPATH it has
    assert env["ORCH_DEEPSPEED_CONFIG"] == "/runs/acc/attempt-1/ds_config.json"  # built from the Accelerate config
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and plan.launcher == "standard"
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in plan.nodes[0].env_defaults  # the spec's env sets it
    assert plan.deepspeed_config["train_batch_size"] == 4 and plan.warnings == job.warnings
    no_accel = job_deepspeed(spec.model_copy(update={"accelerate_config": None}), [2], {})
    assert no_accel.config == {} and no_accel.env("/x") == {} and no_accel.env_defaults() == {}
