"""Job spec loading and validation: every problem listed, by field path and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HF_DS

from orchestrator.errors import SpecError
from orchestrator.spec import load_deepspeed_config, load_spec, pass_through, spec_from_dict


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    return tmp_path


def test_valid_spec_resolves_paths(project: Path) -> None:
    p = _write(project, "name: demo\nhostfile: hosts\nentrypoint: train.py\ndeepspeed_config: ds.json\n"
                        "env: {OMP_NUM_THREADS: 1}\nargs: [--steps, 30]\n")
    spec = load_spec(p)
    assert spec.hostfile == str(project / "hosts")
    assert spec.entrypoint == str(project / "train.py")
    assert spec.workdir == str(project)
    assert spec.env == {"OMP_NUM_THREADS": "1"}
    assert spec.args == ["--steps", "30"]
    assert spec.launcher == "pdsh" and spec.provisioner == "local" and spec.master_port == "auto"
    assert load_deepspeed_config(spec) == {"train_micro_batch_size_per_gpu": 2}
    again = spec_from_dict(spec.to_dict())  # a stored spec means the same thing
    assert again == spec


def test_a_misspelled_field_gets_a_did_you_mean(project: Path) -> None:
    p = _write(project, "name: x\nentrypoint: train.py\ndeepspeed_confg: {}\nrestart: {max_restart: 1}\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    msg = str(err.value)
    assert "deepspeed_confg (line 3): unknown field; did you mean deepspeed_config? valid fields are:" in msg
    assert "restart.max_restart (line 4): unknown field; did you mean max_restarts? valid fields of restart" in msg


def test_a_misspelled_command_gets_a_did_you_mean(capsys) -> None:
    from orchestrator.face.cli.app import main
    with pytest.raises(SystemExit) as exit_:
        main(["stauts"])
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "invalid choice: 'stauts'" in err and err.endswith("did you mean 'status'?")


def test_every_problem_is_listed_with_field_and_line(project: Path) -> None:
    p = _write(project, "name: 'bad name'\nlauncher: foo\nmaster_port: 70000\nenv:\n  B: true\n"
                        "bogus: 1\nnum_nodes: x\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    fields = [f for f, _ in err.value.problems]
    assert set(fields) == {"name", "launcher", "master_port", "env.B", "bogus", "num_nodes", "entrypoint"}
    msg = str(err.value)
    assert str(p) in msg and "7 problems" in msg
    assert "launcher (line 2)" in msg and "'foo'" in msg and "pdsh" in msg
    assert "bogus (line 6): unknown field; valid fields are:" in msg
    assert "entrypoint" in msg and "required" in msg
    assert "env.B (line 5)" in msg and "quotes" in msg  # env B: true is a YAML boolean
    lines = [int(m) for m in __import__("re").findall(r"\(line (\d+)\)", msg)]
    assert lines == sorted(lines)  # listed in file order


def test_missing_files_are_problems(project: Path) -> None:
    p = _write(project, "name: demo\nhostfile: nope\nentrypoint: missing.py\ndeepspeed_config: gone.json\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    problems = dict(err.value.problems)
    assert "no such file" in problems["hostfile"] and str(project / "nope") in problems["hostfile"]
    assert str(project / "missing.py") in problems["entrypoint"]
    assert "gone.json" in problems["deepspeed_config"]


def test_bad_json_config_names_line(project: Path) -> None:
    (project / "bad.json").write_text('{\n  "a": 1,\n}\n')
    p = _write(project, "name: demo\nentrypoint: train.py\ndeepspeed_config: bad.json\n")
    with pytest.raises(SpecError, match="not valid JSON.*line 3"):
        load_spec(p)


def test_yaml_syntax_error_names_line(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: [train.py\n")
    with pytest.raises(SpecError, match="not valid YAML at line"):
        load_spec(p)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize("extra,needle", [
    ("include: w0\nexclude: w1\n", "mutually exclusive"),
    ("include: w0\nnum_nodes: 1\n", "cannot be combined"),
    ("module: true\nno_python: true\n", "cannot both"),
    ("args: --steps 3\n", "list of strings"),
    ("env: {1BAD: x}\n", "not a valid environment variable name"),
    ("stop_grace_seconds: 0\n", "greater than 0"),
])
def test_cross_field_rules(project: Path, extra: str, needle: str) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\n" + extra)
    with pytest.raises(SpecError, match=needle):
        load_spec(p)


def test_spec_must_be_a_mapping(project: Path) -> None:
    p = _write(project, "- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(p)


def test_every_bad_env_value_is_reported(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\nenv:\n  A: true\n  B: [1, 2]\n  C: 3\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    assert sorted(f for f, _ in err.value.problems) == ["env.A", "env.B"]


def test_cross_field_problems_point_at_their_lines(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\ninclude: a\nexclude: b\nnum_gpus: 1\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    msg = str(err.value)
    assert "exclude (line 4): include and exclude are mutually exclusive" in msg
    assert "num_gpus (line 5): num_gpus cannot be combined with include/exclude" in msg


def test_what_this_version_cannot_run_is_a_spec_problem(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\nprovisioner: k8s\n")
    with pytest.raises(SpecError, match=r"provisioner \(line 3\): Input should be 'local', 'ssh', 'ray' or 'slurm'; got 'k8s'"):
        load_spec(p)


def test_duplicate_keys_are_refused(project: Path) -> None:
    p = _write(project, "name: a\nentrypoint: train.py\nname: b\n")
    with pytest.raises(SpecError, match=r"line 3.*'name' appears twice \(first on line 1\)"):
        load_spec(p)


def test_deepspeed_config_of_the_wrong_kind(project: Path) -> None:
    p = _write(project, "name: a\nentrypoint: train.py\ndeepspeed_config: [1, 2]\n")
    with pytest.raises(SpecError, match=r"deepspeed_config \(line 3\): expected the path of a DeepSpeed config.*"
                                        r"or the config as a mapping; got list \[1, 2\]"):
        load_spec(p)


def test_no_python_entrypoint_follows_path_lookup(project: Path) -> None:
    (project / "run.sh").write_text("#!/bin/sh\n")
    (project / "run.sh").chmod(0o755)
    p = _write(project, "name: a\nentrypoint: run.sh\nno_python: true\n")
    with pytest.raises(SpecError, match=r"no executable 'run.sh' on PATH.*write ./run.sh"):
        load_spec(p)
    p = _write(project, "name: a\nentrypoint: ./run.sh\nno_python: true\n")
    assert load_spec(p).entrypoint == "./run.sh"
    p = _write(project, "name: a\nentrypoint: /bin/true\nno_python: true\n")
    assert load_spec(p).entrypoint == "/bin/true"


def test_hostfile_that_is_a_directory(project: Path) -> None:
    p = _write(project, f"name: a\nentrypoint: train.py\nhostfile: {project}\n")
    with pytest.raises(SpecError, match="is a directory, not a file"):
        load_spec(p)


@pytest.mark.parametrize(("section", "fields"), [
    ("restart: {max_restart: 1}", "valid fields of restart are: max_restarts, backoff_seconds"),
    ("ssh: {usr: me}", "valid fields of ssh are: user, port"),
    ("ray: {adress: auto}", "valid fields of ray are: address, connect_timeout"),
    ("preflight: {bogus: true}", "valid fields of preflight are: enabled"),
])
def test_an_unknown_field_in_a_section_lists_that_sections_fields(project: Path, section: str, fields: str) -> None:
    p = _write(project, f"name: demo\nentrypoint: train.py\n{section}\n")
    with pytest.raises(SpecError) as info:
        load_spec(p)
    assert fields in str(info.value) and "(line 3)" in str(info.value)
    assert "hostfile" not in str(info.value)  # not the top-level fields


def test_a_section_of_the_wrong_kind_says_what_it_takes(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\nrestart: 3\npreflight: 'yes'\n")
    with pytest.raises(SpecError) as info:
        load_spec(p)
    text = str(info.value)
    assert "restart (line 3): expected a mapping with the fields max_restarts," in text and "got 3" in text
    assert "preflight (line 4): expected a mapping with the fields enabled," in text and "or true/false" in text
    assert "RestartPolicy" not in text and "PreflightOptions" not in text


def test_files_that_are_not_utf8_are_one_clear_error(project: Path) -> None:
    p = project / "latin1.yaml"
    p.write_bytes(b"name: demo\nentrypoint: caf\xe9.py\n")
    with pytest.raises(SpecError, match=r"latin1.yaml is not UTF-8 text \(bad byte at offset 26\)"):
        load_spec(p)
    (project / "bin.json").write_bytes(b"\xff{}")
    p = _write(project, "name: demo\nentrypoint: train.py\ndeepspeed_config: bin.json\n")
    with pytest.raises(SpecError, match=r"bin.json is not UTF-8 text \(bad byte at offset 0\)"):
        load_deepspeed_config(load_spec(p))


def test_env_passthrough_copies_from_the_given_environment_and_env_wins(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\nenv: {WANDB_MODE: offline}\n"
                        "env_passthrough: [WANDB_*, HF_TOKEN, 'NODE[01]_ADDR', NOT_SET_ANYWHERE]\n")
    shell = {"WANDB_API_KEY": "k", "WANDB_MODE": "online", "HF_TOKEN": "t", "NODE0_ADDR": "a", "NODE2_ADDR": "b",
             "wandb_lower": "no", "OTHER": "o"}
    spec, copied, unmatched = pass_through(load_spec(p), shell)
    assert copied == ["HF_TOKEN", "NODE0_ADDR", "WANDB_API_KEY"]  # case-sensitive, whole names
    assert spec.env == {"WANDB_MODE": "offline", "HF_TOKEN": "t", "NODE0_ADDR": "a", "WANDB_API_KEY": "k"}
    assert unmatched == ["NOT_SET_ANYWHERE"]
    assert spec.to_dict()["env_passthrough"] == ["WANDB_*", "HF_TOKEN", "NODE[01]_ADDR", "NOT_SET_ANYWHERE"]
    assert pass_through(load_spec(p), {})[0].env == {"WANDB_MODE": "offline"}


def test_env_passthrough_entries_must_be_names_or_patterns(project: Path) -> None:
    p = _write(project, "name: demo\nentrypoint: train.py\nenv_passthrough: [OK_*, 'TWO WORDS', '$HOME']\n")
    with pytest.raises(SpecError) as info:
        load_spec(p)
    text = str(info.value)
    assert "env_passthrough (line 3): expected variable names or shell patterns of them" in text
    assert "got 'TWO WORDS'" in text  # the first bad entry is named


# ------------------------------------------------------------------ who fills the DeepSpeed config's "auto"

HF_TRAINER_PY = """\
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments)
"""


def _ds_job(project: Path, script: str, source: str, **fields):
    from orchestrator.spec import job_deepspeed
    (project / script).write_text(source)
    spec = spec_from_dict({"name": "hf", "entrypoint": script, "deepspeed_config": HF_DS, **fields}, project)
    return job_deepspeed(spec, [2, 2], {})


def test_deepspeed_config_filled_by_is_a_choice_of_three(project: Path) -> None:
    assert load_spec(_write(project, "name: a\nentrypoint: train.py\n")).deepspeed_config_filled_by == "auto"
    p = _write(project, "name: a\nentrypoint: train.py\ndeepspeed_config_filled_by: script\n")
    assert load_spec(p).deepspeed_config_filled_by == "script"
    p = _write(project, "name: a\nentrypoint: train.py\ndeepspeed_config_filled_by: trainer\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    assert "deepspeed_config_filled_by (line 3)" in str(err.value) and "'auto', 'orch' or 'script'" in str(err.value)
    assert "got 'trainer'" in str(err.value)


def test_a_script_that_imports_the_hf_trainer_fills_the_autos(project: Path) -> None:
    job = _ds_job(project, "hf_trainer.py", HF_TRAINER_PY)
    assert job.autos["filled_by"] == "script"
    assert job.autos["why"] == "detected: hf_trainer.py imports transformers.Trainer"
    assert "optimizer.params.betas" in job.autos["left_auto"] and "train_batch_size" in job.autos["left_auto"]
    assert job.config["optimizer"]["params"]["betas"] == "auto" and job.config["zero_optimization"]["stage"] == 2


def test_a_script_without_them_leaves_the_autos_to_orch(project: Path) -> None:
    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        _ds_job(project, "train.py", "import deepspeed\nimport transformers\nmodel = transformers.AutoModel\n")
    text = str(err.value)
    assert "optimizer.params.betas: is \"auto\", but nothing fills this key" in text  # today's message
    assert "filled by orch: detected: train.py imports neither transformers' Trainer/TrainingArguments nor " \
           "accelerate's Accelerator" in text and "deepspeed_config_filled_by: script" in text
    # the spec's word wins over detection, either way
    assert _ds_job(project, "train.py", "import deepspeed\n", deepspeed_config_filled_by="script").autos == {
        "filled_by": "script", "why": "deepspeed_config_filled_by: script in the job spec",
        "left_auto": _ds_job(project, "hf_trainer.py", HF_TRAINER_PY).autos["left_auto"]}
    with pytest.raises(ConfigError, match="filled by orch: deepspeed_config_filled_by: orch in the job spec"):
        _ds_job(project, "hf_trainer.py", HF_TRAINER_PY, deepspeed_config_filled_by="orch")


def test_a_config_without_auto_is_resolved_as_always(project: Path) -> None:
    job = _ds_job(project, "hf_trainer.py", HF_TRAINER_PY, deepspeed_config={"train_micro_batch_size_per_gpu": 2})
    assert job.autos is None and job.config == {"train_micro_batch_size_per_gpu": 2}


def test_a_module_entrypoint_is_not_read(project: Path) -> None:
    from orchestrator.spec.dssources import who_fills
    filler = who_fills("auto", "pkg.train", module=True)
    assert filler.filled_by == "orch" and "module (module: true)" in filler.why
    assert who_fills("auto", "./run.sh", no_python=True).filled_by == "orch"


@pytest.mark.parametrize("source, args, library, why", [
    ("import transformers\ntransformers.Trainer(model=None)\n", (), "transformers", "uses transformers.Trainer"),
    ("from trl import SFTTrainer\n", (), "transformers", "imports trl.SFTTrainer"),
    ("from transformers import AutoModel\n", ("--deepspeed", "ds.json"), "transformers", "is given --deepspeed FILE"),
    ("from transformers import AutoModel\n", ("--deepspeed", "--deepspeed_config", "ds.json"), None, "neither"),
    ("from accelerate import Accelerator\nfrom transformers import AutoModel\n", (), "accelerate",
     "imports accelerate.Accelerator"),
    ("import accelerate as acc\n", (), None, "neither"),
    ("import accelerate\nacc = accelerate.Accelerator()\n", (), "accelerate", "uses accelerate.Accelerator"),
    ("# from transformers import Trainer\nprint('Trainer')\n", (), None, "neither"),
    ("def broken(:\n", (), None, "does not parse as Python"),
])
def test_what_fills_is_read_from_the_scripts_source(tmp_path: Path, source, args, library, why) -> None:
    from orchestrator.spec.dssources import script_library
    (tmp_path / "s.py").write_text(source)
    found, reason = script_library(str(tmp_path / "s.py"), args)
    assert found == library and why in reason
    assert script_library(str(tmp_path / "missing.py"))[1].startswith("not detected: cannot read")


def test_an_accelerate_script_fills_only_what_accelerate_fills(project: Path) -> None:
    from orchestrator.errors import ConfigError
    with pytest.raises(ConfigError) as err:  # DummyOptim gives lr and weight_decay; Adam's betas and eps it has not
        _ds_job(project, "acc.py", "from accelerate import Accelerator\n")
    assert [k for k, _ in err.value.problems] == ["optimizer.params.betas", "optimizer.params.eps"]
    assert "neither orch nor the script fills it" in str(err.value)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_example_spec_loads(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name and spec.entrypoint


def test_secret_looking_values_are_masked_by_name_and_by_value() -> None:
    import dataclasses

    from orchestrator.spec.secrets import MASK, is_secret_name, redact

    assert all(is_secret_name(n) for n in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                           "GOOGLE_APPLICATION_CREDENTIALS"))
    assert not any(is_secret_name(n) for n in ("PATH", "MASTER_ADDR", "key_file", "hf_token"))
    assert is_secret_name("MY_DB_PASS", ["MY_DB_*"])

    @dataclasses.dataclass(frozen=True)
    class Cmd:
        argv: tuple
        env: dict

    shown = redact({"env": {"HF_TOKEN": "hf_0123456789", "X": "1", "PIN_KEY": "42"},
                    "cmds": [Cmd(("mpirun", "-x", "HF_TOKEN=hf_0123456789"), {"HF_TOKEN": "hf_0123456789"})],
                    "args": ["--x", "42"]})
    assert shown["env"] == {"HF_TOKEN": MASK, "X": "1", "PIN_KEY": MASK}
    assert shown["cmds"][0] == Cmd(("mpirun", "-x", f"HF_TOKEN={MASK}"), {"HF_TOKEN": MASK})
    assert shown["args"] == ["--x", "42"]  # a short value is masked under its name only, not searched for
    short = redact({"env": {"MY_X": "ab"}, "cmd": "export MY_X=ab; mpirun -x MY_X=ab -x MY_XY=ab"}, ["MY_X"])
    assert short["cmd"] == f"export MY_X={MASK}; mpirun -x MY_X={MASK} -x MY_XY=ab"
