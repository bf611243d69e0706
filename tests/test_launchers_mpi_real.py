"""Integration: the MPI launchers against the REAL Open MPI ``mpirun`` and MPICH ``mpiexec.hydra``.

Three namespace hosts with sshd (tests/nethosts.py, ``net3``), two slots each. For every MPI
launcher the same probe job (tests/probe.py) runs twice:

* the real side: the command DeepSpeed's runner would run (``MPILauncher.real_commands``, equal to
  ``get_cmd`` but for the listed fixes: tests/test_launchers_mpi.py), typed on host 0 as a user
  would (``nsenter`` into its namespace), the MPI reaching the other hosts over ssh. Open MPI's
  ``mpirun`` runs openmpi's command; MPICH's Hydra runs mpich's and also impi's and mvapich's
  commands (Intel MPI and MVAPICH2 are not packaged by Debian; both are Hydra-based, so Hydra
  checks their command lines and placement, not their own variables). The probe then does what
  ``deepspeed.init_distributed()`` does, DeepSpeed's own ``mpi_discovery`` through mpi4py
  included, and records RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as DeepSpeed derived
  them;
* our side: ``orch run`` of a job spec for the same job on the ssh provisioner (emulated: orch's
  agents start the ranks).

Compared rank by rank: the host each rank ran on, its command line and working directory, the
tool's own variables, the exports and the five variables DeepSpeed derives; and every variable of
the tool's families (``OMPI_*``, ``PMIX_*``, ``PMI_*``, ``MPI_*``, ``MPIR_*``, ``HYDRA_*``,
``MV2_*``) the real side has is either emulated with the same value or listed in
:data:`NOT_EMULATED` with the reason.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_leftovers

from helpers_mpi import SLOTS, mpich_mpi4py_env, native_args, openmpi_mpi4py_env
from orchestrator.launchers import LaunchContext, get_launcher
from orchestrator.launchers.deepspeed import pdsh_exports

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("probe.py")
sys.path.insert(0, str(PROBE.parent))
import probe  # noqa: E402

TIMEOUT = 240
ARGS = ("--flag", "two words", "--x=1")
SPEC_ENV = {"SPEC_VAR": "from the spec"}
#: what the real tool runs each launcher's command with on this machine
TOOL = {"openmpi": "mpirun", "mpich": "mpiexec.hydra", "impi": "mpiexec.hydra", "mvapich": "mpiexec.hydra"}
#: the tools' variable families: each one the real side has is emulated or listed below
FAMILIES = ("OMPI_", "PMIX_", "PMI_", "MPI_", "MPIR_", "HYDRA_", "MV2_")
#: (prefix, reason): the tools' variables orch does not emulate
NOT_EMULATED = (
    ("OMPI_MCA_", "Open MPI's wiring to its daemons (orted URIs, session dirs, job id): there is no orted under orch"),
    ("PMIX_", "the PMIx server of Open MPI's orted (URIs, namespace, dstore paths): none under orch"),
    ("OMPI_FILE_LOCATION", "a per-process session directory of the orted"),
    ("PMI_FD", "Hydra's file descriptor to its proxy: no proxy under orch"),
)
#: MPICH's Hydra stands in for Intel MPI's and MVAPICH2's: its own variables are not theirs
STAND_IN_ONLY = ("MPIR_CVAR_",)
#: the variables DeepSpeed derives (probe.DISCOVERED) plus what the launchers set besides the tool
DERIVED = probe.DISCOVERED


def _tool_family(var: str) -> bool:
    return var.startswith(FAMILIES)


def _not_emulated(var: str) -> str | None:
    return next((why for prefix, why in NOT_EMULATED if var.startswith(prefix)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _job(name: str, mpi_hosts, tmp_path: Path):
    """The job's context, base environment and spec fields, for both sides."""
    net, bin_dir, hostfile = mpi_hosts
    work, out = tmp_path / "work", tmp_path / "probe-out"
    work.mkdir()
    port = _free_port()
    # the probe's settings reach remote ranks the way a DeepSpeed user's do: .deepspeed_env
    # (and under Open MPI, which library mpi4py loads: a libmpi.so from libmpich-dev would be loaded first)
    mpi4py = "".join(f"{k}={v}\n" for k, v in openmpi_mpi4py_env().items()) if name == "openmpi" else ""
    (work / ".deepspeed_env").write_text(f"PROBE_OUT_DIR={out}\nPROBE_DS_DISCOVERY=1\nPROBE_DS_PORT={port}\n"
                                         f"DS_ACCELERATOR=cpu\nSHARED=hello world\n{mpi4py}")
    base = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
            "LANG": "C.UTF-8", "PYTHONPATH": "/opt/site", "UCX_LOG_LEVEL": "error"}
    launcher_args: tuple[str, ...] = ()
    if name == "openmpi":
        subnet = str(net.subnet)
        # no shared memory (vader): every test "host" is this machine, one /dev/shm and one hostname, and
        # vader segfaults in MPI_Bcast between them; the user's `--mca btl` replaces DeepSpeed's `^openib`
        launcher_args = ("--allow-run-as-root", "--mca", "btl", "self,tcp", "--mca", "oob_tcp_if_include", subnet,
                         "--mca", "btl_tcp_if_include", subnet)
    else:
        launcher_args = ("-launcher", "ssh")
    if name == "mvapich":  # mpi_discovery's mpi4py must talk to MPICH's Hydra: MPICH's library
        base.update(mpich_mpi4py_env(tmp_path))
    lines = (work / ".deepspeed_env").read_text().splitlines(keepends=True)
    exports = {**pdsh_exports(base, str(work), lines, accelerator_exports=()), **SPEC_ENV}
    world = tuple((h, tuple(range(SLOTS))) for h in net.names[:3])
    import deepspeed
    ctx = LaunchContext(world=world, master_addr=net.addresses[0], master_port=port, python=sys.executable,
                        entrypoint=str(PROBE), args=ARGS, workdir=str(work), exports=exports,
                        hostfile=str(hostfile), hostfile_is_pool=True, launcher_args=launcher_args,
                        accelerator="cpu", deepspeed_dir=os.path.dirname(os.path.realpath(deepspeed.__file__)))
    p = net.client_params()
    spec = {"name": f"mpi-{name}", "hostfile": str(hostfile), "launcher": name, "provisioner": "ssh",
            "master_addr": net.addresses[0], "master_port": port, "env": dict(SPEC_ENV), "workdir": str(work),
            "entrypoint": str(PROBE), "args": list(ARGS), "launcher_args": list(launcher_args),
            "ssh": {"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]},
            "stop_grace_seconds": 5}
    return ctx, base, out, spec


def _run_real(name: str, net, ctx: LaunchContext, base: dict[str, str], out: Path) -> dict[int, dict]:
    [cmd] = get_launcher(name).real_commands(ctx)
    argv = [TOOL[name], *cmd.argv[1:]]
    r = subprocess.run([*net.enter_argv(0), *argv], env={**base, **cmd.env},
                       cwd=ctx.workdir, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"real {argv[0]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    reports = probe.load_probe_outputs(str(out))
    assert sorted(reports) == list(range(ctx.world_size)), (sorted(reports), r.stderr[-3000:])
    for f in out.iterdir():
        f.unlink()
    return reports


def _run_orch(orch, write_spec, spec: dict, base: dict[str, str], out: Path, world: int) -> dict[int, dict]:
    r = orch("run", str(write_spec(**spec)), "--output", "json", env=base, replace_env=False, timeout=TIMEOUT)
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert_no_leftovers(detail["id"])
    reports = probe.load_probe_outputs(str(out))
    assert sorted(reports) == list(range(world))
    return reports


def _seen(report: dict) -> dict[str, str]:
    """The rank's variables with what DeepSpeed derived laid over them."""
    return {**report["env"], **{k: v for k, v in (report.get("derived") or {}).items() if v is not None}}


@pytest.mark.parametrize("name", ["openmpi", "mpich", "impi", "mvapich"])
def test_emulation_matches_the_real_tool(name, mpi_hosts, tmp_path, orch, write_spec):
    net = mpi_hosts[0]
    ctx, base, out, spec = _job(name, mpi_hosts, tmp_path)
    real = _run_real(name, net, ctx, base, out)
    ours = _run_orch(orch, write_spec, spec, base, out, ctx.world_size)
    launcher = get_launcher(name)
    planned = {r.global_rank: r for n in range(len(ctx.world)) for r in launcher.ranks(ctx, n)}
    hosts = {net.host(i).ns: i for i in range(len(net.names))}
    ns_of = {f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]": i for ns, i in hosts.items()}
    problems = []
    for rank in range(ctx.world_size):
        r, o = real[rank], ours[rank]
        rs, os_ = _seen(r), _seen(o)
        if ns_of.get(r["netns"]) != ns_of.get(o["netns"]) or ns_of.get(r["netns"]) != rank // SLOTS:
            problems.append(f"rank {rank}: ran on host {ns_of.get(r['netns'])} (real) / {ns_of.get(o['netns'])} (ours)")
        for key in ("argv", "cwd"):
            if r[key] != o[key]:
                problems.append(f"rank {rank}: {key}: real {r[key]!r} != ours {o[key]!r}")
        # what orch plans for this rank (the tool's variables, exports, DeepSpeed's) is what the real one saw
        for var in sorted(set(planned[rank].env) | set(DERIVED)):
            if name in ("impi", "mvapich") and _tool_family(var) and var not in r["env"]:
                continue  # Intel MPI's / MVAPICH2's own variables: MPICH's Hydra does not set them
            if name == "mvapich" and var.startswith("MV2_COMM_WORLD_"):
                continue
            if rs.get(var) != os_.get(var):
                problems.append(f"rank {rank}: {var}: real {rs.get(var)!r} != ours {os_.get(var)!r}")
        for var in sorted(v for v in r["env"] if _tool_family(v) and v not in planned[rank].env):
            if var in o["env"]:
                if r["env"][var] != o["env"][var]:
                    problems.append(f"rank {rank}: {var}: real {r['env'][var]!r} != ours {o['env'][var]!r}")
            elif name in ("impi", "mvapich") and var.startswith(STAND_IN_ONLY):
                continue
            elif not _not_emulated(var):
                problems.append(f"rank {rank}: the real tool sets {var}={r['env'][var]!r}, orch neither "
                                "emulates it nor says why")
    assert not problems, "\n".join([f"{name}: real tool vs orch's emulation differ:"] + problems)


# --------------------------------------------------------------------------- native


@pytest.mark.parametrize("name", ["openmpi", "mpich"])
def test_native_ranks_see_the_real_tool_and_the_plan(name, mpi_hosts, tmp_path, orch, write_spec):
    """launch_mode native: the real tool starts every rank where orch planned it, and each rank has
    what emulation gives it plus the tool's own live variables."""
    net = mpi_hosts[0]
    ctx, base, out, spec = _job(name, mpi_hosts, tmp_path)
    spec.update(launch_mode="native", launcher_args=native_args(name, mpi_hosts), native_start_timeout=60)
    ours = _run_orch(orch, write_spec, spec, base, out, ctx.world_size)
    ns_of = {f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]": i for i, ns in enumerate(net.namespaces)}
    launcher = get_launcher(name)
    planned = {r.global_rank: r for n in range(len(ctx.world)) for r in launcher.ranks(ctx, n)}
    for rank, report in ours.items():
        assert ns_of[report["netns"]] == rank // SLOTS
        assert report["argv"] == [str(PROBE), *ARGS]
        env = report["env"]
        for var, value in planned[rank].env.items():
            assert env.get(var) == value, (rank, var, env.get(var), value)
        assert env["ORCH_NODE_RANK"] == str(rank // SLOTS)
        live = [v for v in env if v.startswith(("PMIX_", "OMPI_MCA_", "PMI_FD"))]
        assert live, f"rank {rank} has none of the real tool's live variables"
