"""Pure tests of orchestrator.launchers: tables, DeepSpeed's own code as the oracle, golden files.

DeepSpeed's functions are called in-process as oracles (no process is started):

* ``deepspeed.launcher.launch.main()`` with ``subprocess.Popen`` captured: the argv and env of
  every rank, for every node of every world below (pdsh and nossh ranks);
* ``PDSHRunner.get_cmd`` with a Namespace from ``runner.parse_args``: the pdsh command;
* ``deepspeed.launcher.runner.main()`` with ``Popen`` captured: the pdsh command and the
  exports it builds from the runner's environment and ``.deepspeed_env`` files, and the
  ``launch`` command ``deepspeed --no_ssh`` execs.

Golden files (tests/golden/*.json) pin every launcher's output for a few contexts; regenerate
them with ``ORCH_UPDATE_GOLDEN=1 python -m pytest tests/test_launchers.py -k golden``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (no CUDA here)

from orchestrator.errors import LaunchError  # noqa: E402
from orchestrator.launchers import (LAUNCHERS, LaunchContext, compose_rank_env,  # noqa: E402
                                    get_launcher)
from orchestrator.launchers.deepspeed import (NOSSH, PDSH, deepspeed_env_exports,  # noqa: E402
                                              deepspeed_env_files, encode_world_info, pdsh_export_value, pdsh_exports,
                                              render_pdsh_export)
from orchestrator.launchers.torchrun import STANDARD  # noqa: E402

GOLDEN = Path(__file__).with_name("golden")

WORLDS = {
    "one_node": (("localhost", (0, 1, 2, 3)),),
    "one_slot": (("n0", (0,)),),
    "even": (("n0", (0, 1)), ("n1", (0, 1))),
    "uneven": (("n0", (0, 1)), ("n1", (0, 1, 2))),
    "noncontiguous": (("n0", (0, 2)), ("n1", (1, 3, 5))),
    "many": tuple((f"worker-{i}", tuple(range(i % 4 + 1))) for i in range(9)),
}


def make_ctx(world, **kw) -> LaunchContext:
    base = dict(world=world, master_addr="10.1.2.3", master_port=29511, python=sys.executable,
                entrypoint="train.py", args=("--deepspeed_config", "ds.json", "--lr=0.1"),
                workdir="/work/job")
    base.update(kw)
    return LaunchContext(**base)


# --------------------------------------------------------------------------- registry


def test_get_launcher_case_insensitive():
    assert get_launcher("PDSH") is LAUNCHERS["pdsh"]
    assert get_launcher("Standard").name == "standard"
    assert get_launcher("nossh").name == "nossh"
    assert set(LAUNCHERS) == {"pdsh", "standard", "nossh", "openmpi", "mpich", "impi", "mvapich", "slurm"}


def test_get_launcher_unknown():
    with pytest.raises(LaunchError, match="unknown launcher 'foo'.*pdsh, standard, nossh, openmpi"):
        get_launcher("foo")


# --------------------------------------------------------------------------- DeepSpeed: tables


def test_deepspeed_local_rank_quirk_uneven():
    ctx = make_ctx(WORLDS["uneven"])
    r = PDSH.ranks(ctx, 1)
    assert [x.global_rank for x in r] == [2, 3, 4]
    assert [x.local_rank for x in r] == [2, 0, 1]  # dist_rank % num_local_procs
    assert [x.env["LOCAL_RANK"] for x in r] == ["2", "0", "1"]
    assert [x.argv[3] for x in r] == ["--local_rank=2", "--local_rank=0", "--local_rank=1"]
    assert [x.slot for x in r] == [2, 0, 1]


def test_deepspeed_noncontiguous_env():
    ctx = make_ctx(WORLDS["noncontiguous"], exports={"FOO": "bar", "RANK": "99"})
    r = NOSSH.ranks(ctx, 1)
    assert [x.slot for x in r] == [5, 1, 3]  # LOCAL_RANK 2, 0, 1 of slots (1, 3, 5)
    env = r[0].env
    assert env == {"FOO": "bar", "CUDA_VISIBLE_DEVICES": "1,3,5", "MASTER_ADDR": "10.1.2.3",
                   "MASTER_PORT": "29511", "WORLD_SIZE": "5", "CROSS_RANK": "1", "CROSS_SIZE": "2",
                   "LOCAL_SIZE": "3", "RANK": "2", "LOCAL_RANK": "2"}
    assert r[0].argv == (sys.executable, "-u", "train.py", "--local_rank=2", "--deepspeed_config",
                         "ds.json", "--lr=0.1")


@pytest.mark.parametrize("world", list(WORLDS.values()), ids=list(WORLDS))
def test_deepspeed_ranks_cover_world(world):
    ctx = make_ctx(world)
    seen = []
    for n, (_, slots) in enumerate(world):
        rs = PDSH.ranks(ctx, n)
        assert sorted(r.local_rank for r in rs) == list(range(len(slots)))
        assert sorted(r.slot for r in rs) == sorted(slots)
        seen += [r.global_rank for r in rs]
    assert seen == list(range(ctx.world_size))


def test_deepspeed_argv_flags():
    ctx = make_ctx(WORLDS["one_slot"], module=True, no_local_rank=True, entrypoint="pkg.train")
    assert PDSH.ranks(ctx, 0)[0].argv == (sys.executable, "-u", "-m", "pkg.train",
                                          "--deepspeed_config", "ds.json", "--lr=0.1")
    ctx = make_ctx(WORLDS["one_slot"], no_python=True, entrypoint="./run.sh", args=())
    assert NOSSH.ranks(ctx, 0)[0].argv == ("./run.sh", "--local_rank=0")
    with pytest.raises(LaunchError, match="no_python and module"):
        NOSSH.ranks(make_ctx(WORLDS["one_slot"], no_python=True, module=True), 0)
    with pytest.raises(LaunchError, match="node rank 2"):
        NOSSH.ranks(make_ctx(WORLDS["even"]), 2)


def test_deepspeed_env_defaults_and_store():
    ctx = make_ctx(WORLDS["even"])
    assert PDSH.env_defaults(ctx, 0) == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert PDSH.agent_store(ctx, 0) is None and NOSSH.agent_store(ctx, 1) is None
    assert compose_rank_env({"PYTORCH_NVML_BASED_CUDA_CHECK": "0", "A": "1"},
                            PDSH.env_defaults(ctx, 0), {"A": "2"}) == {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "0", "A": "2"}


# --------------------------------------------------------------------------- DeepSpeed: launch.py oracle


@pytest.fixture(scope="module")
def ds():
    launch = pytest.importorskip("deepspeed.launcher.launch")
    runner = pytest.importorskip("deepspeed.launcher.runner")
    multinode = pytest.importorskip("deepspeed.launcher.multinode_runner")
    return types.SimpleNamespace(launch=launch, runner=runner, multinode=multinode)


class _FakeProc:
    _next_pid = 100000

    def __init__(self):
        _FakeProc._next_pid += 1
        self.pid = _FakeProc._next_pid
        self.returncode = 0

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0

    def send_signal(self, sig):
        pass


def _capture_popen(monkeypatch, module):
    calls = []

    def fake_popen(cmd, env=None, **kw):
        calls.append((list(cmd), dict(env) if env is not None else None))
        return _FakeProc()

    monkeypatch.setattr(module, "subprocess", types.SimpleNamespace(Popen=fake_popen))
    monkeypatch.setattr(module, "signal", types.SimpleNamespace(
        signal=lambda *a, **k: None, SIGINT=signal.SIGINT, SIGTERM=signal.SIGTERM))
    return calls


def run_launch_main(ds, monkeypatch, argv):
    """Run deepspeed.launcher.launch.main() with ``argv``; return [(cmd, env)] of its spawns."""
    calls = _capture_popen(monkeypatch, ds.launch)
    monkeypatch.setattr(ds.launch, "time", types.SimpleNamespace(
        sleep=lambda s: None, strftime=__import__("time").strftime,
        localtime=__import__("time").localtime))
    monkeypatch.setattr(sys, "argv", ["launch.py"] + list(argv))
    ds.launch.main()
    return calls


CASES = [(w, n, flags) for w in WORLDS for n in range(len(WORLDS[w]))
         for flags in ([],)] + [
    ("uneven", 1, ["module"]), ("noncontiguous", 0, ["no_local_rank"]),
    ("even", 1, ["no_python"]), ("uneven", 0, ["module", "no_local_rank"])]


@pytest.mark.parametrize("world_name,node_rank,flags", CASES)
@pytest.mark.parametrize("launcher", [PDSH, NOSSH], ids=["pdsh", "nossh"])
def test_ranks_match_deepspeed_launch(ds, monkeypatch, launcher, world_name, node_rank, flags):
    """Every rank's argv and env equal what launch.py main() passes to Popen."""
    monkeypatch.setenv("ORCH_TEST_NODE_VAR", "node value")
    monkeypatch.setenv("RANK", "stale")  # launch.py overwrites inherited values
    kw = {f: True for f in flags}
    if "no_python" in flags:
        kw["entrypoint"] = "/bin/true"
    ctx = make_ctx(WORLDS[world_name], exports={"SPEC_VAR": "x"}, **kw)
    argv = [f"--world_info={encode_world_info(ctx.world)}", f"--node_rank={node_rank}",
            f"--master_addr={ctx.master_addr}", f"--master_port={ctx.master_port}"]
    argv += [f"--{f}" for f in flags] + [ctx.entrypoint, *ctx.args]
    monkeypatch.setenv("SPEC_VAR", "x")  # exports are in launch.py's environment
    calls = run_launch_main(ds, monkeypatch, argv)
    node_env = dict(os.environ)
    ours = launcher.ranks(ctx, node_rank)
    assert len(calls) == len(ours)
    for (cmd, env), rank in zip(calls, ours):
        assert list(rank.argv) == cmd
        assert compose_rank_env(node_env, launcher.env_defaults(ctx, node_rank), rank.env) == env


