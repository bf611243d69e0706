"""One DeepSpeed op build per node: which ops a config needs (``orchestrator.spec.dsops``, checked against the
installed DeepSpeed), the ranks' per-environment ``TORCH_EXTENSIONS_DIR`` (``agents.opbuild``), the preflight's
``ops`` check finding built ops without starting anything and removing the lock of a build it had to kill,
and a real 2-node DeepSpeed job whose ranks load the op the preflight built (their logs show no build)."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from agents import opbuild
from agents.nodeenv import rank_env
from conftest import ROOT, assert_no_leftovers
from orchestrator.spec.dsops import OPS, ops_needed
from orchestrator.store import Store

EXAMPLES = ROOT / "examples"


def _names(config: dict) -> list[str]:
    return [op["name"] for op in ops_needed(config)]


def test_which_ops_a_config_needs() -> None:
    zero = {"stage": 2}
    assert _names({}) == ["deepspeed_shm_comm"]  # the script's own optimizer: only the comm op is known
    assert _names({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}) == \
        ["deepspeed_shm_comm", "fused_adam"]
    assert _names({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}) == ["deepspeed_shm_comm"]
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert _names({"optimizer": {"type": "AdamW"}, "zero_optimization": offload}) == ["deepspeed_shm_comm", "cpu_adam"]
    assert _names({"optimizer": {"type": "Adagrad"}}) == ["deepspeed_shm_comm"]  # torch.optim.Adagrad
    assert _names({"optimizer": {"type": "Adagrad"}, "zero_optimization": offload}) == \
        ["deepspeed_shm_comm", "cpu_adagrad"]
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
    assert _names({"optimizer": {"type": "Lion"}, "zero_optimization": nvme}) == \
        ["deepspeed_shm_comm", "cpu_lion", "async_io"]
    assert ops_needed({})[0]["if_compatible"] is True


def test_op_names_are_the_installed_deepspeed_builders_names() -> None:
    from deepspeed.ops.op_builder import cpu
    from deepspeed.ops.op_builder.fused_lion import FusedLionBuilder  # (the CPU accelerator has none)
    for builder, name in OPS.items():
        cls = getattr(cpu, builder, None) or {"FusedLionBuilder": FusedLionBuilder}[builder]
        assert cls.NAME == name, (builder, cls.NAME, name)


def _venv(root: Path, torch_version: str) -> Path:
    """A virtualenv's shape: bin/python (a link to this interpreter), pyvenv.cfg, torch's and DeepSpeed's dist-info."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    os.symlink(os.path.realpath(sys.executable), root / "bin" / "python")
    site = root / "lib" / "python3.11" / "site-packages"
    for dist in (f"torch-{torch_version}.dist-info", "deepspeed-0.18.0.dist-info"):
        (site / dist).mkdir(parents=True)
    return root / "bin" / "python"


def test_the_default_extensions_dir_is_per_environment(tmp_path) -> None:
    a, b = _venv(tmp_path / "a", "2.13.0"), _venv(tmp_path / "b", "2.13.0")
    env = {"HOME": str(tmp_path / "home"), "PATH": os.defpath}
    dir_a, dir_b = opbuild.default_extensions_dir(str(a), env), opbuild.default_extensions_dir(str(b), env)
    assert dir_a != dir_b  # two virtualenvs never share one cache
    root = str(tmp_path / "home" / ".cache" / "torch_extensions")
    assert os.path.dirname(dir_a) == root and os.path.basename(dir_a).startswith("orch-")
    assert opbuild.default_extensions_dir(str(a), env) == dir_a  # stable
    (tmp_path / "a" / "lib" / "python3.11" / "site-packages" / "torch-2.13.0.dist-info").rename(
        tmp_path / "a" / "lib" / "python3.11" / "site-packages" / "torch-2.14.0.dist-info")
    assert opbuild.default_extensions_dir(str(a), env) != dir_a  # an upgraded torch: a fresh cache


