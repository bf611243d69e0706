"""Pure tests of the MPI launchers (openmpi, mpich, impi, mvapich) with DeepSpeed's runner as the oracle.

``deepspeed.launcher.runner.main()`` runs in-process with ``subprocess.Popen`` captured and the
runner classes' ``backend_exists`` patched (no MPI is started): the command it would run and its
environment are compared with ``MPILauncher.real_commands`` for the same hostfile, environment,
``.deepspeed_env`` files and arguments. Where orch deliberately differs (docs/launchers.md), the
test shows DeepSpeed's output, ours, and that the difference is exactly the fix.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (no CUDA here)

from test_launchers import _capture_popen  # noqa: E402

from orchestrator.errors import LaunchError  # noqa: E402
from orchestrator.launchers import LAUNCHERS, LaunchContext, get_launcher  # noqa: E402
from orchestrator.launchers.deepspeed import PDSH, pdsh_exports  # noqa: E402
from orchestrator.launchers.mpi import IMPI, MPICH, MVAPICH, OPENMPI  # noqa: E402

MPI_LAUNCHERS = {"openmpi": OPENMPI, "mpich": MPICH, "impi": IMPI, "mvapich": MVAPICH}


@pytest.fixture(scope="module")
def ds():
    runner = pytest.importorskip("deepspeed.launcher.runner")
    multinode = pytest.importorskip("deepspeed.launcher.multinode_runner")
    return types.SimpleNamespace(runner=runner, multinode=multinode)


def deepspeed_dir() -> str:
    import deepspeed
    return os.path.dirname(os.path.realpath(deepspeed.__file__))


class Job:
    """One job as both sides see it: a hostfile and workdir under tmp_path, the runner's env."""

    def __init__(self, tmp_path: Path, monkeypatch, hostfile: str, env: dict[str, str] | None = None,
                 deepspeed_env: str = ""):
        self.home, self.work = tmp_path / "home", tmp_path / "work"
        self.home.mkdir(), self.work.mkdir()
        self.hostfile = tmp_path / "hostfile"
        self.hostfile.write_text(hostfile)
        if deepspeed_env:
            (self.work / ".deepspeed_env").write_text(deepspeed_env)
        self.monkeypatch = monkeypatch
        monkeypatch.chdir(self.work)
        for key in [k for k in os.environ if k.startswith(("PYTHON", "MLFLOW", "MV2", "UCX"))]:
            monkeypatch.delenv(key)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)

    def deepspeed(self, ds, launcher: str, *flags: str, script: str = "train.py", args=("--lr", "0.1")):
        """runner.main()'s one Popen: (argv, env)."""
        self.monkeypatch.setattr(ds.runner, "DEEPSPEED_ENVIRONMENT_PATHS", [str(self.home), "."])
        self.monkeypatch.setattr(ds.multinode, "MVAPICH_TMP_HOSTFILE", str(self.work / "mvapich_hosts"))
        for cls in ("OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner", "SlurmRunner"):
            self.monkeypatch.setattr(getattr(ds.multinode, cls), "backend_exists", lambda self: True)
        calls = _capture_popen(self.monkeypatch, ds.runner)
        ds.runner.main(["--hostfile", str(self.hostfile), "--launcher", launcher, "--no_ssh_check",
                        "--master_addr", "10.1.2.3", "--master_port", "29511", *flags, script, *args])
        [(cmd, env)] = calls
        return cmd, env

    def ctx(self, world, launcher_args=(), script="train.py", args=("--lr", "0.1"), **kw) -> LaunchContext:
        lines = []
        for path in (self.home / ".deepspeed_env", self.work / ".deepspeed_env"):
            if path.is_file():
                lines += path.read_text().splitlines(keepends=True)
        exports = pdsh_exports(dict(os.environ), str(self.work), lines, accelerator_exports=())
        base = dict(world=world, master_addr="10.1.2.3", master_port=29511, python=sys.executable,
                    entrypoint=script, args=tuple(args), workdir=str(self.work), exports=exports,
                    hostfile=str(self.hostfile), launcher_args=tuple(launcher_args), accelerator="cpu",
                    deepspeed_dir=deepspeed_dir(), hostfile_is_pool=True)
        base.update(kw)
        return LaunchContext(**base)


