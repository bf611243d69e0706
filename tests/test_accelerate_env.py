"""Integration: a script started by ``accelerate launch`` and by orch with the same Accelerate config
gets the same command line and environment (tests/probe.py reports both), and the same DeepSpeed config.

Three jobs, each run twice from one explicitly built base environment, the real tool first:

* one machine, the guide's ZeRO-2 plugin example (no DeepSpeed config file): ``accelerate launch``
  runs torchrun here; orch plans ``launcher: standard`` with ``num_gpus: num_processes``;
* one machine, a DeepSpeed config file full of "auto" plus ``accelerate launch``'s flags (the
  guide's scenario 3);
* two machines (both on this host) with ``deepspeed_multinode_launcher: nossh``: ``accelerate
  launch`` on each with its ``machine_rank`` runs ``deepspeed --hostfile .. --node_rank .. --no_ssh``;
  orch starts both nodes itself.

orch runs each job twice: ``orch run --accelerate-config FILE --micro-batch-size N ...`` and the very
``accelerate launch`` command line under ``orch accelerate-launch`` (no micro batch: as under
``accelerate launch``, the script's Accelerate fills it).

Accelerate 1.15 does not run DeepSpeed in a CPU-only multi-process set-up (``Accelerator()`` needs a
device, ``prepare`` needs transformers), so the probe does not build an ``Accelerator``: the
environment and argv are what ``accelerate launch`` gives *before* the script runs, which is what is
compared. The DeepSpeed config a script would end up with is computed on both sides by Accelerate's
own ``DeepSpeedPlugin`` from the probe's ``ACCELERATE_*`` variables (tests/accelerate_oracle.py).

Every difference that remains is listed with the reason it must differ.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from accelerate_oracle import accelerate_ds_config, printless
from conftest import assert_no_leftovers

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

PROBE = Path(__file__).with_name("probe.py")
_spec = importlib.util.spec_from_file_location("orch_tests_probe_acc", PROBE)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

#: The running virtualenv's bin, wherever it is (not the checkout's .venv: the suite runs from any virtualenv).
VENV_BIN = Path(sys.executable).parent
#: The interpreter of the ``deepspeed`` and ``accelerate`` console scripts (their shebang), which the
#: real tools' processes run under; orch's controller runs under it too, so argv[0] of the ranks match.
PYTHON = (VENV_BIN / "deepspeed").read_text().splitlines()[0].removeprefix("#!").strip()
TIMEOUT = 300.0

#: What orch adds on purpose (docs/contract.md, docs/metrics.md); accelerate launch has none of it.
ORCH_ADDED = {
    "ORCH_JOB_ID": "orch's job id (contract: ORCH_*)",
    "ORCH_JOB_NAME": "the job's name (contract: ORCH_*)",
    "ORCH_ATTEMPT": "orch's attempt number (contract: ORCH_*)",
    "ORCH_ATTEMPT_ID": "<job id>.<attempt>: orch's process marker (contract: ORCH_*)",
    "ORCH_RESTART_COUNT": "orch's restart count (contract: ORCH_*)",
    "ORCH_NODE": "the rank's hostfile host (contract: ORCH_*)",
    "ORCH_NODE_RANK": "the rank's node rank (contract: ORCH_*)",
    "ORCH_RUN_DIR": "the attempt's directory (contract: ORCH_*)",
    "ORCH_CHECKPOINT_DIR": "orch's checkpoint directory (contract: ORCH_*)",
    "ORCH_REPORT_FILE": "where agents.report appends the rank's steps (docs/metrics.md)",
    "ORCH_DEEPSPEED_CONFIG": "the resolved DeepSpeed config orch wrote for the attempt (contract: ORCH_*); "
                             "checked below against Accelerate's own resolution",
    "PROMETHEUS_MULTIPROC_DIR": "the node exporter's multiprocess directory (docs/metrics.md)",
    "TORCHELASTIC_RESTART_COUNT": "orch gives every launcher's ranks the restart count as torchrun does "
                                  "(contract); DeepSpeed's nossh launcher sets none (under torchrun both have '0')",
    "GLOO_SOCKET_IFNAME": "orch names the interface that routes to the master (agents.network; jobspec.md: the ranks' environment); the real launcher leaves gloo to guess by the hostname",
    "NCCL_SOCKET_IFNAME": "as GLOO_SOCKET_IFNAME, for NCCL's sockets",
    "TORCH_EXTENSIONS_DIR": "orch's per-environment op cache, given to a DeepSpeed job's ranks when their environment "
                            "sets none (agents.nodeenv; jobspec.md), so two virtualenvs never rebuild each other's ops",
}
#: Only when accelerate launch runs torchrun on one machine.
TORCHRUN = {
    "TORCHELASTIC_ERROR_FILE": "torchrun points it into its own temp dir (/tmp/torchelastic_*/...); orch's "
                               "launcher leaves it unset (tests/test_launchers_real.py)",
    "TORCHELASTIC_RUN_ID": "torchrun's --rdzv_id: accelerate launch passes none ('none'); orch passes the job id",
    "CUDA_VISIBLE_DEVICES": "orch's standard launcher gives each node's ranks that node's slots (0,1: Accelerate's "
                            "--gpu_ids, per machine); accelerate launch with gpu_ids 'all' leaves it unset, so "
                            "the ranks see the same devices 0..n-1 as cuda:LOCAL_RANK either way",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base(tmp: Path, out: Path) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    # the tests' own op cache (conftest): without one, orch's preflight builds DeepSpeed's op into this fresh
    # home's per-environment cache in every test (~45 s each)
    return {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "DS_ACCELERATOR": "cpu", "PYTHONPATH": "/opt/site", "PROBE_OUT_DIR": str(out),
            "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}


def _run_accelerate(configs: list[Path], flags: list[str], args: list[str], base: dict, cwd: Path,
                    logs: Path) -> None:
    """``accelerate launch --config_file C <flags> probe.py <args>`` for each config at once (one per machine)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, config in enumerate(configs):
        with open(logs / f"accelerate{i}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [PYTHON, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config), *flags,
                 str(PROBE), *args], env=base, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, (logs / f"accelerate{i}.log").read_text(errors="replace")[-4000:]