def test_a_deepspeed_rank_gets_it_unless_its_environment_sets_one(tmp_path) -> None:
    python = _venv(tmp_path / "v", "2.13.0")
    base = {"HOME": str(tmp_path), "PATH": os.defpath}
    ds_rank = {"argv": [str(python), "train.py"], "env": {"ORCH_DEEPSPEED_CONFIG": "/x/ds.json"}}
    expected = opbuild.default_extensions_dir(str(python), base)
    assert rank_env(base, {}, ds_rank)["TORCH_EXTENSIONS_DIR"] == expected
    assert rank_env({**base, "TORCH_EXTENSIONS_DIR": "/mine"}, {}, ds_rank)["TORCH_EXTENSIONS_DIR"] == "/mine"
    plain = {"argv": [str(python), "train.py"], "env": {}}
    assert "TORCH_EXTENSIONS_DIR" not in rank_env(base, {}, plain)


@pytest.mark.integration
def test_a_built_op_is_found_without_starting_python(tmp_path) -> None:
    ext = tmp_path / "ext"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    ops = ops_needed({})
    (out,) = opbuild.build("/nonexistent/python", env, ops, str(tmp_path), timeout=10)
    assert out["status"] == "cached" and out["path"] == str(ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so")
    (ext / "deepspeed_shm_comm" / "lock").write_text("")  # a build under way: not taken as built
    (out,) = opbuild.build("/nonexistent/python", env, ops, str(tmp_path), timeout=10)
    assert out["status"] == "failed" and "/nonexistent/python cannot be run" in out["detail"]


@pytest.mark.integration
def test_a_build_past_its_time_is_killed_and_leaves_no_lock(tmp_path) -> None:
    """A build killed midway would leave torch's lock, on which every later rank waits forever."""
    ext = tmp_path / "ext"
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        mkdir -p "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm" && : > "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/lock"
        exec sleep 60
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (out,) = opbuild.build(str(fake), {"TORCH_EXTENSIONS_DIR": str(ext), "PATH": os.defpath}, ops_needed({}),
                           str(tmp_path), timeout=1.5)
    assert out["status"] == "failed" and "did not finish within 2 s and was stopped" in out["detail"], out
    assert (ext / "deepspeed_shm_comm").is_dir() and not (ext / "deepspeed_shm_comm" / "lock").exists()


@pytest.mark.integration
def test_the_preflight_builds_the_op_once_and_the_ranks_only_load_it(orch, write_spec, hostfile, tmp_path) -> None:
    ext = tmp_path / "ext"  # empty: nothing built yet
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
            "--log-interval", "0", "--steps", "3"]
    spec = write_spec(name="ops", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")),
                      workdir=str(EXAMPLES), entrypoint="train_gpt.py", args=tiny,
                      deepspeed_config=str(EXAMPLES / "ds_zero2.json"),
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(ext)})
    r = orch("run", str(spec), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    store = Store(orch.state_dir / "orch.db")
    (pf,) = [e.data for e in store.events(job["id"]) if e.kind == "preflight"]
    checks = {n["host"]: next(c for c in n["checks"] if c["name"] == "ops") for n in pf["nodes"]}
    statuses = [o["status"] for c in checks.values() for o in c["ops"]]
    assert len(statuses) == 2 and "built" in statuses and set(statuses) <= {"built", "cached"}, checks
    assert all(c["dir"] == str(ext) for c in checks.values())
    print(f"\n[ops] preflight {pf['seconds']:.1f} s; per node: "
          + ", ".join(f"{h} {c['ops'][0]['status']} {c['ops'][0]['seconds']:.1f} s" for h, c in checks.items()))
    assert [op["name"] for op in pf["ops"]] == ["deepspeed_shm_comm"]
    assert sorted(os.listdir(ext)) == ["deepspeed_shm_comm"]  # one build, where the ranks look
    lib = ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    started = min(e.at for e in store.events(job["id"]) if e.kind == "ranks_started")
    assert lib.stat().st_mtime < started  # built before any rank started, and not rebuilt by a rank since
    for rank in (0, 1):
        log = orch("logs", job["id"], "--rank", str(rank)).stdout
        assert "[train] step=3" in log, log[-2000:]
        assert "Building extension module" not in log and "Emitting ninja build file" not in log, log[-3000:]
    status = " ".join(orch("status", job["id"]).stdout.split())
    assert "DeepSpeed ops (preflight of attempt 1): deepspeed_shm_comm built on" in status, status
    assert "DeepSpeed ops: deepspeed_shm_comm" in " ".join(r.stdout.split())
    assert_no_leftovers(job["id"], timeout=5)