# --------------------------------------------------------------------------- pdsh: get_cmd oracle


def pdsh_oracle(ds, ctx, monkeypatch, tmp_path):
    """PDSHRunner.get_cmd for ``ctx`` (run from ctx.workdir with the test's interpreter)."""
    monkeypatch.chdir(ctx.workdir)
    argv = ["--hostfile", str(tmp_path / "nohostfile"), "--master_addr", ctx.master_addr,
            "--master_port", str(ctx.master_port)]
    if ctx.ssh_port is not None:
        argv += ["--ssh_port", str(ctx.ssh_port)]
    if ctx.launcher_args:
        argv += ["--launcher_args", " ".join(ctx.launcher_args)]
    argv += [f"--{f}" for f in ("module", "no_python", "no_local_rank") if getattr(ctx, f)]
    args = ds.runner.parse_args(argv + [ctx.entrypoint, *ctx.args])
    active = collections.OrderedDict((h, list(s)) for h, s in ctx.world)
    runner = ds.multinode.PDSHRunner(args, ds.runner.encode_world_info(active))
    for k, v in ctx.exports.items():
        runner.add_export(k, v)
    # runner.main() hands get_cmd its environment, whose PYTHONPATH it set to the exported value
    runner_env = {"PYTHONPATH": ctx.exports["PYTHONPATH"]} if "PYTHONPATH" in ctx.exports else {}
    if ctx.pdsh_ssh_args_append is not None:
        runner_env["PDSH_SSH_ARGS_APPEND"] = ctx.pdsh_ssh_args_append
    cmd, _kill, env = runner.get_cmd(runner_env, active)
    return cmd, env