def _run_orch(orch, options: list[str], args: list[str], base: dict, cwd: Path) -> dict:
    """``orch run -o json <options> probe.py <args>`` from ``cwd`` under exactly ``base``; it must SUCCEED."""
    cmd = [PYTHON, "-m", "orchestrator", "run", "--output", "json", *options, str(PROBE), *args]
    r = subprocess.run(cmd, env=orch.env(base, replace=True), cwd=cwd, capture_output=True, text=True,
                       timeout=TIMEOUT)
    try:
        detail = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"orch run printed no JSON ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}") \
            from None
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert_no_leftovers(detail["id"])
    return detail


def _run_dropin(orch, argv: list[str], base: dict, cwd: Path) -> dict:
    """``orch accelerate-launch -o json <argv>``: the accelerate launch command line itself, under orch."""
    r = subprocess.run([PYTHON, "-m", "orchestrator", "accelerate-launch", "--output", "json", *argv],
                       env=orch.env(base, replace=True), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    detail = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    assert r.returncode == 0 and detail.get("state") == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert_no_leftovers(detail["id"])
    assert detail["spec"]["micro_batch_size"] is None  # accelerate launch never asks for it
    return detail


def _collect(out: Path, n: int) -> dict[int, dict]:
    reports = probe.load_probe_outputs(str(out))
    assert sorted(reports) == list(range(n)), sorted(reports)
    shutil.rmtree(out)
    return reports


def _compare(real: dict, ours: dict, ignore: dict[str, str]) -> None:
    problems = probe.compare_probe_outputs(real, ours, ignore)
    assert not problems, probe.format_differences(problems)


def _orch_config(ours: dict[int, dict]) -> dict:
    """The resolved config orch wrote, less DeepSpeed's CSV monitor it adds for rank 0's metrics."""
    with open(ours[0]["env"]["ORCH_DEEPSPEED_CONFIG"]) as f:
        config = json.load(f)
    assert config.pop("csv_monitor")["enabled"] is True
    return config


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


ZERO2 = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "fsdp_config": {},
         "deepspeed_config": {"gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                              "offload_optimizer_device": "none", "offload_param_device": "none",
                              "zero3_init_flag": True, "zero_stage": 2},
         "machine_rank": 0, "main_process_ip": None, "main_training_function": "main", "mixed_precision": "fp16",
         "num_machines": 1, "num_processes": 2, "use_cpu": False}