EVEN = (("n0", (0, 1)), ("n1", (0, 1)))
EVEN_HOSTFILE = "n0 slots=2\nn1 slots=2\n"
RUNNER_ENV = {"PYTHONPATH": "/opt/site", "PYTHONHASHSEED": "0", "MLFLOW_RUN": "r1", "UCX_NET_DEVICES": "eth1"}


# --------------------------------------------------------------------------- registry


def test_mpi_launchers_are_supported():
    for name in [*MPI_LAUNCHERS, "slurm"]:
        assert get_launcher(name.upper()) is LAUNCHERS[name]


# --------------------------------------------------------------------------- runner.main oracle


@pytest.mark.parametrize("name", list(MPI_LAUNCHERS))
@pytest.mark.parametrize("flags", [[], ["--module"]])
def test_command_matches_runner_main(ds, tmp_path, monkeypatch, name, flags):
    """Same hostfile, environment and .deepspeed_env: our command is DeepSpeed's, but for the fixes."""
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE, RUNNER_ENV, deepspeed_env="DS_ONE=1\nDS_TWO=x,y\n")
    script = "pkg.train" if flags else "train.py"
    cmd, env = job.deepspeed(ds, name, *flags, script=script)
    ctx = job.ctx(EVEN, script=script, module=bool(flags))
    [ours] = MPI_LAUNCHERS[name].real_commands(ctx)
    assert ours.where is None
    expected = list(cmd)
    if name == "mvapich":  # fix: -hosts instead of the shared temp hostfile
        i = expected.index("--hostfile")
        assert Path(expected[i + 1]).read_text() == "n0\nn1\n"
        expected[i:i + 2] = []
        expected[expected.index("-ppn") + 2:expected.index("-ppn") + 2] = ["-hosts", "n0,n1"]
    if name == "mpich" and flags:  # fix: DeepSpeed puts -m before the helper's path
        assert expected[expected.index(sys.executable) + 2] == "-m"
        del expected[expected.index(sys.executable) + 2]
        helper = expected.index(sys.executable) + 2
        assert expected[helper].endswith("launcher_helper.py") and expected[helper + 3] == "--module"
    assert list(ours.argv) == expected
    assert env == {**os.environ, **ours.env}


def test_openmpi_exports_own_first_and_environment_wins(ds, tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE, {"UCX_TLS": "rc,sm", "PYTHONX": "1"})
    cmd, _ = job.deepspeed(ds, "openmpi")
    [ours] = OPENMPI.real_commands(job.ctx(EVEN))
    assert list(ours.argv) == cmd
    xs = [ours.argv[i + 1] for i, a in enumerate(ours.argv) if a == "-x"]
    assert xs[0] == "UCX_TLS=rc,sm"  # the runner's position, the environment's value


@pytest.mark.parametrize("name", list(MPI_LAUNCHERS))
def test_exports_reach_ranks_without_literal_quotes(ds, tmp_path, monkeypatch, name):
    """Fix: add_export wraps 'hello world' in double quotes that no shell strips (-x K="hello world")."""
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE, deepspeed_env="MSG=hello world\n")
    cmd, _ = job.deepspeed(ds, name)
    ctx = job.ctx(EVEN)
    [ours] = MPI_LAUNCHERS[name].real_commands(ctx)
    theirs = [a.replace('"hello world"', "hello world") for a in cmd]
    if name == "mvapich":
        i = theirs.index("--hostfile")
        theirs[i:i + 2] = []
        theirs[theirs.index("-ppn") + 2:theirs.index("-ppn") + 2] = ["-hosts", "n0,n1"]
    assert '"hello world"' in " ".join(cmd) and '"hello world"' not in " ".join(ours.argv)
    assert list(ours.argv) == theirs
    assert any("MSG='hello world'" in w and "orch passes it exactly" in w
               for w in MPI_LAUNCHERS[name].warnings(ctx))
    for rank in MPI_LAUNCHERS[name].ranks(ctx, 1):
        assert rank.env["MSG"] == "hello world"


