"""Namespace test hosts for the real MPI tools (tests/test_launchers_mpi_real.py, tests/test_native_mpi.py).

The hosts have their own hostnames (``own_hostnames``): DeepSpeed's mpi_discovery and MPICH's Hydra
tell nodes apart by hostname, which namespace hosts otherwise all share. The tools reach the other
hosts with OpenSSH through a wrapper that uses the test hosts' client config
(``<bin dir>/ssh``): on PATH for a command typed on host 0, or named by :func:`native_args` for
orch's native mode (whose agents run with sshd's default PATH).
"""

from __future__ import annotations

import pytest

#: slots per host in the hostfile of ``mpi_hosts``
SLOTS = 2


@pytest.fixture(scope="module")
def mpi_net():
    """4 namespace hosts with their own hostnames (the 4th a spare the hostfile of ``mpi_hosts`` leaves
    out): mpi_discovery's LOCAL_RANK counts earlier ranks with the same processor name (the hostname)."""
    from conftest import start_test_network
    net = start_test_network(4, own_hostnames=True)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def mpi_hosts(mpi_net, tmp_path_factory):
    """``(net, bin dir with an ssh that uses the test hosts' config, hostfile of hosts 0-2)``."""
    net3 = mpi_net
    tmp = tmp_path_factory.mktemp("mpi")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {net3.ssh_config} "$@"\n')
    ssh.chmod(0o755)
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{name} slots={SLOTS}\n" for name in net3.names[:3]))
    return net3, bin_dir, hostfile


def native_args(name: str, mpi_hosts) -> list[str]:
    """launcher_args that make the real tool work between this machine's namespace hosts."""
    net, bin_dir, _ = mpi_hosts
    ssh = str(bin_dir / "ssh")
    if name == "openmpi":
        subnet = str(net.subnet)
        return ["--allow-run-as-root", "--mca", "btl", "self,tcp", "--mca", "oob_tcp_if_include", subnet,
                "--mca", "btl_tcp_if_include", subnet, "--mca", "plm_rsh_agent", ssh]
    return ["-launcher", "ssh", "-launcher-exec", ssh]


@pytest.fixture(scope="module")
def slurm_cluster(mpi_net):
    """A real Slurm cluster (tests/slurmcluster.py) with a slurmd on every host of ``mpi_net``."""
    import slurmcluster
    try:
        cluster = slurmcluster.SlurmCluster(mpi_net).start()
    except slurmcluster.SlurmError as err:
        pytest.fail(f"cannot start the Slurm test cluster: {err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()


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