PDSH_CASES = {
    "plain": dict(),
    "exports": dict(exports={"PYTHONPATH": "/work/job:/opt/lib", "NCCL_DEBUG": "INFO",
                             "MSG": "hello world", "BS": "a\\b", "WEIRD": "x;y|z&(w)"}),
    "args_with_spaces": dict(args=("--name", "my run", 'say "hi" there', "--x=1")),
    "flags": dict(module=True, no_local_rank=True, entrypoint="pkg.mod"),
    "no_python": dict(no_python=True, entrypoint="/opt/bin/run.sh"),
    "ssh_port": dict(ssh_port=2222),
    "ssh_port_and_user_ssh_args": dict(ssh_port=2222, pdsh_ssh_args_append="-o ConnectTimeout=7"),
    "user_ssh_args": dict(pdsh_ssh_args_append="-F /etc/orch/ssh_config"),
    "launcher_args": dict(launcher_args=("-R", "ssh", "-u", "30")),
    "many": dict(world=WORLDS["many"]),
}


@pytest.mark.parametrize("case", list(PDSH_CASES))
def test_pdsh_command_matches_get_cmd(ds, monkeypatch, tmp_path, case):
    kw = dict(world=WORLDS["noncontiguous"], workdir=str(tmp_path))
    kw.update(PDSH_CASES[case])
    ctx = make_ctx(**kw)
    cmd, env = pdsh_oracle(ds, ctx, monkeypatch, tmp_path)
    [ours] = PDSH.real_commands(ctx)
    assert ours.where is None
    assert list(ours.argv) == cmd
    assert dict(ours.env) == env
    PDSH.ranks(ctx, 0)  # expressible: no LaunchError