def test_openmpi_launcher_args_override_defaults(ds, tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE)
    user = "--mca btl_tcp_if_include lo --bind-to none"
    cmd, _ = job.deepspeed(ds, "openmpi", "--launcher_args", user)
    [ours] = OPENMPI.real_commands(job.ctx(EVEN, launcher_args=user.split()))
    assert list(ours.argv) == cmd and "eth0" not in ours.argv  # DeepSpeed already drops eth0 here
    # fix: DeepSpeed keeps its own `--mca btl ^openib` beside the user's `--mca btl ...`
    cmd, _ = job.deepspeed(ds, "openmpi", "--launcher_args", "--mca btl self,tcp")
    assert cmd.count("btl") == 2
    [ours] = OPENMPI.real_commands(job.ctx(EVEN, launcher_args=("--mca", "btl", "self,tcp")))
    assert list(ours.argv).count("btl") == 1 and "^openib" not in ours.argv
    i = cmd.index("^openib")
    assert cmd[:i - 2] + cmd[i + 1:] == list(ours.argv)  # DeepSpeed's, less its duplicate


@pytest.mark.parametrize("name,args", [("openmpi", ("-np", "8")), ("openmpi", ("--host", "x")),
                                       ("openmpi", ("--map-by", "ppr:1:node")), ("openmpi", ("--rankfile", "r")),
                                       ("mpich", ("-ppn", "4")), ("mpich", ("--ppn", "1")), ("impi", ("-hosts", "a,b")),
                                       ("impi", ("-rr",)), ("mpich", ("-configfile", "c")), ("mvapich", ("-n", "2")),
                                       ("mvapich", ("--np", "4"))])
def test_launcher_args_that_place_ranks_are_refused(tmp_path, monkeypatch, name, args):
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE)
    with pytest.raises(LaunchError, match="place ranks"):
        MPI_LAUNCHERS[name].real_commands(job.ctx(EVEN, launcher_args=args))


@pytest.mark.parametrize("name", ["mpich", "impi", "mvapich"])
def test_unequal_slots_refused_as_deepspeed_does(ds, tmp_path, monkeypatch, name):
    job = Job(tmp_path, monkeypatch, "n0 slots=2\nn1 slots=3\n")
    with pytest.raises(ValueError, match="same number of devices per node"):
        job.deepspeed(ds, name)
    world = (("n0", (0, 1)), ("n1", (0, 1, 2)))
    with pytest.raises(LaunchError, match=r"same number of ranks.*n0: 2, n1: 3"):
        MPI_LAUNCHERS[name].ranks(job.ctx(world), 0)


def test_openmpi_uneven_slots_match_runner_main(ds, tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, "n0 slots=2\nn1 slots=3\n")
    cmd, _ = job.deepspeed(ds, "openmpi")
    world = (("n0", (0, 1)), ("n1", (0, 1, 2)))
    [ours] = OPENMPI.real_commands(job.ctx(world))
    assert list(ours.argv) == cmd
    assert [r.global_rank for r in OPENMPI.ranks(job.ctx(world), 1)] == [2, 3, 4]


