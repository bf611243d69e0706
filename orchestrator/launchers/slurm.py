"""DeepSpeed's ``slurm`` launcher: ``srun`` from the controller, as pure functions.

Read from DeepSpeed 0.19.8 (``launcher/multinode_runner.py`` ``SlurmRunner``; ``runner.py``) and
checked against Slurm 22.05's ``srun`` on namespace hosts (tests/test_launchers_slurm_real.py).
DeepSpeed's runner, for a pool of ``N`` hosts with ``P`` slots each (it refuses anything else)::

    srun -n W <launcher_args> [--comment C] [--nodelist h1,h2 --nodes N   (with a filter)]
         [--nodes num_nodes] [--gpus-per-node num_gpus] --export=ALL,K=V,... python -u script args

What each task sees (``r`` its global rank, ``l`` local, ``n`` its node's index, srun's block
distribution filling each node in order)::

    SLURM_PROCID=r SLURM_LOCALID=l SLURM_NODEID=n SLURM_NTASKS=W SLURM_NPROCS=W SLURM_NNODES=N
    SLURM_STEP_NUM_TASKS=W SLURM_STEP_NUM_NODES=N SLURM_STEP_NODELIST=<hostlist>
    SLURM_STEP_TASKS_PER_NODE=P(xN) SLURM_TASKS_PER_NODE=P(xN) SLURM_GTIDS=<the node's ranks>
    SLURMD_NODENAME=<host> SLURM_TOPOLOGY_ADDR=<host> SLURM_TOPOLOGY_ADDR_PATTERN=node
    SLURM_NTASKS_PER_NODE=P   (orch's --ntasks-per-node)
    + what DeepSpeed's mpi_discovery derives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
      MASTER_PORT: see :mod:`.mpi`), which orch sets at start

plus the exports. Not emulated (they name a live job, step or daemon): ``SLURM_JOB_*`` and
``SLURM_JOBID``, ``SLURM_NODELIST`` (the allocation's), ``SLURM_STEP_ID``/``SLURM_STEPID``,
``SLURM_SRUN_COMM_*``, ``SLURM_STEP_LAUNCHER_PORT``, ``SLURM_LAUNCH_NODE_IPADDR``,
``SLURM_TASK_PID``, ``SLURM_CPUS_ON_NODE``, ``SLURM_WORKING_CLUSTER``, ``SLURM_PRIO_PROCESS``,
``SLURM_UMASK``, ``SLURM_SUBMIT_*``, ``SLURM_CLUSTER_NAME``; inside an allocation the agents'
environment has the allocation's own.

Deliberate differences from DeepSpeed's SlurmRunner (docs/launchers.md):

* the hosts are always named (``--nodelist`` of the pool, ``--nodes N``, ``--ntasks-per-node P``):
  srun otherwise picks nodes of the allocation itself, which need not be the hostfile's;
* exports go through srun's own environment (``--export=ALL``), not ``--export=ALL,K=V``, where
  a comma in a value splits it and add_export's quotes stay literal;
* ``module``/``no_python`` are honoured (DeepSpeed always runs ``python -u <script>``);
* slots that are not ``0..P-1`` on a host: refused, as DeepSpeed refuses them (srun places tasks by
  count and cannot pin them), and unequal slot counts too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import LaunchError
from .base import SHIM_TOKEN, LaunchContext, RankLaunch, RealCommand, check_context, discovered_env, script_argv
from .deepspeed import PDSH

__all__ = ["SlurmLauncher", "SLURM", "compress_hostlist", "tasks_per_node", "parse_tasks_per_node"]

_SUFFIX = re.compile(r"^(.*?)(\d+)$")


def compress_hostlist(hosts: Sequence[str]) -> str:
    """Slurm's hostlist of ``hosts``, in their order (same as ``scontrol show hostlist``).

    Runs of consecutive hosts with the same prefix and a numeric suffix share one bracket; in it,
    numbers that follow each other with an equivalent width (Slurm's rule: zero padding must agree)
    make a range: ``n1,n2,n3,n5`` -> ``n[1-3,5]``, ``n9,n10`` -> ``n[9-10]``, ``n01,n02,n3`` ->
    ``n[01-02,3]``, ``w2,w1`` -> ``w[2,1]``; other names stay as they are.
    """
    out: list[str] = []
    i = 0
    while i < len(hosts):
        m = _SUFFIX.match(hosts[i])
        if not m:
            out.append(hosts[i])
            i += 1
            continue
        prefix, nums = m.group(1), [m.group(2)]
        j = i + 1
        while j < len(hosts) and (mj := _SUFFIX.match(hosts[j])) and mj.group(1) == prefix:
            nums.append(mj.group(2))
            j += 1
        if len(nums) == 1:
            out.append(hosts[i])
        else:
            out.append(f"{prefix}[{_ranges(nums)}]")
        i = j
    return ",".join(out)


def _same_width(a: str, b: str) -> bool:
    """Slurm's ``_width_equiv`` (hostlist.c): 9 and 10 may share a range, 02 and 3 may not."""
    if len(a) == len(b):
        return True

    def pad(num: str, width: int) -> int:
        return max(0, width - len(str(int(num))))
    return not (pad(a, len(a)) != pad(a, len(b)) and pad(b, len(b)) != pad(b, len(a)))


def _ranges(nums: list[str]) -> str:
    parts, start, prev = [], nums[0], nums[0]
    for n in nums[1:] + [None]:
        if n is not None and _same_width(prev, n) and int(n) == int(prev) + 1:
            prev = n
            continue
        parts.append(start if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


def tasks_per_node(counts: Sequence[int]) -> str:
    """Slurm's ``SLURM_TASKS_PER_NODE`` form: ``[2, 2, 3]`` -> ``2(x2),3``."""
    out, i = [], 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        out.append(f"{counts[i]}(x{j - i + 1})" if j > i else str(counts[i]))
        i = j + 1
    return ",".join(out)


def parse_tasks_per_node(text: str) -> list[int]:
    """The counts of a ``SLURM_TASKS_PER_NODE`` / ``SLURM_JOB_CPUS_PER_NODE`` value (``2(x3),1``).

    Raises:
        ValueError: not that form.
    """
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"{text!r} is not Slurm's tasks-per-node form, e.g. '2(x3),1'")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slots_problem(ctx: LaunchContext) -> str | None:
    """What srun cannot place in the pool (SlurmRunner.validate_active_resources, also for one node), or None."""
    for host, slots in ctx.world:
        if tuple(slots) != tuple(range(len(slots))):
            return (f"slurm: the include/exclude filter or num_gpus leaves slots {list(slots)} on {host}, "
                    "but srun cannot select devices (it places tasks by count; same as DeepSpeed's "
                    "SlurmRunner); filter whole hosts, or keep the first N slots on every host")
    counts = {host: len(slots) for host, slots in ctx.world}
    if len(set(counts.values())) > 1:
        return (f"slurm: srun needs the same slot count on every host (same as DeepSpeed's "
                f"SlurmRunner), got {counts}; use num_gpus or a filter that keeps as many on each")
    return None


@dataclass(frozen=True)
class SlurmLauncher:
    """DeepSpeed's ``slurm`` launcher (module docstring)."""

    name: str = "slurm"

    def _multi(self, ctx: LaunchContext) -> bool:
        return ctx.multi_node

    def _check(self, ctx: LaunchContext) -> None:
        check_context(self.name, ctx, "DeepSpeed's runner", "slurm" if self._multi(ctx) else None)
        exports = [a for a in ctx.launcher_args if a.startswith("--expo")]  # --export, and its abbreviations
        if exports and self._multi(ctx):
            raise LaunchError(f"launcher_args {' '.join(exports)}: orch passes the ranks' variables through srun's "
                              "own environment (--export=ALL); put them in the spec's env instead")
        problem = ctx.once("slurm_slots", lambda: _slots_problem(ctx))  # once per pool, not once per node
        if problem:
            raise LaunchError(problem)

    def ranks(self, ctx: LaunchContext, node_rank: int) -> list[RankLaunch]:
        """Node ``node_rank``'s tasks with srun's variables and DeepSpeed's derived ones (module
        docstring); one node: ``deepspeed.launcher.launch``'s ranks (runner.py's local path).

        Raises:
            LaunchError: out of range, a bad pool, slots srun cannot express, placing launcher_args.
        """
        self._check(ctx)
        if not self._multi(ctx):
            return PDSH.ranks(ctx, node_rank)
        if not 0 <= node_rank < len(ctx.world):
            raise LaunchError(f"slurm: node rank {node_rank} is not in 0..{len(ctx.world) - 1}")
        host, slots = ctx.world[node_rank]
        per_node, nodes, size = len(slots), len(ctx.world), ctx.world_size
        base = node_rank * per_node
        tpn = ctx.once("slurm_tasks_per_node", lambda: tasks_per_node([len(s) for _, s in ctx.world]))
        nodelist = ctx.once("slurm_nodelist", lambda: compress_hostlist(ctx.hosts))
        common = {**ctx.exports, "SLURM_NODEID": str(node_rank), "SLURM_NTASKS": str(size), "SLURM_NPROCS": str(size),
                  "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(size), "SLURM_STEP_NUM_NODES": str(nodes),
                  "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tpn,
                  "SLURM_TASKS_PER_NODE": tpn, "SLURM_GTIDS": ",".join(str(base + i) for i in range(per_node)),
                  "SLURMD_NODENAME": host, "SLURM_TOPOLOGY_ADDR": host, "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
                  "SLURM_NTASKS_PER_NODE": str(per_node)}
        script = ctx.once("script_argv", lambda: tuple(script_argv(ctx)))
        out = []
        for local in range(per_node):
            rank = base + local
            env = {**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
                   **discovered_env(ctx, rank, local)}
            out.append(RankLaunch(global_rank=rank, local_rank=local, slot=slots[local], argv=script, env=env))
        return out

    def env_defaults(self, ctx: LaunchContext, node_rank: int) -> dict[str, str]:
        """One node: launch.py's (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` where lacking); else nothing."""
        return {} if self._multi(ctx) else PDSH.env_defaults(ctx, node_rank)

    def agent_store(self, ctx: LaunchContext, node_rank: int) -> tuple[str, int] | None:
        """None: rank 0 creates the c10d store."""
        return None

    def _srun(self, ctx: LaunchContext, program: list[str]) -> list[str]:
        per_node = len(ctx.world[0][1])
        cmd = ["srun", "-n", str(ctx.world_size), *ctx.launcher_args,
               "--nodelist", ",".join(ctx.hosts), "--nodes", str(len(ctx.world)), "--ntasks-per-node", str(per_node)]
        return cmd + ["--export=ALL"] + program

    def real_commands(self, ctx: LaunchContext) -> list[RealCommand]:
        """The ``srun`` command DeepSpeed's runner would run (with the fixes of the module
        docstring), on the controller; the exports in its environment. One node: launch.py."""
        self._check(ctx)
        if not self._multi(ctx):
            return PDSH.real_commands(ctx)
        return [RealCommand(where=None, argv=tuple(self._srun(ctx, script_argv(ctx))), env=dict(ctx.exports))]

    def native_command(self, ctx: LaunchContext, log_dir: str) -> tuple[tuple[str, ...], RealCommand]:
        """``launch_mode: native``: ``srun`` as in :meth:`real_commands`, every task running orch's
        per-rank program first (``python -u {SHIM_TOKEN} --dir <log_dir> --flavour slurm --``).

        Raises:
            LaunchError: one node, or as :meth:`ranks`.
        """
        self._check(ctx)
        if not self._multi(ctx):
            raise LaunchError("launch_mode native: with one node DeepSpeed's runner does not use srun (it runs "
                              "deepspeed.launcher.launch); use launch_mode: emulated")
        shim = [ctx.python, "-u", SHIM_TOKEN, "--dir", log_dir, "--flavour", "slurm", "--"]
        return ("srun",), RealCommand(where=ctx.hosts[0], argv=tuple(self._srun(ctx, shim + script_argv(ctx))),
                                      env=dict(ctx.exports))

    def warnings(self, ctx: LaunchContext) -> list[str]:
        """Where DeepSpeed's SlurmRunner would have done differently."""
        if not self._multi(ctx):
            return ["one node: DeepSpeed's runner does not use slurm for a single node (runner.py main() runs "
                    "deepspeed.launcher.launch locally); orch does the same"]
        out = []
        if not (ctx.include or ctx.exclude):
            out.append("DeepSpeed's SlurmRunner names no hosts without a filter (srun then picks nodes of the "
                       "allocation itself); orch names the pool's (--nodelist, --nodes, --ntasks-per-node)")
        if ctx.module or ctx.no_python:
            out.append("DeepSpeed's SlurmRunner ignores module/no_python (it always runs python -u <script>); orch "
                       "honours them")
        for key, value in ctx.exports.items():
            if "," in value:
                out.append(f"exported {key}={value!r} has a comma, which splits it in DeepSpeed's --export=ALL,K=V; "
                           "orch passes it exactly, through srun's environment")
        return out


#: ``--launcher slurm``: srun.
SLURM = SlurmLauncher()