def _bash_export(rendered: str) -> str:
    out = subprocess.run(["bash", "-c", f'export K={rendered}; printf %s "$K"'],
                         capture_output=True, text=True, check=True, env={"PATH": os.defpath})
    return out.stdout


@pytest.mark.parametrize("value", ["plain", "/a/b:/c", "", "two words", "a\\b", "a\\\\b",
                                   "x;y", "tab\there", "ümlaut", "a\\\"b", "q'uote"])
@pytest.mark.integration
def test_pdsh_export_value_matches_bash(value):
    """pdsh_export_value emulates what a POSIX shell makes of DeepSpeed's `export K=...`."""
    assert pdsh_export_value(value) == _bash_export(render_pdsh_export(value))


@pytest.mark.parametrize("value,why", [("$HOME/x", "expand"), ("a`id`", "expand"),
                                       ('say "hi" now', "double quote"), ("50%n", "pdsh"),
                                       ("end\\", "backslash")])
def test_pdsh_export_value_refuses(value, why):
    with pytest.raises(LaunchError, match=why):
        pdsh_export_value(value)


@pytest.mark.parametrize("kw,match", [
    (dict(args=("*.json",)), "argument"),
    (dict(args=("",)), "argument"),
    (dict(args=("it's",)), "argument"),
    (dict(args=("$HOME x",)), "argument"),
    (dict(args=("a\tb",)), "argument"),
    (dict(workdir="/my work"), "working directory"),
    (dict(python="/opt/py 3/bin/python"), "interpreter"),
    (dict(exports={"K": "$PATH"}), "expand"),
    (dict(exports={"K": " padded"}), "whitespace"),
    (dict(exports={"K": "a\\\\b"}), "would reach the ranks as"),
    (dict(exports={"1BAD": "x"}), "not a shell variable"),
])
def test_pdsh_warns_about_what_the_remote_shell_changes(kw, match):
    ctx = make_ctx(WORLDS["even"], **kw)
    warnings = PDSH.warnings(ctx)
    assert any(re.search(match, w) for w in warnings), warnings
    assert all("orch passes it exactly" in w for w in warnings)
    [r0, *_] = PDSH.ranks(ctx, 0)  # orch itself passes everything byte for byte
    assert list(r0.argv[-len(ctx.args):]) == list(ctx.args) if ctx.args else True
    for key, value in ctx.exports.items():
        assert r0.env[key] == value
    assert NOSSH.warnings(ctx) == []
    assert PDSH.warnings(make_ctx(WORLDS["even"])) == []


