"""Integration: the launchers' ranks against the REAL tools, rank by rank, with tests/probe.py.

Each test starts the same two-node job (both "nodes" on this machine, master 127.0.0.1) twice,
from the same explicitly built base environment:

* the real side: what the real tool runs on each node —
  pdsh: the remote command of ``PDSH.real_commands`` (``export ...; cd <workdir>; python -u -m
  deepspeed.launcher.launch --node_rank=%n ...``) with ``%n`` replaced, run by ``bash -c`` as
  pdsh's ssh would run it; nossh: the ``deepspeed --no_ssh --node_rank=<n>`` command a user types
  (DeepSpeed's own runner script); standard: ``torchrun`` on both nodes at once (they
  rendezvous through node 0's TCPStore);
* our side: every :class:`RankLaunch` of every node started by ``agents.ranks.RankProcess``
  with ``compose_env(node env + launcher.env_defaults, rank.env)``, as the agent starts ranks;
  for standard the test hosts node 0's TCPStore (``launcher.agent_store``) as the agent must.

The probe reports are compared with ``probe.compare_probe_outputs``: the whole command line
(``sys.orig_argv``), the working directory, and every environment variable, except the few
listed per test with the reason they must differ.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.ranks import RankProcess, compose_env
from orchestrator.launchers import LaunchContext, compose_rank_env
from orchestrator.launchers.deepspeed import NOSSH, PDSH, pdsh_exports
from orchestrator.launchers.torchrun import STANDARD

pytestmark = pytest.mark.integration

PROBE_PATH = Path(__file__).with_name("probe.py")
_spec = importlib.util.spec_from_file_location("orch_tests_probe", PROBE_PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

PYTHON = sys.executable
VENV_BIN = Path(sys.executable).parent
TIMEOUT = 240.0

#: Variables only the pdsh side has: pdsh runs its command in a remote *shell*, which exports
#: these itself; orch's agent environment stands in for that remote login environment.
BASH_ONLY = {
    "PWD": "set by the remote shell pdsh runs (bash -c), not by DeepSpeed",
    "OLDPWD": "set by the remote shell's `cd <workdir>`, not by DeepSpeed",
    "SHLVL": "set by the remote shell pdsh runs (bash -c), not by DeepSpeed",
    "_": "set by the remote shell to the last command's path, not by DeepSpeed",
}
#: Variables whose value must differ between torchrun and orch.
TORCHRUN_ONLY = {
    "TORCHELASTIC_ERROR_FILE": "torchrun points it into its own per-run temp dir "
                               "(/tmp/torchelastic_*/<run_id>_*/attempt_0/<local rank>/error.json); "
                               "orch's launcher leaves it to the agent",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(tmp_path: Path, out_dir: Path, **extra: str) -> dict[str, str]:
    """The base environment of every node (the real tools' and our agent's), built explicitly."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
           "LANG": "C.UTF-8", "DS_ACCELERATOR": "cpu", "PROBE_OUT_DIR": str(out_dir)}
    env.update(extra)
    return env