def test_one_machine_plugin_config(orch, work, tmp_path, monkeypatch) -> None:
    out = tmp_path / "probe-out"
    base = _base(tmp_path, out)
    accel = work / "accel.yaml"
    accel.write_text(yaml.safe_dump({**ZERO2, "main_process_port": _free_port()}))
    args = ["--lr", "0.1", "two words"]
    _run_accelerate([accel], [], args, base, work, tmp_path / "logs")
    real = _collect(out, 2)
    detail = _run_orch(orch, ["--accelerate-config", "accel.yaml", "--micro-batch-size", "4"], args, base, work)
    ours = _collect(out, 2)

    _compare(real, ours, {**ORCH_ADDED, **TORCHRUN})
    env = real[1]["env"]
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp16" and env["PYTHONPATH"] == f"/opt/site:{work}"
    assert real[1]["orig_argv"] == [PYTHON, "-u", str(PROBE), *args] and env["LOCAL_RANK"] == "1"
    assert "ACCELERATE_DEEPSPEED_CONFIG_FILE" not in ours[0]["env"]  # the plugin builds the config in the script
    assert {ours[r]["env"]["TORCHELASTIC_RUN_ID"] for r in ours} == {detail["id"]}
    # the config the script's Accelerate builds is the one orch resolved and shows
    expected = accelerate_ds_config(env, work, monkeypatch, micro=4, world=2)
    assert _orch_config(ours) == expected == accelerate_ds_config(ours[0]["env"], work, monkeypatch, micro=4, world=2)
    assert expected["fp16"] == {"enabled": True, "auto_cast": True} and expected["train_batch_size"] == 8
    # the accelerate launch command line itself, under orch: the same ranks
    _run_dropin(orch, ["--config_file", "accel.yaml", str(PROBE), *args], base, work)
    _compare(real, _collect(out, 2), {**ORCH_ADDED, **TORCHRUN})


