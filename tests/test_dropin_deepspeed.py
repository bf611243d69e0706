"""``orch deepspeed``: the deepspeed command line, unchanged, under orch.

* The parsers agree: every argument of the installed DeepSpeed runner's own parser
  (``deepspeed.launcher.runner.parse_args``, captured as it is built) has the same option strings,
  destination, default, type and choices in ``orch deepspeed``'s, and a corpus of command lines
  parses to the same values under both (abbreviations, ``=`` forms, the script's own options).
* Each argument becomes the spec field it means, or a note, or a refusal naming it.
* The same job run as ``deepspeed ... probe.py --deepspeed --deepspeed_config c.json`` (DeepSpeed's
  real runner script, with pdsh replaced by a shim that runs pdsh's remote command on this machine
  for each host, as pdsh's ssh would) and as ``orch deepspeed`` with the same arguments gives every
  rank the same argv, working directory and environment (tests/probe.py), save what orch adds on
  purpose and what the remote shell sets: two nodes through pdsh, one node through the runner's local
  path, one node with ``--force_multi``, and no hostfile at all.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import assert_no_leftovers, cli
from test_launchers_real import BASH_ONLY, ORCH_ADDED, ORCH_CONFIG, free_port, probe

from orchestrator.errors import SpecError
from orchestrator.face.cli.dropin import deepspeed_parser
from orchestrator.spec.deepspeed_cmd import RUNNER_LAUNCHERS, RUNNER_OPTIONS, runner_job

PYTHON = sys.executable
VENV_BIN = Path(sys.executable).parent
PROBE = Path(probe.__file__)
TIMEOUT = 240


def runner_parser() -> argparse.ArgumentParser:
    """The installed runner's own parser: ``runner.parse_args`` builds it and parses at once, so its
    ``parse_args`` is caught to keep the parser."""
    from deepspeed.launcher import runner
    caught: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        caught.append(self)
        return original(self, ["x.py"])

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch):
        runner.parse_args([])
    return caught[0]


def _shape(action: argparse.Action) -> dict:
    return {"options": action.option_strings, "takes_value": action.nargs != 0, "default": action.default,
            "type": action.type, "choices": list(action.choices) if action.choices else None,
            "required": action.required, "nargs": action.nargs if action.nargs != 0 else 0}


def test_parsers_agree_argument_by_argument() -> None:
    theirs = {a.dest: a for a in runner_parser()._actions if a.dest != "help"}
    ours = {a.dest: a for a in deepspeed_parser()._actions}
    assert set(theirs) == {o.dest for o in RUNNER_OPTIONS} | {"user_script", "user_args"}
    for dest, action in theirs.items():
        assert dest in ours, f"orch deepspeed lacks the runner's {action.option_strings or dest}"
        assert _shape(ours[dest]) == _shape(action), dest
    from deepspeed.launcher.runner import LAUNCHER_CLASSES
    assert set(RUNNER_LAUNCHERS) == set(LAUNCHER_CLASSES)
    # orch's own options do not take any of the runner's option strings
    runner_strings = {s for a in theirs.values() for s in a.option_strings}
    own = {s for d, a in ours.items() if d not in theirs for s in a.option_strings}
    assert not own & runner_strings and "--plan" in own and "--print-spec" in own


CORPUS = [
    ["t.py"],
    ["-H", "hf", "-i", "a:0,1@b", "t.py", "--deepspeed", "--deepspeed_config", "c.json"],
    ["--hostfile=hf", "--exclude", "b:1", "--num_nodes", "2", "--num_gpus", "1", "t.py", "-H", "x"],
    ["--num_accelerators", "3", "--master_port", "1234", "--master_addr", "10.0.0.1", "t.py", "--num_gpus", "5"],
    ["--launcher", "OpenMPI", "--launcher_args", "-x FOO --mca btl tcp", "--no_local_rank", "--module", "pkg.train"],
    ["--no_ssh", "--node_rank", "1", "--no_ssh_check", "--force_multi", "--save_pid", "t.py", "a", "--", "b"],
    ["--enable_each_rank_log", "/tmp/l", "--bind_cores_to_rank", "--bind_core_list", "0-3", "--ssh_port", "2222",
     "--venv_script", "/v/bin/activate", "--log_level", "debug", "-q", "t.py"],
    ["--num_g", "2", "--incl", "a", "t.py"],  # abbreviations, as argparse allows them
    ["--autotuning", "tune", "t.py"],
    ["--no_python", "/bin/echo", "hi", "-x", "--launcher", "slurm"],
]


@pytest.mark.parametrize("argv", CORPUS, ids=lambda a: " ".join(a)[:40])
def test_parsers_agree_on_command_lines(argv: list[str]) -> None:
    theirs = vars(runner_parser().parse_args(argv))
    ours = vars(deepspeed_parser().parse_args(argv))
    assert {k: ours[k] for k in theirs} == theirs


@pytest.mark.parametrize("argv", [[], ["--launcher"], ["--log_level", "loud", "t.py"], ["--num_gpus", "x", "t.py"],
                                  ["--autotuning", "fast", "t.py"]])
def test_parsers_refuse_alike(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as theirs:
        runner_parser().parse_args(argv)
    with pytest.raises(SystemExit) as ours:
        deepspeed_parser().parse_args(argv)
    assert theirs.value.code == ours.value.code == 2


def _job(argv: list[str], cwd: str = "/w", found: bool = True):
    return runner_job(deepspeed_parser().parse_args(argv), cwd, hostfile_found=found)


def test_every_argument_becomes_its_field() -> None:
    job = _job(["-H", "hf", "-i", "a:0@b", "--master_port", "1234", "--master_addr", "10.1.1.1", "--launcher",
                "MPICH", "--launcher_args", "-genv A 1", "--module", "--no_local_rank", "--force_multi",
                "--ssh_port", "2222", "--venv_script", "venv/bin/activate", "pkg.train", "--deepspeed",
                "--deepspeed_config=cfg/ds.json", "x"])
    assert job.fields == {
        "name": "train", "workdir": "/w", "entrypoint": "pkg.train",
        "args": ["--deepspeed", "--deepspeed_config=cfg/ds.json", "x"], "hostfile": "/w/hf", "include": "a:0@b",
        "master_port": 1234, "master_addr": "10.1.1.1", "launcher": "mpich", "launcher_args": "-genv A 1",
        "module": True, "no_local_rank": True, "force_multi": True, "ssh": {"port": 2222},
        "python": "/w/venv/bin/python", "deepspeed_config": "/w/cfg/ds.json"}
    assert any("--venv_script" in n for n in job.notes)
    # --no_ssh wins over --launcher, as in runner.main(); counts as given
    job = _job(["--launcher", "pdsh", "--no_ssh", "--node_rank", "0", "-e", "b", "--num_gpus", "2", "t.py"])
    assert job.fields["launcher"] == "nossh" and job.fields["num_gpus"] == 2 and job.fields["exclude"] == "b"
    assert [n for n in job.notes if n.startswith("--node_rank")] == [
        "--node_rank is not used: orch starts every node's ranks itself"]
    assert any(n.startswith("master port: a free one orch picks") for n in job.notes)


def test_refused_and_missing_hostfile_are_named() -> None:
    with pytest.raises(SpecError) as err:
        _job(["-H", "nope", "--autotuning", "run", "--bind_cores_to_rank", "t.py"], found=False)
    text = str(err.value)
    assert "--autotuning 'run' is not supported" not in text  # the value is not what is refused
    assert "--autotuning is not supported: orch does not run DeepSpeed's autotuner" in text
    assert "--bind_cores_to_rank" not in text  # bind_cores: auto
    assert "--hostfile 'nope': not a file (/w/nope)" in text
    with pytest.raises(SpecError) as err:  # a name the runner does not know (orch's own standard launcher)
        _job(["--launcher", "standard", "t.py"])
    assert "--launcher 'standard' is not one of the runner's launchers" in str(err.value)
    # the runner's default hostfile missing: this machine only, as the runner does
    assert "hostfile" not in _job(["t.py"], found=False).fields


def test_bind_cores_to_rank_is_bind_cores_auto_and_a_core_list_is_refused_with_it() -> None:
    assert _job(["--bind_cores_to_rank", "t.py"]).fields["bind_cores"] == "auto"
    assert "bind_cores" not in _job(["t.py"]).fields
    with pytest.raises(SpecError, match=r"--bind_core_list is not supported: launch.py splits the list"):
        _job(["--bind_cores_to_rank", "--bind_core_list", "0-3", "t.py"])
    alone = _job(["--bind_core_list", "0-3", "t.py"])  # launch.py reads it only with --bind_cores_to_rank
    assert "bind_cores" not in alone.fields and any(n.startswith("--bind_core_list is not used") for n in alone.notes)


def test_print_spec_is_a_spec_orch_plan_takes(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("nodeA slots=2\nnodeB slots=2\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    (tmp_path / "t.py").write_text("print('hi')\n")
    env = {**os.environ, "ORCH_STATE_DIR": str(tmp_path / "state")}
    argv = ["--hostfile", "hostfile", "--include", "nodeA:1@nodeB", "--master_port", "29611", "t.py", "--deepspeed",
            "--deepspeed_config", "ds.json"]
    r = cli("deepspeed", "--provisioner", "local", "--print-spec", "-", *argv, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    spec = yaml.safe_load(r.stdout)
    assert spec["include"] == "nodeA:1@nodeB" and spec["provisioner"] == "local"
    (tmp_path / "job.yaml").write_text(r.stdout)
    plans = []
    for cmd in (["plan", "job.yaml"], ["deepspeed", "--provisioner", "local", "--plan", *argv]):
        r = cli("-o", "json", *cmd, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        plans.append({k: v for k, v in json.loads(r.stdout).items() if k not in ("spec_source",)})
    assert plans[0]["nodes"] == plans[1]["nodes"] and plans[0]["world_size"] == 3
    # a refused argument: exit 2 with the reason, nothing started, no traceback
    r = cli("deepspeed", "--bind_cores_to_rank", "--bind_core_list", "0-3", *argv, cwd=tmp_path, env=env)
    assert r.returncode == 2 and "--bind_core_list is not supported" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- the real runner vs orch deepspeed

#: pdsh as its ssh runs the command: each host's copy, %n its index, through a shell, in the
#: environment the runner had (a remote login shell's, here), less pdsh's own variables
PDSH_SHIM = """#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
hosts = []
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-f", "-w"):
        value = args.pop(0)
        if flag == "-w":
            hosts = value.split(",")