# --------------------------------------------------------------------------- runner.main oracle


def run_runner_main(ds, monkeypatch, argv):
    calls = _capture_popen(monkeypatch, ds.runner)
    monkeypatch.setattr(ds.multinode.PDSHRunner, "backend_exists", lambda self: "/usr/bin/pdsh")
    ds.runner.main(list(argv))
    return calls


def test_pdsh_exports_and_command_match_runner_main(ds, monkeypatch, tmp_path):
    """runner.main(): our pdsh_exports + real_commands equal the command and env it runs."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (work / ".deepspeed_env").write_text("SHARED=work value\nNCCL_SOCKET_IFNAME=eth0\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=4\nn1 slots=4\n")
    monkeypatch.setattr(ds.runner, "DEEPSPEED_ENVIRONMENT_PATHS", [str(home), "."])
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # cpu accelerator exports no NCCL*: not exported
    monkeypatch.delenv("AISC_JOB_NAME", raising=False)
    include = "n0:0,2@n1:1,3"
    calls = run_runner_main(ds, monkeypatch, [
        "--hostfile", str(hostfile), "--include", include, "--no_ssh_check",
        "--master_addr", "10.1.2.3", "--master_port", "29511", "train.py", "--x", "a b"])
    [(cmd, env)] = calls

    lines = []
    for path in deepspeed_env_files(dict(os.environ), str(home), str(work)):
        if os.path.isfile(path):
            lines += Path(path).read_text().splitlines(keepends=True)
    exports = pdsh_exports(dict(os.environ), str(work), lines, accelerator_exports=())
    assert exports["PYTHONPATH"] == f"{work}:/opt/site"
    assert exports["SHARED"] == "work value" and "NCCL_DEBUG" not in exports
    ctx = make_ctx((("n0", (0, 2)), ("n1", (1, 3))), workdir=str(work), args=("--x", "a b"),
                   exports=exports, hostfile=str(hostfile), include=include)
    [ours] = PDSH.real_commands(ctx)
    assert list(ours.argv) == cmd
    assert env == {**os.environ, **ours.env}


@pytest.mark.parametrize("flags", [[], ["--module", "--no_local_rank"]])
def test_pdsh_single_node_runs_launch_locally(ds, monkeypatch, tmp_path, flags):
    """One node: runner.main() skips pdsh and execs launch.py with its own environment."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=4\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    ctx = make_ctx((("n0", (1, 3)),), workdir=str(tmp_path), hostfile=str(hostfile),
                   include="n0:1,3", args=("it's", "$HOME"), module="--module" in flags,
                   no_local_rank="--no_local_rank" in flags, exports={"K": "$x"})
    assert not PDSH.uses_pdsh(ctx)
    [ours] = PDSH.real_commands(ctx)
    PDSH.ranks(ctx, 0)  # no remote shell: nothing to refuse
    calls = run_runner_main(ds, monkeypatch, [
        "--hostfile", str(hostfile), "--include", "n0:1,3", "--no_ssh_check",
        "--master_addr", ctx.master_addr,
        "--master_port", str(ctx.master_port), *flags, ctx.entrypoint, *ctx.args])
    [(cmd, env)] = calls
    assert ours.where is None and list(ours.argv) == cmd
    assert env == dict(os.environ)  # no PYTHONPATH prefix, no exports


