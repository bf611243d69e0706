"""Job spec loading and validation: every problem listed, by field path and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import load_deepspeed_config, load_spec, spec_from_dict


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


def test_every_problem_is_listed_with_field_and_line(project: Path) -> None:
    p = _write(project, "name: 'bad name'\nlauncher: foo\nmaster_port: 70000\nenv:\n  B: true\n"
                        "bogus: 1\nnum_nodes: x\n")
    with pytest.raises(SpecError) as err:
        load_spec(p)
    fields = [f for f, _ in err.value.problems]
    assert set(fields) == {"name", "launcher", "master_port", "env", "bogus", "num_nodes", "entrypoint"}
    msg = str(err.value)
    assert str(p) in msg and "7 problems" in msg
    assert "launcher (line 2)" in msg and "'foo'" in msg and "pdsh" in msg
    assert "bogus (line 6): unknown field; valid fields are:" in msg
    assert "entrypoint" in msg and "required" in msg
    assert "quotes" in msg  # env B: true is a YAML boolean


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