DS_AUTO = {"bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                                 "offload_optimizer": {"device": "auto"}, "offload_param": {"device": "auto"}},
           "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "steps_per_print": 2000000}
FLAGS = {"mixed_precision": "fp16", "zero_stage": "3", "gradient_accumulation_steps": "5", "gradient_clipping": "1.0",
         "offload_param_device": "cpu", "offload_optimizer_device": "cpu", "zero3_save_16bit_model": "true"}


def test_one_machine_config_file_and_flags(orch, work, tmp_path, monkeypatch) -> None:
    out = tmp_path / "probe-out"
    base = _base(tmp_path, out)
    (work / "ds_config.json").write_text(json.dumps(DS_AUTO))
    accel = work / "accel.yaml"
    accel.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                     "deepspeed_config": {"deepspeed_config_file": "ds_config.json",
                                                          "zero3_init_flag": True},
                                     "num_machines": 1, "num_processes": 2, "main_process_port": _free_port()}))
    _run_accelerate([accel], [f"--{k}={v}" for k, v in FLAGS.items()], ["x"], base, work, tmp_path / "logs")
    real = _collect(out, 2)
    options = ["--accelerate-config", "accel.yaml", "--micro-batch-size", "2"]
    options += [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    _run_orch(orch, options, ["x"], base, work)
    ours = _collect(out, 2)

    resolved = ours[0]["env"]["ORCH_DEEPSPEED_CONFIG"]
    _compare(real, ours, {**ORCH_ADDED, **TORCHRUN, "ACCELERATE_DEEPSPEED_CONFIG_FILE":
                          "orch gives the script its resolved copy of the DeepSpeed config file (checked below to "
                          "be what Accelerate makes of the original)"})
    assert real[0]["env"]["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds_config.json"
    assert ours[0]["env"]["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == resolved
    assert real[0]["env"]["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"
    # Accelerate's view of the original file under accelerate launch == orch's file == Accelerate's
    # view of orch's file under orch (the script sees the same DeepSpeed config either way)
    expected = accelerate_ds_config(real[0]["env"], work, monkeypatch, micro=2, world=2)
    assert printless(_orch_config(ours)) == expected
    under_orch = accelerate_ds_config(ours[0]["env"], work, monkeypatch, micro=2, world=2)
    assert under_orch.pop("csv_monitor")["enabled"] is True
    assert under_orch == expected
    assert expected["zero_optimization"]["stage"] == 3 and expected["train_batch_size"] == 2 * 5 * 2
    # the accelerate launch command line itself, under orch (no micro batch): the same ranks, and the script's
    # Accelerate makes the same DeepSpeed config of orch's copy, whose batch sizes it fills
    _run_dropin(orch, ["--config_file", "accel.yaml", *[f"--{k}={v}" for k, v in FLAGS.items()], str(PROBE), "x"],
                base, work)
    dropin = _collect(out, 2)
    _compare(real, dropin, {**ORCH_ADDED, **TORCHRUN, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "orch's resolved copy"})
    with open(dropin[0]["env"]["ORCH_DEEPSPEED_CONFIG"]) as f:
        assert json.load(f)["train_micro_batch_size_per_gpu"] == "auto"
    under_dropin = accelerate_ds_config(dropin[0]["env"], work, monkeypatch, micro=2, world=2)
    assert under_dropin.pop("csv_monitor")["enabled"] is True
    assert under_dropin == expected


def test_two_machines_nossh(orch, work, tmp_path, monkeypatch) -> None:
    out = tmp_path / "probe-out"
    base = _base(tmp_path, out)
    hosts = tmp_path / "hostfile"
    hosts.write_text("nodeA slots=2\nnodeB slots=2\n")
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
              "deepspeed_config": {"deepspeed_hostfile": str(hosts), "deepspeed_multinode_launcher": "nossh",
                                   "gradient_accumulation_steps": 2, "zero_stage": 1},
              "num_machines": 2, "num_processes": 2, "main_process_ip": "127.0.0.1",
              "main_process_port": _free_port(), "machine_rank": 0}
    machines = []
    for rank in (0, 1):  # nossh: accelerate launch on every machine, each with its machine_rank
        machines.append(work / f"accel{rank}.yaml")
        machines[-1].write_text(yaml.safe_dump({**config, "machine_rank": rank}))
    _run_accelerate(machines, [], ["a"], base, work, tmp_path / "logs")
    real = _collect(out, 2)
    _run_orch(orch, ["--accelerate-config", "accel0.yaml", "--micro-batch-size", "1"], ["a"], base, work)
    ours = _collect(out, 2)

    _compare(real, ours, ORCH_ADDED)
    assert [real[r]["env"]["CROSS_RANK"] for r in (0, 1)] == ["0", "1"]
    assert real[1]["orig_argv"][-2:] == ["--local_rank=0", "a"]  # Accelerate passes no --no_local_rank with nossh
    assert [ours[r]["env"]["ORCH_NODE"] for r in (0, 1)] == ["nodeA", "nodeB"]
    expected = accelerate_ds_config(real[0]["env"], work, monkeypatch, micro=1, world=2)
    assert _orch_config(ours) == expected
    assert expected["bf16"] == {"enabled": True} and expected["train_batch_size"] == 1 * 2 * 2
    _run_dropin(orch, ["--config_file", "accel0.yaml", str(PROBE), "a"], base, work)
    _compare(real, _collect(out, 2), ORCH_ADDED)