def test_bind_cores_auto_is_in_the_local_launch_and_said_lost_under_pdsh(ds, monkeypatch, tmp_path):
    """--bind_cores_to_rank reaches launch.py on the runner's local path only: PDSHRunner.get_cmd drops it."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=2\nn1 slots=2\n")
    monkeypatch.chdir(tmp_path)
    one = make_ctx((("n0", (0, 1)),), workdir=str(tmp_path), hostfile=str(hostfile), include="n0",
                   bind_cores="auto")
    [ours] = PDSH.real_commands(one)
    calls = run_runner_main(ds, monkeypatch, ["--hostfile", str(hostfile), "--include", "n0", "--no_ssh_check",
                                              "--master_addr", one.master_addr, "--master_port", str(one.master_port),
                                              "--bind_cores_to_rank", one.entrypoint, *one.args])
    assert list(ours.argv) == calls[0][0] and "--bind_cores_to_rank" in ours.argv
    two = make_ctx((("n0", (0, 1)), ("n1", (0, 1))), workdir=str(tmp_path), hostfile=str(hostfile),
                   bind_cores="auto")
    [ours] = PDSH.real_commands(two)
    calls = run_runner_main(ds, monkeypatch, ["--hostfile", str(hostfile), "--no_ssh_check", "--master_addr",
                                              two.master_addr, "--master_port", str(two.master_port),
                                              "--bind_cores_to_rank", two.entrypoint, *two.args])
    # (the exports, argv[6], are the runner's environment's: test_pdsh_exports_and_command_match_runner_main)
    assert list(ours.argv[7:]) == calls[0][0][7:] and "--bind_cores_to_rank" not in " ".join(ours.argv)
    assert any("does not pass --bind_cores_to_rank" in w for w in PDSH.warnings(two))


def test_pdsh_exports_aisc_exclusion():
    env = {"AISC_JOB_NAME": "j", "NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN", "UCX_NET_DEVICES": "x",
           "UCX_TLS": "tcp", "PATH": "/bin"}
    assert pdsh_exports(env, "/w") == {"NCCL_DEBUG": "WARN", "UCX_TLS": "tcp", "PYTHONPATH": "/w"}
    with pytest.raises(LaunchError, match="not KEY=VALUE"):
        pdsh_exports({}, "/w", ["JUSTAKEY\n"])
    with pytest.raises(LaunchError, match="not KEY=VALUE"):
        deepspeed_env_exports(["A=1\n", "\n"])  # DeepSpeed fails on a blank line too
    lines = ["A=1\n", " B = x y \n", "A=2\n"]
    assert deepspeed_env_exports(lines) == {"A": "2", "B": "x y"}
    merged = pdsh_exports({"PYTHONX": "p"}, "/w")
    merged.update(deepspeed_env_exports(lines))
    assert merged == pdsh_exports({"PYTHONX": "p"}, "/w", lines)
    assert deepspeed_env_files({"DS_ENV_FILE": "my.env"}, "/h", "/w") == ["/h/my.env", "/w/my.env"]


@pytest.mark.parametrize("flags", [[], ["--module", "--no_local_rank"], ["--bind_cores_to_rank"]])
def test_nossh_commands_match_runner_main(ds, monkeypatch, tmp_path, flags):
    """runner.main() with --no_ssh execs our second command, with its own environment."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=2\nn1 slots=4\n")
    monkeypatch.chdir(tmp_path)
    ctx = make_ctx((("n0", (0, 1)), ("n1", (0, 1))), workdir=str(tmp_path), hostfile=str(hostfile),
                   num_gpus=2, module="--module" in flags, no_local_rank="--no_local_rank" in flags,
                   bind_cores="auto" if "--bind_cores_to_rank" in flags else "off")
    cmds = NOSSH.real_commands(ctx)
    assert len(cmds) == 4
    for n in range(2):
        user, execd = cmds[2 * n], cmds[2 * n + 1]
        assert user.where == execd.where == ctx.hosts[n]
        assert user.argv[0] == "deepspeed"
        calls = run_runner_main(ds, monkeypatch, list(user.argv[1:]))
        [(cmd, env)] = calls
        assert list(execd.argv) == cmd
        assert env == dict(os.environ)  # the runner passes its environment on unchanged


# --------------------------------------------------------------------------- standard (torchrun)