env = {k: v for k, v in os.environ.items() if k not in ("PDSH_RCMD_TYPE", "PDSH_SSH_ARGS_APPEND")}
command = " ".join(args)
procs = [subprocess.Popen(["bash", "-c", command.replace("%n", str(n))], env=env, cwd="/")
         for n in range(len(hosts))]
sys.exit(max(p.wait() for p in procs))
"""

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def _base(tmp: Path, out: Path, shim: Path) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return {"PATH": f"{shim}:{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "DS_ACCELERATOR": "cpu", "PROBE_OUT_DIR": str(out), "PYTHONPATH": "/opt/site",
            "MLFLOW_RUN_NAME": "run one", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}


def _collect(out: Path, n: int) -> dict[int, dict]:
    reports = probe.load_probe_outputs(str(out))
    assert sorted(reports) == list(range(n)), sorted(reports)
    for f in out.iterdir():
        f.unlink()
    return reports


CASES = {
    # two nodes: pdsh's remote command on each (exports, PYTHONPATH, .deepspeed_env)
    "two-nodes-pdsh": (["--hostfile", "hostfile", "--include", "nodeA:0,1@nodeB:1", "--no_ssh_check"], 3),
    # one node: the runner runs launch.py itself (nothing exported)
    "one-node": (["--hostfile", "hostfile", "--include", "nodeB:0,1", "--no_ssh_check"], 2),
    # one node through pdsh all the same
    "one-node-force-multi": (["--hostfile", "hostfile", "--num_nodes", "1", "--no_ssh_check", "--force_multi"], 2),
    # no hostfile: this machine, one rank per NUMA node on the CPU accelerator
    "no-hostfile": ([], 1),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_same_ranks_as_the_real_runner(case: str, tmp_path: Path, state_dir: Path) -> None:
    runner_args, world = CASES[case]
    work, out, shim = tmp_path / "work", tmp_path / "out", tmp_path / "shim"
    for d in (work, out, shim):
        d.mkdir()
    (shim / "pdsh").write_text(PDSH_SHIM)
    (shim / "pdsh").chmod(stat.S_IRWXU)
    (work / "hostfile").write_text("nodeA slots=2\nnodeB slots=2\n")
    (work / ".deepspeed_env").write_text("SHARED=hello world\n")
    (work / "ds.json").write_text(json.dumps(DS_CONFIG))
    base = _base(tmp_path, out, shim)
    argv = [*runner_args, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(PROBE),
            "--deepspeed", "--deepspeed_config", "ds.json", "two words"]

    real = subprocess.run([PYTHON, str(VENV_BIN / "deepspeed"), *argv], cwd=work, env=base, capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert real.returncode == 0, real.stderr[-4000:]
    theirs = _collect(out, world)

    r = subprocess.run([PYTHON, "-m", "orchestrator", "deepspeed", "-o", "json", "--provisioner", "local", *argv],
                       cwd=work, env={**base, "ORCH_STATE_DIR": str(state_dir)}, capture_output=True, text=True,
                       timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert_no_leftovers(detail["id"])
    ours = _collect(out, world)

    pdsh = case in ("two-nodes-pdsh", "one-node-force-multi")
    problems = probe.compare_probe_outputs(theirs, ours, {**(BASH_ONLY if pdsh else {}), **ORCH_ADDED, **ORCH_CONFIG})
    assert not problems, probe.format_differences(problems)
    # what was compared: the runner's exports reached the ranks only through pdsh
    env0 = theirs[0]["env"]
    assert (env0.get("SHARED") == "hello world") is pdsh
    assert env0["PYTHONPATH"] == (f"{work}:/opt/site" if pdsh else "/opt/site")
    assert theirs[world - 1]["orig_argv"][-4:] == ["--deepspeed", "--deepspeed_config", "ds.json", "two words"]
    assert detail["spec"]["deepspeed_config"] == str(work / "ds.json") and detail["spec"]["workdir"] == str(work)
    with open(ours[0]["env"]["ORCH_DEEPSPEED_CONFIG"]) as f:  # orch checked and wrote the script's config
        assert {k: v for k, v in json.load(f).items() if k != "csv_monitor"} == DS_CONFIG


# --------------------------------------------------------------------------- an ordinary job: orch resume


@pytest.mark.integration
def test_a_failed_orch_deepspeed_job_resumes_from_what_the_script_saved(tmp_path: Path, state_dir: Path) -> None:
    """A DeepSpeed tutorial script, unchanged but for a fault it injects once, under ``orch deepspeed``: a rank
    fails after step 25, the job is FAILED naming it; ``orch resume`` starts attempt 2 from the script's own
    last checkpoint (its --save_dir, global_step20), and the script loads it and trains on to step 30."""
    scripts = Path(__file__).with_name("scripts")
    work = tmp_path / "work"
    work.mkdir()
    (work / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    env = {**os.environ, "ORCH_STATE_DIR": str(state_dir), "OMP_NUM_THREADS": "1"}
    argv = ["--hostfile", "hostfile", "--master_addr", "127.0.0.1", str(scripts / "ds_tutorial_train.py"),
            "--deepspeed", "--deepspeed_config", str(scripts / "ds_tutorial_zero2.json"), "--steps", "30",
            "--save_dir", "ck", "--load_dir", "ck", "--save_interval", "10", "--fail_at_step", "25",
            "--fail_rank", "1", "--fail_once", str(tmp_path / "failed-once")]
    r = subprocess.run([PYTHON, "-m", "orchestrator", "deepspeed", "--provisioner", "local", *argv], cwd=work,
                       env=env, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"orch watches {work / 'ck'} (the script's --save_dir)" in r.stderr
    detail = json.loads(subprocess.run([PYTHON, "-m", "orchestrator", "-o", "json", "list"], env=env,
                                       capture_output=True, text=True, timeout=60).stdout)[0]
    job = detail["id"]
    cause = detail["cause"]
    assert detail["state"] == "FAILED" and cause["kind"] == "rank_exit" and cause["global_rank"] == 1, detail
    assert any("injected failure at step 25 on rank 1" in line for line in cause["log_tail"])
    assert_no_leftovers(job)

    r = subprocess.run([PYTHON, "-m", "orchestrator", "-o", "json", "resume", job], env=env, capture_output=True,
                       text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    resumed = json.loads(r.stdout)
    assert r.returncode == 0 and resumed["state"] == "SUCCEEDED", (resumed.get("cause"), r.stderr[-3000:])
    assert resumed["spec"]["checkpoint_dir"] == str(work / "ck") and resumed["spec"]["launcher"] == "pdsh"
    assert [a["resume_tag"] for a in resumed["attempts"]] == [None, "global_step20"]
    assert_no_leftovers(job)
    log = subprocess.run([PYTHON, "-m", "orchestrator", "logs", job, "--rank", "1"], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert "resumed rank=1 from=ck/global_step20/mp_rank_00_model_states.pt global_step=20" in log
    steps = [int(line.split()[0][5:]) for line in log.splitlines() if line.startswith("step=")]
    assert steps == list(range(21, 31))  # attempt 2 alone (the latest), from the step after the checkpoint


@pytest.mark.integration
def test_orch_deepspeed_exits_as_deepspeed_does(tmp_path: Path, state_dir: Path) -> None:
    """The failed rank's exit status (deepspeed's runner exits with it); a state dir that cannot be made is a
    one-line error; an output that cannot be written stops orch, saying so, without a traceback."""
    (tmp_path / "fail.py").write_text("import sys\nprint('failing', flush=True)\nsys.exit(3)\n")
    env = {**os.environ, "ORCH_STATE_DIR": str(state_dir)}
    r = subprocess.run([PYTHON, "-m", "orchestrator", "deepspeed", "fail.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stderr[-2000:]
    r = subprocess.run([PYTHON, "-m", "orchestrator", "--state-dir", str(tmp_path / "fail.py" / "state"), "deepspeed",
                        "fail.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and "Cannot use state dir" in r.stderr and "Traceback" not in r.stderr
    with open("/dev/full", "w") as full:
        r = subprocess.run([PYTHON, "-m", "orchestrator", "-o", "json", "list"], env=env, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    assert r.returncode == 1 and "cannot write the output" in r.stderr and "Traceback" not in r.stderr
