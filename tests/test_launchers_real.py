"""Integration: the launchers' ranks against the REAL tools, rank by rank, with tests/probe.py.

For each launcher the same two-node job (both "nodes" on this machine, master 127.0.0.1, one
master port) is started three times, one after the other, from the same explicitly built base
environment; the real side runs once per module (fixtures ``<launcher>_real``) and both other
sides are compared with it:

* the real side: what the real tool runs on each node —
  pdsh: the remote command of ``PDSH.real_commands`` (``export ...; cd <workdir>; python -u -m
  deepspeed.launcher.launch --node_rank=%n ...``) with ``%n`` replaced, run by ``bash -c`` as
  pdsh's ssh would run it; nossh: the ``deepspeed --no_ssh --node_rank=<n>`` command a user types
  (DeepSpeed's own runner script); standard: ``torchrun`` on both nodes at once (they
  rendezvous through node 0's TCPStore);
* our side: every :class:`RankLaunch` of every node started by ``agents.ranks.RankProcess``
  with ``compose_env(node env + launcher.env_defaults, rank.env)``, as the agent starts ranks;
  for standard the test hosts node 0's TCPStore (``launcher.agent_store``) as the agent must
  (``test_<launcher>_real``);
* the whole product (``test_<launcher>_orch_run``): ``orch run`` of a job spec that plans the
  same job (hostfile, include filter, launcher, master_port, env, workdir, entrypoint, args),
  with exactly the base environment (so the controller and its local agents, whose environment
  is the controller's, start from it); for standard node 0's agent hosts the store and the
  probes rendezvous through it (``PROBE_INIT_PG=1``). The job must SUCCEED and leave no process.

The probe reports are compared with ``probe.compare_probe_outputs``: the whole command line
(``sys.orig_argv``), the working directory, and every environment variable, except the few
listed per test with the reason they must differ (for ``orch run`` also the ``ORCH_*``
variables orch adds on purpose, whose values are checked separately).
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
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import assert_no_leftovers

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
           "LANG": "C.UTF-8", "DS_ACCELERATOR": "cpu", "PROBE_OUT_DIR": str(out_dir),
           # the tests' own op cache (conftest), else orch's preflight builds the op into this fresh home
           "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
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


@dataclass
class RealSide:
    """One launcher's job as the real tool ran it (once per module; shared by two tests).

    Attributes:
        ctx: the job, as a LaunchContext.
        base: the base environment of every node (and of the runner / orch's controller).
        out: the ``PROBE_OUT_DIR`` of both sides (it is in ``base``, so it must be the same).
        reports: the real tool's probe reports, ``{global rank: report}``.
        logs: the real commands' output.
        spec: job spec fields (docs/jobspec.md) from which ``orch run`` plans this same job.
        remote: pdsh only: the remote command pdsh would have run on every node.
    """

    ctx: LaunchContext
    base: dict[str, str]
    out: Path
    reports: dict[int, dict]
    logs: list[str]
    spec: dict
    remote: str = ""


def side_dirs(tmp_path_factory, name: str) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp(name)
    work = tmp / "work"
    work.mkdir()
    # read by DeepSpeed's pdsh runner (and orch's pdsh launcher) only
    (work / ".deepspeed_env").write_text(DEEPSPEED_ENV)
    return tmp, work, tmp / "probe-out"


def job_spec(name: str, launcher: str, ctx: LaunchContext, spec_env: dict[str, str], **more) -> dict:
    """The job spec orch plans ``ctx`` from: same hostfile and filter, port, script, args, workdir."""
    return {"name": name, "hostfile": ctx.hostfile, "include": ctx.include, "launcher": launcher,
            "master_port": ctx.master_port, "env": dict(spec_env), "workdir": ctx.workdir,
            "entrypoint": ctx.entrypoint, "args": list(ctx.args), **more}


def clear(out_dir: Path) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)  # nothing a failed earlier side left behind


#: ``.deepspeed_env`` in every test's workdir.
DEEPSPEED_ENV = "SHARED=hello world\nDS_TAG=a\\b\n"
SPEC_ENV = {"SPEC_VAR": "from the spec"}


# --------------------------------------------------------------------------- orch run


#: What orch adds to every rank on purpose (docs/contract.md); no real tool sets them.
ORCH_ADDED = {
    "ORCH_JOB_ID": "orch's job id (contract: ORCH_*); no real launcher has one",
    "ORCH_JOB_NAME": "the spec's name (contract: ORCH_*); no real launcher sets it",
    "ORCH_ATTEMPT": "orch's attempt number (contract: ORCH_*)",
    "ORCH_ATTEMPT_ID": "<job id>.<attempt>: orch's process marker (contract: ORCH_*)",
    "ORCH_RESTART_COUNT": "orch's restart count (contract: ORCH_*)",
    "ORCH_NODE": "the rank's hostfile host (contract: ORCH_*)",
    "ORCH_NODE_RANK": "the rank's node rank (contract: ORCH_*)",
    "ORCH_RUN_DIR": "the attempt's directory in orch's state dir (contract: ORCH_*)",
    "ORCH_CHECKPOINT_DIR": "orch's checkpoint directory (contract: ORCH_*)",
    "ORCH_REPORT_FILE": "where agents.report appends the rank's steps (contract: ORCH_*, docs/metrics.md)",
    "TORCHELASTIC_RESTART_COUNT": "the restart count as torchrun gives it, for every launcher (contract)",
    "PROMETHEUS_MULTIPROC_DIR": "prometheus_client's multiprocess directory of the node's exporter "
                                "(docs/metrics.md); set while the job exports metrics",
    "GLOO_SOCKET_IFNAME": "orch names the interface that routes to the master (agents.network; jobspec.md: the ranks' environment); the real launcher leaves gloo to guess by the hostname",
    "NCCL_SOCKET_IFNAME": "as GLOO_SOCKET_IFNAME, for NCCL's sockets",
    "TORCH_EXTENSIONS_DIR": "orch's per-environment op cache, given to a DeepSpeed job's ranks when their environment "
                            "sets none (agents.nodeenv; jobspec.md)",
}
ORCH_CONFIG = {"ORCH_DEEPSPEED_CONFIG": "path of the spec's DeepSpeed config as orch wrote it "
                                        "(contract: ORCH_*); set only when the spec has one"}


def run_orch(orch, write_spec, side: RealSide, **fields) -> tuple[dict, dict[int, dict]]:
    """``orch run`` the side's job (``fields`` override spec fields) from exactly the side's base
    environment; assert it SUCCEEDED and left no process; return its detail and probe reports."""
    clear(side.out)
    spec = write_spec(**{**side.spec, **fields})
    r = orch("run", str(spec), "--output", "json", env=side.base, replace_env=True, timeout=TIMEOUT)
    try:
        detail = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"orch run printed no JSON ({r.returncode}):\n{r.stdout[-4000:]}\n"
                             f"{r.stderr[-4000:]}") from None
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (
        f"orch run exited {r.returncode}, job {detail['state']}: {detail.get('cause')}\n{r.stderr[-4000:]}")
    assert_no_leftovers(detail["id"])
    return detail, collect(side.out, side.ctx.world_size)


def check_orch_vars(orch, side: RealSide, detail: dict, ours: dict[int, dict], config: bool = False) -> dict:
    """Every rank of ours has exactly the documented ORCH_* variables with their values (so
    nothing else of orch's own environment, e.g. the ORCH_STATE_DIR given to ``orch run`` or the
    agents' ORCH_AGENT_ATTEMPT_ID, leaks in); the real side has none. Returns them with the
    reasons the comparison may ignore them for."""
    job_id = detail["id"]
    job_dir = (orch.state_dir / "jobs" / job_id).resolve()
    run_dir = str(job_dir / "attempt-1")
    assert detail["run_dir"] == run_dir
    first = 0
    for node_rank, (host, slots) in enumerate(side.ctx.world):
        expected = {"ORCH_JOB_ID": job_id, "ORCH_JOB_NAME": side.spec["name"], "ORCH_ATTEMPT": "1",
                    "ORCH_ATTEMPT_ID": f"{job_id}.1", "ORCH_RESTART_COUNT": "0", "ORCH_NODE": host,
                    "ORCH_NODE_RANK": str(node_rank), "ORCH_RUN_DIR": run_dir,
                    "ORCH_CHECKPOINT_DIR": str(job_dir / "checkpoints")}
        node_metrics = f"{run_dir}/scratch/node-{node_rank}"  # the attempt's scratch (docs/housekeeping.md)
        assert side.reports[first]["env"].get("PROMETHEUS_MULTIPROC_DIR") is None
        assert ours[first]["env"]["PROMETHEUS_MULTIPROC_DIR"] == f"{node_metrics}/prom"  # metrics_port: auto
        if config:
            expected["ORCH_DEEPSPEED_CONFIG"] = os.path.join(run_dir, "ds_config.json")
        for rank in range(first, first + len(slots)):
            got = {k: v for k, v in ours[rank]["env"].items() if k.startswith("ORCH_")}
            expected["ORCH_REPORT_FILE"] = f"{node_metrics}/reports/rank-{rank}.jsonl"
            assert got == expected, f"rank {rank}: ORCH_* variables {got} != {expected}"
            assert not [k for k in side.reports[rank]["env"] if k.startswith("ORCH_")]
            # the interface of the collectives: one of this machine's (local agents share it), named for both
            interface = ours[rank]["env"]["GLOO_SOCKET_IFNAME"]
            assert interface in psutil.net_if_addrs() and ours[rank]["env"]["NCCL_SOCKET_IFNAME"] == interface
            assert "GLOO_SOCKET_IFNAME" not in side.reports[rank]["env"]
        first += len(slots)
    return {**ORCH_ADDED, **(ORCH_CONFIG if config else {})}


# --------------------------------------------------------------------------- pdsh


@pytest.fixture(scope="module")
def pdsh_real(tmp_path_factory) -> RealSide:
    tmp, work, out = side_dirs(tmp_path_factory, "pdsh")
    # One environment for the runner and every node (pdsh to this machine; and orch's local
    # agents have the controller's environment): what DeepSpeed's runner exports from it
    # (PYTHON*, MLFLOW*, UCX*; no NCCL* on CPU) is laid over the same variables on the nodes.
    base = node_env(tmp, out, PYTHONPATH="/opt/site",
                    PYTHONHASHSEED="0", MLFLOW_RUN_NAME="run one", UCX_TLS="tcp,self", NCCL_DEBUG="INFO")
    hostfile = tmp / "hostfile"
    hostfile.write_text("nodeA slots=3\nnodeB slots=4\n")
    # what the planner computes on the controller, from the runner's environment
    exports = pdsh_exports(base, str(work), DEEPSPEED_ENV.splitlines(keepends=True), accelerator_exports=())
    exports.update(SPEC_ENV)
    ctx = LaunchContext(world=(("nodeA", (0, 2)), ("nodeB", (0, 1, 3))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("--flag", "two words", 'say "hi" now', "--x=1"), workdir=str(work),
                        exports=exports, hostfile=str(hostfile), include="nodeA:0,2@nodeB:0,1,3")
    [cmd] = PDSH.real_commands(ctx)
    assert cmd.argv[:6] == ("pdsh", "-S", "-f", "1024", "-w", "nodeA,nodeB")
    remote = " ".join(cmd.argv[6:])  # pdsh joins its command words with spaces
    real_cmds = [(["bash", "-c", remote.replace("%n", str(n))], dict(base), "/")
                 for n in range(len(ctx.world))]
    clear(out)
    logs = run_real(real_cmds, tmp / "logs-real")
    return RealSide(ctx, base, out, collect(out, ctx.world_size), logs,
                    job_spec("probe-pdsh", "pdsh", ctx, SPEC_ENV), remote)


def test_pdsh_real(pdsh_real, tmp_path):
    side, work = pdsh_real, pdsh_real.ctx.workdir
    clear(side.out)
    run_ours(PDSH, side.ctx, side.base, tmp_path / "logs-ours")
    ours = collect(side.out, side.ctx.world_size)

    real = side.reports
    assert_same(real, ours, BASH_ONLY)
    # spot checks of what was compared
    assert [real[r]["env"]["LOCAL_RANK"] for r in range(5)] == ["0", "1", "2", "0", "1"]
    assert real[2]["orig_argv"][-4:] == ["--flag", "two words", 'say "hi" now', "--x=1"]
    assert real[0]["env"]["PYTHONPATH"] == f"{work}:/opt/site"
    assert real[0]["env"]["MLFLOW_RUN_NAME"] == "run one" and real[0]["env"]["SHARED"] == "hello world"
    assert "export NCCL_DEBUG" not in side.remote and real[0]["env"]["NCCL_DEBUG"] == "INFO"
    assert real[0]["env"]["DS_TAG"] == "a\\b"
    assert real[0]["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


def test_pdsh_orch_run(pdsh_real, orch, write_spec):
    side = pdsh_real
    detail, ours = run_orch(orch, write_spec, side)
    ignore = {**BASH_ONLY, **check_orch_vars(orch, side, detail, ours)}
    assert_same(side.reports, ours, ignore)
    assert ours[4]["env"]["SHARED"] == "hello world" and ours[4]["env"]["SPEC_VAR"] == "from the spec"


# --------------------------------------------------------------------------- nossh


@pytest.fixture(scope="module")
def nossh_real(tmp_path_factory) -> RealSide:
    tmp, work, out = side_dirs(tmp_path_factory, "nossh")
    base = node_env(tmp, out, PYTHONPATH="/opt/site")  # nossh leaves PYTHONPATH alone
    hostfile = tmp / "hostfile"
    hostfile.write_text("nodeA slots=3\nnodeB slots=4\n")
    ctx = LaunchContext(world=(("nodeA", (0, 2)), ("nodeB", (0, 1, 3))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("two words", "*.json", "$HOME"), workdir=str(work),
                        exports=dict(SPEC_ENV), hostfile=str(hostfile),
                        include="nodeA:0,2@nodeB:0,1,3")
    cmds = NOSSH.real_commands(ctx)
    user_cmds = cmds[0::2]
    # `deepspeed` is DeepSpeed's runner script; run it under ctx.python
    real_cmds = [([PYTHON, str(VENV_BIN / "deepspeed"), *c.argv[1:]], {**base, **c.env}, str(work))
                 for c in user_cmds]
    clear(out)
    logs = run_real(real_cmds, tmp / "logs-real")
    for text, execd in zip(logs, cmds[1::2]):  # the runner logs what it execs
        assert f"cmd = {' '.join(execd.argv)}" in text
    # a DeepSpeed config, so that orch also sets ORCH_DEEPSPEED_CONFIG (no deepspeed_args: argv unchanged)
    spec = job_spec("probe-nossh", "nossh", ctx, SPEC_ENV,
                    deepspeed_config={"train_micro_batch_size_per_gpu": 1})
    return RealSide(ctx, base, out, collect(out, ctx.world_size), logs, spec)


def test_nossh_real(nossh_real, tmp_path):
    side = nossh_real
    clear(side.out)
    run_ours(NOSSH, side.ctx, side.base, tmp_path / "logs-ours")
    ours = collect(side.out, side.ctx.world_size)

    real = side.reports
    assert_same(real, ours, {})
    assert [real[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(5)] == ["0,2"] * 2 + ["0,1,3"] * 3
    assert real[4]["orig_argv"][-4:] == ["--local_rank=1", "two words", "*.json", "$HOME"]
    assert "SHARED" not in real[0]["env"]  # --no_ssh ignores .deepspeed_env


def test_nossh_orch_run(nossh_real, orch, write_spec):
    side = nossh_real
    detail, ours = run_orch(orch, write_spec, side)
    ignore = check_orch_vars(orch, side, detail, ours, config=True)
    assert_same(side.reports, ours, ignore)
    with open(ours[0]["env"]["ORCH_DEEPSPEED_CONFIG"]) as f:  # the spec's, plus DeepSpeed's CSV monitor for metrics
        assert json.load(f) == {"train_micro_batch_size_per_gpu": 1, "csv_monitor": {
            "enabled": True, "output_path": f"{detail['run_dir']}/scratch/deepspeed", "job_name": "rank0"}}


# --------------------------------------------------------------------------- standard


@pytest.fixture(scope="module")
def standard_real(tmp_path_factory) -> RealSide:
    tmp, work, out = side_dirs(tmp_path_factory, "standard")
    base = node_env(tmp, out, PROBE_INIT_PG="1")  # no OMP_NUM_THREADS: torchrun's default
    hostfile = tmp / "hostfile"
    hostfile.write_text("nodeA slots=2\nnodeB slots=2\n")
    ctx = LaunchContext(world=(("nodeA", (0, 1)), ("nodeB", (1,))), master_addr="127.0.0.1",
                        master_port=free_port(), python=PYTHON, entrypoint=str(PROBE_PATH),
                        args=("--lr", "0.1", "two words"), workdir=str(work),
                        exports=dict(SPEC_ENV), run_id="itest-1", hostfile=str(hostfile),
                        include="nodeA@nodeB:1")
    cmds = STANDARD.real_commands(ctx)
    # `torchrun` is torch's console script; run it under ctx.python
    real_cmds = [([PYTHON, str(VENV_BIN / "torchrun"), *c.argv[1:]], {**base, **c.env}, str(work))
                 for c in cmds]
    clear(out)
    logs = run_real(real_cmds, tmp / "logs-real")
    return RealSide(ctx, base, out, collect(out, ctx.world_size), logs,
                    job_spec("probe-standard", "standard", ctx, SPEC_ENV))


def test_standard_real(standard_real, tmp_path):
    from torch.distributed import TCPStore

    side, ctx = standard_real, standard_real.ctx
    addr, port = STANDARD.agent_store(ctx, 0)
    assert all(STANDARD.agent_store(ctx, n) is None for n in range(1, len(ctx.world)))
    clear(side.out)
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    try:
        run_ours(STANDARD, ctx, side.base, tmp_path / "logs-ours")
    finally:
        del store
    ours = collect(side.out, ctx.world_size)

    real = side.reports
    assert_same(real, ours, TORCHRUN_ONLY)
    for s in (real, ours):
        assert [s[r]["pg"] for r in range(3)] == [
            {"rank": r, "world_size": 3, "sum": 6.0} for r in range(3)]
    assert real[0]["env"]["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in real[2]["env"]
    assert real[0]["orig_argv"] == [PYTHON, "-u", str(PROBE_PATH), "--lr", "0.1", "two words"]
    assert "TORCHELASTIC_ERROR_FILE" in real[0]["env"] and "TORCHELASTIC_ERROR_FILE" not in ours[0]["env"]


#: torchrun's run id is its ``--rdzv_id``; orch passes its job id, which it makes when the job is
#: submitted (``<name>-<6 hex digits>``), so the real torchrun, run before, had another one.
RUN_ID = {"TORCHELASTIC_RUN_ID": "torchrun's --rdzv_id: the real side ran with "
                                 "--rdzv_id=itest-1; orch's is the job id, made at submit "
                                 "(checked to be the job id below)"}


def test_standard_orch_run(standard_real, orch, write_spec):
    side = standard_real
    detail, ours = run_orch(orch, write_spec, side)  # node 0's agent hosts the store
    ignore = {**TORCHRUN_ONLY, **RUN_ID, **check_orch_vars(orch, side, detail, ours)}
    assert_same(side.reports, ours, ignore)
    assert [ours[r]["pg"] for r in range(3)] == [{"rank": r, "world_size": 3, "sum": 6.0} for r in range(3)]
    assert {ours[r]["env"]["TORCHELASTIC_RUN_ID"] for r in range(3)} == {detail["id"]}
    assert {side.reports[r]["env"]["TORCHELASTIC_RUN_ID"] for r in range(3)} == {side.ctx.run_id}
    assert "TORCHELASTIC_ERROR_FILE" not in ours[0]["env"]