def test_standard_ranks_uneven():
    ctx = make_ctx(WORLDS["noncontiguous"], run_id="job-7", restart_count=2, max_restarts=3,
                   exports={"OMP_NUM_THREADS": "4", "RANK": "x"})
    r = STANDARD.ranks(ctx, 1)
    assert [x.global_rank for x in r] == [2, 3, 4] and [x.local_rank for x in r] == [0, 1, 2]
    assert [x.slot for x in r] == [1, 3, 5]
    assert r[1].argv == (sys.executable, "-u", "train.py", "--deepspeed_config", "ds.json", "--lr=0.1")
    assert r[1].env == {
        "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "1,3,5", "RANK": "3", "LOCAL_RANK": "1",
        "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "3",
        "WORLD_SIZE": "5", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "5",
        "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job-7",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}
    assert STANDARD.env_defaults(ctx, 1) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # OMP exported
    assert STANDARD.env_defaults(make_ctx(WORLDS["noncontiguous"]), 0) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1"}
    assert STANDARD.env_defaults(make_ctx(WORLDS["one_slot"]), 0) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # one worker: torchrun leaves OMP alone


@pytest.mark.parametrize("world", list(WORLDS.values()), ids=list(WORLDS))
def test_standard_ranks_cover_world(world):
    ctx = make_ctx(world)
    seen = []
    for n in range(len(world)):
        rs = STANDARD.ranks(ctx, n)
        assert [r.local_rank for r in rs] == list(range(len(world[n][1])))
        seen += [r.global_rank for r in rs]
        assert STANDARD.agent_store(ctx, n) == (("10.1.2.3", 29511) if n == 0 else None)
    assert seen == list(range(ctx.world_size))


