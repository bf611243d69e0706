"""Helpers for the real MPI and Slurm tools (tests/test_launchers_mpi_real.py, test_launchers_slurm_real.py,
test_native_mpi.py); their fixtures ``mpi_net``, ``mpi_hosts``, ``slurm_cluster`` are in conftest.py.

The hosts have their own hostnames (``own_hostnames``): DeepSpeed's mpi_discovery and MPICH's Hydra
tell nodes apart by hostname, which namespace hosts otherwise all share. The tools reach the other
hosts with OpenSSH through a wrapper that uses the test hosts' client config
(``<bin dir>/ssh``): on PATH for a command typed on host 0, or named by :func:`native_args` for
orch's native mode (whose agents run with sshd's default PATH).
"""

from __future__ import annotations

#: slots per host in the hostfile of ``mpi_hosts``
SLOTS = 2


def native_args(name: str, mpi_hosts) -> list[str]:
    """launcher_args that make the real tool work between this machine's namespace hosts."""
    net, bin_dir, _ = mpi_hosts
    ssh = str(bin_dir / "ssh")
    if name == "openmpi":
        subnet = str(net.subnet)
        return ["--allow-run-as-root", "--mca", "btl", "self,tcp", "--mca", "oob_tcp_if_include", subnet,
                "--mca", "btl_tcp_if_include", subnet, "--mca", "plm_rsh_agent", ssh]
    return ["-launcher", "ssh", "-launcher-exec", ssh]


def openmpi_mpi4py_env() -> dict[str, str]:
    """What mpi4py needs to use Open MPI's library (libmpi.so.40) under Open MPI's mpirun: without it, mpi4py
    loads whatever ``libmpi.so`` is first, which is MPICH's where Debian's libmpich-dev is installed."""
    return {"MPI4PY_MPIABI": "openmpi"}


def mpich_mpi4py_env(tmp_path) -> dict[str, str]:
    """What mpi4py needs to use MPICH's library (and so Hydra's or srun's PMI) instead of Open MPI's:
    Debian names it libmpich.so.12, mpi4py's MPICH build loads libmpi.so.12."""
    from pathlib import Path
    libdir = tmp_path / "mpich-lib"
    libdir.mkdir(exist_ok=True)
    link = libdir / "libmpi.so.12"
    if not link.exists():
        link.symlink_to(next(Path("/usr/lib").glob("*/libmpich.so.12")))
    return {"MPI4PY_MPIABI": "mpich", "LD_LIBRARY_PATH": str(libdir)}