@pytest.mark.parametrize("name", list(MPI_LAUNCHERS))
def test_filters_run_the_filtered_pool(ds, tmp_path, monkeypatch, name):
    """Fix: every MPI runner refuses include/exclude; orch builds the command from the filtered pool."""
    job = Job(tmp_path, monkeypatch, "n0 slots=2\nn1 slots=2\nn2 slots=2\n")
    with pytest.raises(ValueError, match="does not support worker include/exclusion"):
        job.deepspeed(ds, name, "--exclude", "n1")
    world = (("n0", (0, 1)), ("n2", (0, 1)))
    ctx = job.ctx(world, exclude="n1", hostfile_is_pool=False)
    [ours] = MPI_LAUNCHERS[name].real_commands(ctx)
    text = " ".join(ours.argv)
    assert "n1" not in text.replace(sys.executable, "")
    if name == "openmpi":
        assert ours.argv[:5] == ("mpirun", "-n", "4", "--host", "n0:2,n2:2")
    else:
        assert "-hosts n0,n2" in text and "-ppn 2" in text
    assert any("refuses exclude" in w for w in MPI_LAUNCHERS[name].warnings(ctx))
    ranks = [r for n in range(2) for r in MPI_LAUNCHERS[name].ranks(ctx, n)]
    assert [r.env["RANK"] for r in ranks] == ["0", "1", "2", "3"]


def test_launcher_args_that_set_variables_reach_emulated_ranks():
    ctx = LaunchContext(world=EVEN, master_addr="10.0.0.1", master_port=29600, python="/py", entrypoint="t.py",
                        exports={"K": "v"}, launcher_args=("-x", "FOO=bar", "-x", "NCCL_DEBUG=INFO", "-x", "ONLY_NAME"))
    r = OPENMPI.ranks(ctx, 1)[0]
    assert (r.env["FOO"], r.env["NCCL_DEBUG"], r.env["K"]) == ("bar", "INFO", "v") and "ONLY_NAME" not in r.env
    assert any("-x ONLY_NAME forwards ONLY_NAME from mpirun's own environment" in w for w in OPENMPI.warnings(ctx))
    hydra = LaunchContext(**{**ctx.__dict__, "launcher_args": ("-genv", "FOO", "bar", "--env", "BAZ=1", "-genvnone")})
    for launcher in (MPICH, IMPI, MVAPICH):
        m = launcher.ranks(hydra, 0)[1]
        assert (m.env["FOO"], m.env["BAZ"]) == ("bar", "1")
        assert any("-genvnone changes which of mpiexec's variables" in w for w in launcher.warnings(hydra))


def test_pdsh_launcher_args_that_pick_hosts_are_refused():
    ctx = LaunchContext(world=EVEN, master_addr="10.0.0.1", master_port=29600, python="/py", entrypoint="t.py",
                        launcher_args=("-w", "n9"))
    with pytest.raises(LaunchError, match="launcher_args -w: these place ranks"):
        PDSH.real_commands(ctx)


def test_slots_picked_by_a_filter_become_visible_devices(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, "n0 slots=4\nn1 slots=4\n")
    ctx = job.ctx((("n0", (1, 3)), ("n1", (0, 1))), include="n0:1,3@n1:0,1", hostfile_is_pool=False)
    r0, r1 = OPENMPI.ranks(ctx, 0)
    assert r0.env["CUDA_VISIBLE_DEVICES"] == r1.env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert (r0.slot, r1.slot) == (1, 3) and (r0.local_rank, r1.local_rank) == (0, 1)
    assert all("CUDA_VISIBLE_DEVICES" not in r.env for r in OPENMPI.ranks(ctx, 1))
    assert any("n0: slots [1, 3]" in w for w in OPENMPI.warnings(ctx))


# --------------------------------------------------------------------------- rank environments