def test_standard_argv_and_commands():
    ctx = make_ctx(WORLDS["uneven"], module=True, entrypoint="pkg.train", args=("a b",), run_id="r1",
                   exports={"K": "v"})
    assert STANDARD.ranks(ctx, 0)[0].argv == (sys.executable, "-u", "-m", "pkg.train", "a b")
    cmds = STANDARD.real_commands(ctx)
    assert [c.where for c in cmds] == ["n0", "n1"]
    assert cmds[1].argv == ("torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=3",
                            "--rdzv_backend=static", "--rdzv_id=r1", "--max_restarts=0",
                            "--master_addr=10.1.2.3", "--master_port=29511", "--module",
                            "pkg.train", "a b")
    assert cmds[1].env == {"K": "v", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    ctx = make_ctx(WORLDS["one_slot"], no_python=True, entrypoint="./x.sh", args=())
    assert STANDARD.ranks(ctx, 0)[0].argv == ("./x.sh",)
    with pytest.raises(LaunchError, match="no_python and module"):
        STANDARD.ranks(make_ctx(WORLDS["one_slot"], no_python=True, module=True), 0)


def test_standard_command_parses_with_torchrun():
    run = pytest.importorskip("torch.distributed.run")
    ctx = make_ctx(WORLDS["uneven"], run_id="r1", max_restarts=2)
    for n, cmd in enumerate(STANDARD.real_commands(ctx)):
        args = run.parse_args(list(cmd.argv[1:]))
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", n, str(len(ctx.world[n][1])))
        assert (args.rdzv_backend, args.rdzv_id, args.max_restarts) == ("static", "r1", 2)
        assert (args.master_addr, args.master_port) == ("10.1.2.3", 29511)
        assert (args.training_script, args.training_script_args) == ("train.py", list(ctx.args))


# --------------------------------------------------------------------------- golden files


GOLDEN_CASES = {
    "pdsh_uneven_exports": ("pdsh", dict(world=(("node-a", (0, 1)), ("node-b", (0, 1, 2))),
                                         exports={"PYTHONPATH": "/work/job", "MSG": "hi there"},
                                         args=("--name", "my run"))),
    "pdsh_one_node_module": ("pdsh", dict(world=(("node-a", (0, 2)),), module=True,
                                          entrypoint="pkg.train", no_local_rank=True, ssh_port=2222)),
    "nossh_filters": ("nossh", dict(world=(("node-a", (1, 3)), ("node-b", (0,))),
                                    hostfile="/etc/orch/hostfile", include="node-a:1,3@node-b:0")),
    "standard_uneven": ("standard", dict(world=(("node-a", (0, 1)), ("node-b", (2,))),
                                         run_id="job-42", restart_count=1, max_restarts=0,
                                         exports={"OMP_NUM_THREADS": "8"})),
}


def render_golden(launcher_name: str, ctx: LaunchContext) -> dict:
    launcher = get_launcher(launcher_name)
    return {
        "launcher": launcher_name,
        "nodes": [{
            "host": host,
            "agent_store": launcher.agent_store(ctx, n),
            "env_defaults": launcher.env_defaults(ctx, n),
            "ranks": [{"global_rank": r.global_rank, "local_rank": r.local_rank, "slot": r.slot,
                       "argv": list(r.argv), "env": dict(r.env)} for r in launcher.ranks(ctx, n)],
        } for n, host in enumerate(ctx.hosts)],
        "real_commands": [{"where": c.where, "argv": list(c.argv), "env": dict(c.env)}
                          for c in launcher.real_commands(ctx)],
    }


@pytest.mark.parametrize("case", list(GOLDEN_CASES))
def test_golden(case):
    name, kw = GOLDEN_CASES[case]
    ctx = make_ctx(python="/usr/bin/python3", **kw)
    got = json.loads(json.dumps(render_golden(name, ctx)))
    path = GOLDEN / f"{case}.json"
    if os.environ.get("ORCH_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert path.exists(), f"{path} missing; run with ORCH_UPDATE_GOLDEN=1 to create it"
    assert got == json.loads(path.read_text())


# --------------------------------------------------------------------------- probe comparison


def _load_probe():
    import importlib.util

    path = Path(__file__).with_name("probe.py")
    spec = importlib.util.spec_from_file_location("orch_tests_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_probe_outputs_reports_every_difference():
    probe = _load_probe()
    real = {0: {"orig_argv": ["py", "-u", "t.py"], "cwd": "/w",
                "env": {"A": "1", "B": "2", "ONLY_REAL": "x", "TMP": "/tmp/a"}}}
    ours = {0: {"orig_argv": ["py", "t.py"], "cwd": "/w",
                "env": {"A": "1", "B": "3", "ONLY_OURS": "y", "TMP": "/tmp/b"}}, 1: {}}
    problems = probe.compare_probe_outputs(real, ours, {"TMP": "temp dir per run"})
    assert problems == [
        "ranks differ: real [0] != ours [0, 1]",
        "rank 0: orig_argv: real ['py', '-u', 't.py'] != ours ['py', 't.py']",
        "rank 0: env B: real '2' != ours '3'",
        "rank 0: env ONLY_OURS only on our side ('y')",
        "rank 0: env ONLY_REAL only on the real side ('x')",
    ]
    assert probe.compare_probe_outputs(real, {0: real[0]}, {"X": ""}) == ["ignore 'X' has no reason"]
    assert probe.compare_probe_outputs(real, {0: dict(real[0])}) == []


@pytest.mark.integration
def test_probe_writes_report(tmp_path):
    env = {"PATH": os.defpath, "PROBE_OUT_DIR": str(tmp_path), "RANK": "3", "LANG": "C.UTF-8"}
    script = str(Path(__file__).with_name("probe.py"))
    subprocess.run([sys.executable, "-u", script, "--local_rank=0", "a b"], env=env, check=True,
                   cwd=tmp_path)
    [(rank, report)] = _load_probe().load_probe_outputs(str(tmp_path)).items()
    assert rank == 3
    assert report["orig_argv"][1:] == ["-u", script, "--local_rank=0", "a b"]
    assert report["env"]["RANK"] == "3" and report["cwd"] == str(tmp_path) and report["pg"] is None