def run_real(commands: list[tuple[list[str], dict[str, str], str]], log_dir: Path) -> list[str]:
    """Run ``(argv, env, cwd)`` commands at once; return their logs; fail if one fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i, (argv, env, cwd) in enumerate(commands):
        log = open(log_dir / f"real{i}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for log in logs:
            log.close()
    texts = [(log_dir / f"real{i}.log").read_text(errors="replace") for i in range(len(commands))]
    for p, argv, text in zip(procs, commands, texts):
        assert p.returncode == 0, f"real command {argv[0]} exited {p.returncode}:\n{text[-4000:]}"
    return texts


def run_ours(launcher, ctx: LaunchContext, base: dict[str, str], log_dir: Path) -> None:
    """Start every rank of every node as the agent does (RankProcess + compose_env); wait."""
    ranks = []
    for n in range(len(ctx.world)):
        node_base = compose_rank_env(base, launcher.env_defaults(ctx, n), {})
        for rank in launcher.ranks(ctx, n):
            env = compose_env(node_base, rank.env)
            p = RankProcess(rank.global_rank, rank.argv, env, ctx.workdir,
                            str(log_dir / f"rank{rank.global_rank}.log"))
            p.start()
            ranks.append(p)
    deadline = time.monotonic() + TIMEOUT
    for p in ranks:
        p.wait(max(1.0, deadline - time.monotonic()))
    for p in ranks:
        if p.poll() is None:
            p.signal_group(9)
            p.wait(5)
        p.join_output(2)
    for p in ranks:
        assert p.poll() == 0, (f"our rank {p.global_rank} ended with {p.poll()}:\n"
                               + Path(p.log_path).read_text(errors="replace")[-4000:])


def collect(out_dir: Path, expected: int) -> dict[int, dict]:
    reports = probe.load_probe_outputs(str(out_dir))
    assert sorted(reports) == list(range(expected)), f"probe reports for ranks {sorted(reports)}"
    shutil.rmtree(out_dir)  # the other side writes to the same PROBE_OUT_DIR
    return reports


def assert_same(real, ours, ignore):
    problems = probe.compare_probe_outputs(real, ours, ignore)
    assert not problems, probe.format_differences(problems)


@pytest.fixture
def job_dirs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    return tmp_path, work, tmp_path / "probe-out"


# --------------------------------------------------------------------------- pdsh


def test_pdsh_real(job_dirs):
    tmp_path, work, out = job_dirs
    base = node_env(tmp_path, out)
    # what the planner computes on the controller, from the runner's environment
    runner_env = {"PATH": "/bin", "PYTHONPATH": "/opt/site", "PYTHONHASHSEED": "0",
                  "MLFLOW_RUN_NAME": "run one", "UCX_TLS": "tcp,self", "NCCL_DEBUG": "INFO"}
    exports = pdsh_exports(runner_env, str(work), ["SHARED=hello world\n", "DS_TAG=a\\b\n"],
                           accelerator_exports=())
    exports["SPEC_VAR"] = "from the spec"
    ctx = LaunchContext(world=(("nodeA", (0, 2)), ("nodeB", (0, 1, 3))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("--flag", "two words", 'say "hi" now', "--x=1"), workdir=str(work),
                        exports=exports)
    [cmd] = PDSH.real_commands(ctx)
    assert cmd.argv[:6] == ("pdsh", "-S", "-f", "1024", "-w", "nodeA,nodeB")
    remote = " ".join(cmd.argv[6:])  # pdsh joins its command words with spaces
    real_cmds = [(["bash", "-c", remote.replace("%n", str(n))], dict(base), "/")
                 for n in range(len(ctx.world))]
    run_real(real_cmds, tmp_path / "logs-real")
    real = collect(out, ctx.world_size)

    run_ours(PDSH, ctx, base, tmp_path / "logs-ours")
    ours = collect(out, ctx.world_size)

    assert_same(real, ours, BASH_ONLY)
    # spot checks of what was compared
    assert [real[r]["env"]["LOCAL_RANK"] for r in range(5)] == ["0", "1", "2", "0", "1"]
    assert real[2]["orig_argv"][-4:] == ["--flag", "two words", 'say "hi" now', "--x=1"]
    assert real[0]["env"]["PYTHONPATH"] == f"{work}:/opt/site"
    assert real[0]["env"]["MLFLOW_RUN_NAME"] == "run one" and "NCCL_DEBUG" not in real[0]["env"]
    assert real[0]["env"]["DS_TAG"] == "a\\b"
    assert real[0]["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


# --------------------------------------------------------------------------- nossh


def test_nossh_real(job_dirs):
    tmp_path, work, out = job_dirs
    base = node_env(tmp_path, out, PYTHONPATH="/opt/site")  # nossh leaves PYTHONPATH alone
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=3\nnodeB slots=4\n")
    ctx = LaunchContext(world=(("nodeA", (0, 2)), ("nodeB", (0, 1, 3))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("two words", "*.json", "$HOME"), workdir=str(work),
                        exports={"SPEC_VAR": "from the spec"}, hostfile=str(hostfile),
                        include="nodeA:0,2@nodeB:0,1,3")
    cmds = NOSSH.real_commands(ctx)
    user_cmds = cmds[0::2]
    # `deepspeed` is DeepSpeed's runner script; run it under ctx.python
    real_cmds = [([PYTHON, str(VENV_BIN / "deepspeed"), *c.argv[1:]], {**base, **c.env}, str(work))
                 for c in user_cmds]
    logs = run_real(real_cmds, tmp_path / "logs-real")
    for text, execd in zip(logs, cmds[1::2]):  # the runner logs what it execs
        assert f"cmd = {' '.join(execd.argv)}" in text
    real = collect(out, ctx.world_size)

    run_ours(NOSSH, ctx, base, tmp_path / "logs-ours")
    ours = collect(out, ctx.world_size)

    assert_same(real, ours, {})
    assert [real[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(5)] == ["0,2"] * 2 + ["0,1,3"] * 3
    assert real[4]["orig_argv"][-4:] == ["--local_rank=1", "two words", "*.json", "$HOME"]


# --------------------------------------------------------------------------- standard


def test_standard_real(job_dirs):
    from torch.distributed import TCPStore

    tmp_path, work, out = job_dirs
    base = node_env(tmp_path, out, PROBE_INIT_PG="1")  # no OMP_NUM_THREADS: torchrun's default
    ctx = LaunchContext(world=(("nodeA", (0, 1)), ("nodeB", (1,))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("--lr", "0.1", "two words"), workdir=str(work),
                        exports={"SPEC_VAR": "from the spec"}, run_id="itest-1")
    cmds = STANDARD.real_commands(ctx)
    # `torchrun` is torch's console script; run it under ctx.python
    real_cmds = [([PYTHON, str(VENV_BIN / "torchrun"), *c.argv[1:]], {**base, **c.env}, str(work))
                 for c in cmds]
    run_real(real_cmds, tmp_path / "logs-real")
    real = collect(out, ctx.world_size)

    addr, port = STANDARD.agent_store(ctx, 0)
    assert all(STANDARD.agent_store(ctx, n) is None for n in range(1, len(ctx.world)))
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    try:
        run_ours(STANDARD, ctx, base, tmp_path / "logs-ours")
    finally:
        del store
    ours = collect(out, ctx.world_size)

    assert_same(real, ours, TORCHRUN_ONLY)
    for side in (real, ours):
        assert [side[r]["pg"] for r in range(3)] == [
            {"rank": r, "world_size": 3, "sum": 6.0} for r in range(3)]
    assert real[0]["env"]["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in real[2]["env"]
    assert real[0]["orig_argv"] == [PYTHON, "-u", str(PROBE_PATH), "--lr", "0.1", "two words"]
    assert "TORCHELASTIC_ERROR_FILE" in real[0]["env"] and "TORCHELASTIC_ERROR_FILE" not in ours[0]["env"]
