"""Integration: the slurm launcher against a REAL Slurm 22.05 cluster (tests/slurmcluster.py).

slurmctld on the bridge, a slurmd on each of four namespace hosts (tests/helpers_mpi.py; the
hostfile names the first three, two slots each). Shown:

* ``compress_hostlist`` gives what ``scontrol show hostlist`` gives;
* the probe job (tests/probe.py) under the real ``srun`` (DeepSpeed's SlurmRunner command as
  ``SLURM.real_commands`` builds it, run from the submit host, ``--mpi=pmi2`` so that DeepSpeed's
  own mpi_discovery finds the ranks through mpi4py) and under orch's emulation (``orch run`` on the
  ssh provisioner), compared rank by rank: the host each task ran on, argv, cwd, srun's variables
  that orch emulates, the exports, and RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as
  DeepSpeed derived them; every other ``SLURM*`` variable of the real task is listed, with why it
  is not emulated, in :data:`NOT_EMULATED`;
* ``launch_mode: native``: node 0's agent runs ``srun``, which starts every task where orch planned it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_leftovers

from helpers_mpi import SLOTS, mpich_mpi4py_env
from orchestrator.launchers import LaunchContext, get_launcher
from orchestrator.launchers.deepspeed import pdsh_exports
from orchestrator.launchers.slurm import compress_hostlist

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("probe.py")
sys.path.insert(0, str(PROBE.parent))
import probe  # noqa: E402

ARGS = ("--flag", "two words", "--x=1")
TIMEOUT = 240
#: (prefix, reason): srun's variables orch does not emulate
NOT_EMULATED = (
    ("SLURM_JOB", "the job's id, name, user, partition, CPUs: a live allocation (inside one, the agents have them)"),
    ("SLURM_NODELIST", "the allocation's node list (SLURM_STEP_NODELIST is the step's, emulated)"),
    ("SLURM_STEP_ID", "the step's id in a live job"), ("SLURM_STEPID", "the step's id in a live job"),
    ("SLURM_SRUN_COMM_", "srun's own listening address and port"), ("SLURM_STEP_LAUNCHER_PORT", "srun's port"),
    ("SLURM_LAUNCH_NODE_IPADDR", "the address srun ran on"), ("SLURM_TASK_PID", "slurmstepd's pid of the task"),
    ("SLURM_CPUS_ON_NODE", "the node's CPUs as slurm.conf declares them"), ("SLURM_WORKING_CLUSTER", "slurmctld's address"),
    ("SLURM_PRIO_PROCESS", "srun's scheduling priority"), ("SLURM_UMASK", "srun's umask"),
    ("SLURM_SUBMIT_", "where srun ran"), ("SLURM_CLUSTER_NAME", "slurm.conf's ClusterName"),
    ("SLURM_CONF", "the test cluster's config path (the submit host's environment)"),
    ("SLURM_NODE_ALIASES", "slurmctld's node aliases"), ("SLURM_MPI_TYPE", "--mpi=pmi2 of this test"),
    ("SLURM_PMI2_", "the PMI2 server of --mpi=pmi2"), ("SLURM_JOBID", "the job's id"),
)


def _not_emulated(var: str) -> str | None:
    return next((why for prefix, why in NOT_EMULATED if var.startswith(prefix)), None)


def test_hostlist_is_scontrols(slurm_cluster):
    rng = random.Random(7)
    lists = [["n1", "n2", "n3", "n5"], ["n01", "n02", "n3"], ["w2", "w1"], ["x", "y", "n1"], ["a-1", "a-2"],
             ["h1x", "h2x"], ["n9", "n10", "n11"], ["a0001", "a0002", "a10"], ["b2", "a1", "b1"], ["solo"]]
    for _ in range(40):
        prefix = rng.choice(["n", "node-", "gpu0", "rack1-n"])
        nums = sorted(rng.sample(range(1, 40), rng.randint(1, 8)))
        width = rng.choice([0, 2, 3])
        lists.append([f"{prefix}{n:0{width}d}" if width else f"{prefix}{n}" for n in nums])
    for hosts in lists:
        real = slurm_cluster.run(["scontrol", "show", "hostlist", ",".join(hosts)]).stdout.strip()
        assert compress_hostlist(hosts) == real, hosts


def _job(mpi_hosts, cluster, tmp_path: Path):
    net, _, hostfile = mpi_hosts
    work, out = tmp_path / "work", tmp_path / "probe-out"
    work.mkdir()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    (work / ".deepspeed_env").write_text(f"PROBE_OUT_DIR={out}\nPROBE_DS_DISCOVERY=1\nPROBE_DS_PORT={port}\n"
                                         "DS_ACCELERATOR=cpu\nSHARED=hello world\n")
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
            "PYTHONPATH": "/opt/site", "SLURM_CONF": str(cluster.conf), **mpich_mpi4py_env(tmp_path)}
    lines = (work / ".deepspeed_env").read_text().splitlines(keepends=True)
    spec_env = {"SPEC_VAR": "from the spec"}
    exports = {**pdsh_exports(base, str(work), lines, accelerator_exports=()), **spec_env}
    world = tuple((h, tuple(range(SLOTS))) for h in net.names[:3])
    ctx = LaunchContext(world=world, master_addr=net.addresses[0], master_port=port, python=sys.executable,
                        entrypoint=str(PROBE), args=ARGS, workdir=str(work), exports=exports, hostfile=str(hostfile),
                        hostfile_is_pool=True, launcher_args=("--mpi=pmi2",), accelerator="cpu")
    p = net.client_params()
    spec = {"name": "slurm-probe", "hostfile": str(hostfile), "launcher": "slurm", "provisioner": "ssh",
            "master_addr": net.addresses[0], "master_port": port, "env": spec_env, "workdir": str(work),
            "entrypoint": str(PROBE), "args": list(ARGS), "launcher_args": ["--mpi=pmi2"],
            "ssh": {"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]},
            "stop_grace_seconds": 5}
    return ctx, base, out, spec


def _reports(out: Path, world: int) -> dict[int, dict]:
    reports = probe.load_probe_outputs(str(out))
    assert sorted(reports) == list(range(world)), sorted(reports)
    for f in out.iterdir():
        f.unlink()
    return reports


def _run_orch(orch, write_spec, spec: dict, base: dict, out: Path, world: int) -> dict[int, dict]:
    r = orch("run", str(write_spec(**spec)), "--output", "json", env=base, timeout=TIMEOUT)
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-3000:])
    assert_no_leftovers(detail["id"])
    return _reports(out, world)


def _host_of(net) -> dict[str, int]:
    return {f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]": i for i, ns in enumerate(net.namespaces)}


def test_emulation_matches_the_real_srun(mpi_hosts, slurm_cluster, tmp_path, orch, write_spec):
    net = mpi_hosts[0]
    ctx, base, out, spec = _job(mpi_hosts, slurm_cluster, tmp_path)
    [cmd] = get_launcher("slurm").real_commands(ctx)
    r = subprocess.run(list(cmd.argv), env={**base, **cmd.env}, cwd=ctx.workdir, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    real = _reports(out, ctx.world_size)
    ours = _run_orch(orch, write_spec, spec, base, out, ctx.world_size)
    planned = {x.global_rank: x for n in range(3) for x in get_launcher("slurm").ranks(ctx, n)}
    host = _host_of(net)
    problems = []
    for rank in range(ctx.world_size):
        rr, oo = real[rank], ours[rank]
        rs = {**rr["env"], **{k: v for k, v in rr["derived"].items() if v is not None}}
        os_ = {**oo["env"], **{k: v for k, v in oo["derived"].items() if v is not None}}
        if not host[rr["netns"]] == host[oo["netns"]] == rank // SLOTS:
            problems.append(f"rank {rank}: host {host[rr['netns']]} (real) / {host[oo['netns']]} (ours)")
        for key in ("argv", "cwd"):
            if rr[key] != oo[key]:
                problems.append(f"rank {rank}: {key}: real {rr[key]!r} != ours {oo[key]!r}")
        for var in sorted(set(planned[rank].env) | set(probe.DISCOVERED)):
            if rs.get(var) != os_.get(var):
                problems.append(f"rank {rank}: {var}: real {rs.get(var)!r} != ours {os_.get(var)!r}")
        for var in sorted(v for v in rr["env"] if v.startswith(("SLURM", "PMI")) and v not in planned[rank].env):
            if var not in oo["env"] and not _not_emulated(var) and not var.startswith("PMI"):
                problems.append(f"rank {rank}: srun sets {var}={rr['env'][var]!r}; orch neither emulates it nor "
                                "says why")
    assert not problems, "\n".join(["real srun vs orch's emulation differ:"] + problems)


def test_native_srun_starts_every_task_where_planned(mpi_hosts, slurm_cluster, tmp_path, orch, write_spec):
    net = mpi_hosts[0]
    ctx, base, out, spec = _job(mpi_hosts, slurm_cluster, tmp_path)
    spec.update(launch_mode="native", native_start_timeout=60,
                env={**spec["env"], "SLURM_CONF": str(slurm_cluster.conf)})  # srun's own environment on node 0
    ours = _run_orch(orch, write_spec, spec, base, out, ctx.world_size)
    planned = {x.global_rank: x for n in range(3) for x in get_launcher("slurm").ranks(ctx, n)}
    host = _host_of(net)
    for rank, report in ours.items():
        assert host[report["netns"]] == rank // SLOTS
        env = report["env"]
        for var in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_STEP_NODELIST",
                    "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "SLURMD_NODENAME", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            assert env.get(var) == planned[rank].env[var], (rank, var)
        assert env["SLURM_JOB_ID"] and env["SLURM_STEP_ID"]  # a real job step: the tool's live variables