def test_rank_environments():
    ctx = LaunchContext(world=(("a", (0, 1)), ("b", (0, 1))), master_addr="10.0.0.1", master_port=29600,
                        python="/py", entrypoint="t.py", args=("--x",), exports={"K": "v"}, accelerator="cuda")
    r = OPENMPI.ranks(ctx, 1)[1]
    assert r.argv == ("/py", "-u", "t.py", "--x")  # no --local_rank under MPI
    assert {k: r.env[k] for k in r.env if k.startswith("OMPI_")} == {
        "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4",
        "OMPI_COMMAND": "py", "OMPI_ARGV": "-u t.py --x", "OMPI_APP_CTX_NUM_PROCS": "4", "OMPI_NUM_APP_CTX": "1",
        "OMPI_FIRST_RANKS": "0"}
    derived = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert derived.items() <= r.env.items() and r.env["UCX_TLS"] == "tcp" and r.env["K"] == "v"
    assert "LOCAL_SIZE" not in r.env and "CROSS_RANK" not in r.env
    m = MPICH.ranks(ctx, 1)[1]
    assert {**derived, "LOCAL_SIZE": "2", "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2", "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "b"}.items() <= m.env.items()
    assert "UCX_TLS" not in m.env
    i = IMPI.ranks(ctx, 0)[0]
    assert {"I_MPI_PIN": "0", "RANK": "0", "LOCAL_RANK": "0", "PMI_RANK": "0"}.items() <= i.env.items()
    v = MVAPICH.ranks(ctx, 1)[0]
    assert {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_USE_CUDA": "1",
            "MV2_SMP_USE_CMA": "0", "RANK": "2"}.items() <= v.env.items()
    assert "MV2_USE_CUDA" not in MVAPICH.ranks(LaunchContext(**{**ctx.__dict__, "accelerator": "cpu"}), 0)[0].env
    assert MPICH.env_defaults(ctx, 0) == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert OPENMPI.env_defaults(ctx, 0) == {} and OPENMPI.agent_store(ctx, 0) is None


@pytest.mark.parametrize("name", list(MPI_LAUNCHERS))
def test_one_node_is_deepspeeds_local_launch(ds, tmp_path, monkeypatch, name):
    """runner.py main(): one node never reaches the MPI runner; it runs launch.py locally."""
    job = Job(tmp_path, monkeypatch, "n0 slots=2\n")
    cmd, _ = job.deepspeed(ds, name)
    ctx = job.ctx((("n0", (0, 1)),), exports={})
    [ours] = MPI_LAUNCHERS[name].real_commands(ctx)
    assert list(ours.argv) == cmd and "deepspeed.launcher.launch" in cmd
    assert MPI_LAUNCHERS[name].ranks(ctx, 0) == PDSH.ranks(ctx, 0)
    assert "one node" in MPI_LAUNCHERS[name].warnings(ctx)[0]


# --------------------------------------------------------------------------- slurm


def _split_export(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """DeepSpeed's srun command without its ``--export=ALL,K=V,...`` list, and that list."""
    [i] = [n for n, a in enumerate(argv) if a.startswith("--export=")]
    items = argv[i].split(",")[1:]
    return argv[:i] + ["--export=ALL"] + argv[i + 1:], dict(item.split("=", 1) for item in items)


@pytest.mark.parametrize("filters", [[], ["--exclude", "n1"]])
def test_slurm_command_matches_runner_main(ds, tmp_path, monkeypatch, filters):
    job = Job(tmp_path, monkeypatch, "n0 slots=2\nn1 slots=2\nn2 slots=2\n", RUNNER_ENV, deepspeed_env="DS_ONE=1\n")
    cmd, env = job.deepspeed(ds, "slurm", "--launcher_args", "--time 10 --comment=x", *filters)
    hosts = ["n0", "n2"] if filters else ["n0", "n1", "n2"]
    ctx = job.ctx(tuple((h, (0, 1)) for h in hosts), launcher_args=("--time", "10", "--comment=x"),
                  exclude="n1" if filters else "", hostfile_is_pool=not filters)
    [ours] = get_launcher("slurm").real_commands(ctx)
    theirs, exported = _split_export(cmd)
    if filters:  # DeepSpeed names the filtered hosts; orch also fixes the tasks per node
        i = theirs.index("--nodelist")
        assert theirs[i:i + 4] == ["--nodelist", "n0,n2", "--nodes", "2"]
        del theirs[i:i + 4]
    placement = ["--nodelist", ",".join(hosts), "--nodes", str(len(hosts)), "--ntasks-per-node", "2"]
    at = theirs.index("--export=ALL")
    assert list(ours.argv) == theirs[:at] + placement + theirs[at:]
    assert exported == {k: v for k, v in ours.env.items()} == ctx.exports  # through srun's environment instead
    assert env == {**os.environ, "PYTHONPATH": ctx.exports["PYTHONPATH"]}


def test_slurm_fixes_and_refusals(ds, tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, EVEN_HOSTFILE, deepspeed_env="LIST=a,b\n")
    slurm = get_launcher("slurm")
    cmd, _ = job.deepspeed(ds, "slurm", "--module", script="pkg.train")
    assert cmd[cmd.index(sys.executable) + 1:cmd.index(sys.executable) + 3] == ["-u", "pkg.train"]  # no -m
    ctx = job.ctx(EVEN, script="pkg.train", module=True)
    [ours] = slurm.real_commands(ctx)
    assert list(ours.argv[ours.argv.index(sys.executable):]) == [sys.executable, "-u", "-m", "pkg.train", "--lr", "0.1"]
    assert ours.env["LIST"] == "a,b"
    warnings = " ".join(slurm.warnings(ctx))
    assert "ignores module/no_python" in warnings and "LIST='a,b' has a comma" in warnings
    with pytest.raises(ValueError, match="cannot select specific device ids"):
        job.deepspeed(ds, "slurm", "--include", "n0:1@n1:1")
    with pytest.raises(LaunchError, match=r"filter or num_gpus leaves slots \[1\] on n0, but srun cannot select"):
        slurm.ranks(job.ctx((("n0", (1,)), ("n1", (1,)))), 0)
    (tmp_path / "b").mkdir()
    job2 = Job(tmp_path / "b", monkeypatch, "n0 slots=2\nn1 slots=3\n")
    with pytest.raises(ValueError, match="same slot count"):
        job2.deepspeed(ds, "slurm")
    with pytest.raises(LaunchError, match="same slot count"):
        slurm.ranks(job2.ctx((("n0", (0, 1)), ("n1", (0, 1, 2)))), 0)
    for args in (("--ntasks-per-node=4",), ("-N2",), ("-n8",), ("-wn9",), ("--nodel=n0",), ("--multi-prog",)):
        with pytest.raises(LaunchError, match="place ranks"):
            slurm.real_commands(job.ctx(EVEN, launcher_args=args))
    with pytest.raises(LaunchError, match="through srun's own environment"):
        slurm.real_commands(job.ctx(EVEN, launcher_args=("--export=NONE",)))


def test_slurm_rank_environment():
    ctx = LaunchContext(world=(("w1", (0, 1)), ("w2", (0, 1)), ("w3", (0, 1))), master_addr="10.0.0.1",
                        master_port=29600, python="/py", entrypoint="t.py", exports={"K": "v"})
    r = get_launcher("slurm").ranks(ctx, 1)[1]
    assert r.argv == ("/py", "-u", "t.py") and r.global_rank == 3
    assert {k: v for k, v in r.env.items() if k.startswith("SLURM")} == {
        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "6", "SLURM_NPROCS": "6",
        "SLURM_NNODES": "3", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NODELIST": "w[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_GTIDS": "2,3", "SLURMD_NODENAME": "w2", "SLURM_TOPOLOGY_ADDR": "w2",
        "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_NTASKS_PER_NODE": "2"}
    assert {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "MASTER_ADDR": "10.0.0.1", "K": "v"}.items() <= r.env.items()


def test_tasks_per_node_forms():
    from orchestrator.launchers.slurm import parse_tasks_per_node, tasks_per_node
    assert tasks_per_node([2, 2, 3]) == "2(x2),3" and tasks_per_node([4]) == "4"
    assert parse_tasks_per_node("2(x2),3") == [2, 2, 3] and parse_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="tasks-per-node form"):
        parse_tasks_per_node("2x3")
