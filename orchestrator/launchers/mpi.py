"""DeepSpeed's MPI launchers — ``openmpi``, ``mpich``, ``impi``, ``mvapich`` — as pure functions.

Read from DeepSpeed 0.19.8 (``launcher/multinode_runner.py`` ``OpenMPIRunner``, ``MPICHRunner``,
``IMPIRunner``, ``MVAPICHRunner``; ``launcher/launcher_helper.py``; ``comm/comm.py``
``init_distributed``/``mpi_discovery``) and checked against the real Open MPI 4.1 ``mpirun`` and
MPICH 4.0 ``mpiexec.hydra`` (tests/test_launchers_mpi_real.py). Intel MPI and MVAPICH are not
packaged by Debian: their rows are DeepSpeed's runner and the tools' documentation, unverified.

What a rank of node ``n`` sees (``W`` ranks in all, ``S`` on its node, local rank ``l``, global
rank ``r``; ranks are numbered node by node, slot by slot, as ``mpirun -n W`` over a hostfile
with ``slots=`` and Hydra's ``-ppn`` place them)::

    openmpi  OMPI_COMM_WORLD_SIZE=W OMPI_COMM_WORLD_RANK=r OMPI_COMM_WORLD_LOCAL_RANK=l
             OMPI_COMM_WORLD_LOCAL_SIZE=S OMPI_COMM_WORLD_NODE_RANK=l OMPI_UNIVERSE_SIZE=W
             OMPI_COMMAND=<python's file name> OMPI_ARGV=<the rest, space-joined> OMPI_APP_CTX_NUM_PROCS=W
             OMPI_NUM_APP_CTX=1 OMPI_FIRST_RANKS=0                      (the one app context)
             + what mpi_discovery derives: RANK=r WORLD_SIZE=W LOCAL_RANK=l MASTER_ADDR MASTER_PORT
    mpich    PMI_RANK=r PMI_SIZE=W MPI_LOCALRANKID=l MPI_LOCALNRANKS=S
             MPIR_CVAR_CH3_INTERFACE_HOSTNAME=<host>                     (Hydra)
             MASTER_ADDR MASTER_PORT WORLD_SIZE=W LOCAL_SIZE=S           (-genv, get_cmd)
             RANK=r LOCAL_RANK=l  (launcher_helper.py, from PMI_RANK / MPI_LOCALRANKID)
    impi     PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS           (Intel MPI's Hydra)
             MASTER_ADDR MASTER_PORT WORLD_SIZE LOCAL_SIZE I_MPI_PIN=0   (-genv)
             RANK=r LOCAL_RANK=l                                         (-env, one argument set per rank)
    mvapich  PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS           (MVAPICH2's Hydra)
             MV2_COMM_WORLD_RANK=r MV2_COMM_WORLD_SIZE=W MV2_COMM_WORLD_LOCAL_RANK=l
             MV2_COMM_WORLD_LOCAL_SIZE=S + what mpi_discovery derives (as openmpi)

plus the exports (``-x`` / ``-genv`` / ``-env``): the launcher's own (openmpi ``UCX_TLS=tcp``;
mvapich seven ``MV2_*``), then what runner.py exports on its multi-node path (the same as pdsh's,
:func:`~.deepspeed.pdsh_exports`), then the spec's ``env``. argv is ``python -u [-m] <script>
<args>`` (no ``--local_rank``: no MPI runner passes one), or ``<script> <args>`` with
``no_python``.

"What mpi_discovery derives": a script that calls ``deepspeed.init_distributed()`` (as
``deepspeed.initialize`` does) without RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK in its
environment runs ``mpi_discovery``, which needs mpi4py: RANK and WORLD_SIZE from
``MPI.COMM_WORLD``, LOCAL_RANK = earlier ranks with the same processor name, MASTER_ADDR = the
first address of rank 0's ``hostname -I``, MASTER_PORT = its ``distributed_port`` (29500). orch
sets them at start instead (with the plan's master address and port), so such a script works
without mpi4py and without an MPI library. Variables that only wire a rank to a live MPI daemon
(``OMPI_MCA_*`` URIs and session directories, ``PMIX_*``, Hydra's ``PMI_FD``) are not emulated:
they point at a process that does not exist under orch's agents.

One node: runner.py takes its local path for any launcher (``multi_node_exec`` is false): it
runs ``deepspeed.launcher.launch`` itself, as for pdsh with one node, and orch does the same (and
says so in :meth:`MPILauncher.warnings`).

Deliberate differences from DeepSpeed's runners (each also in docs/launchers.md):

* include/exclude/num_nodes/num_gpus work: the real command is built from the filtered pool
  (``-n``, ``--host host:slots`` / ``-hosts``), where every MPI runner raises "does not support
  worker include/exclusion"; with no filter Open MPI still gets ``-hostfile <hostfile>``.
* exported values reach the ranks exactly: DeepSpeed's ``add_export`` wraps a value with a space
  (or any of ``"$'`` ...) in double quotes and no shell strips them from ``-x K="a b"``.
* ``launcher_args`` override the defaults they name instead of repeating them (``--mca btl``;
  ``btl_tcp_if_include``/``btl_tcp_if_exclude`` drop the default ``btl_tcp_if_include eth0``);
  options that place ranks (``-n``, ``-np``, ``-ppn``, ``-hostfile``, ``--host``, ``-hosts``,
  ``--map-by``, ...: :mod:`.args`) are refused, since the hostfile and filters place them; those
  that set variables (``-x NAME=VALUE``, ``-genv``, ``-env``) reach emulated ranks too.
* mpich with ``module``/``no_python``: DeepSpeed puts ``-m`` before the helper's path (``python
  -m /…/launcher_helper.py`` fails) or runs the helper without an interpreter; orch runs the helper
  with ``python -u`` and passes ``--module``/``--no_python`` to it.
* mvapich: the hosts are given with ``-hosts``, not written to the shared
  ``/tmp/deepspeed_mvapich_hostfile`` that concurrent jobs overwrite.
* a node whose slots are not ``0..S-1`` (a filter picked devices): the ranks get
  ``CUDA_VISIBLE_DEVICES=<slots>``; MPI cannot pin ranks to devices, so DeepSpeed would ignore them.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from ..errors import LaunchError
from .args import env_from_args
from .base import SHIM_TOKEN, LaunchContext, RankLaunch, RealCommand, check_context, discovered_env, script_argv
from .deepspeed import PDSH, render_pdsh_export

__all__ = ["MPILauncher", "OPENMPI", "MPICH", "IMPI", "MVAPICH", "MVAPICH_EXPORTS", "NATIVE_TOOLS",
           "TORCH_DISTRIBUTED_DEFAULT_PORT"]

#: deepspeed.constants TORCH_DISTRIBUTED_DEFAULT_PORT: mpi_discovery's MASTER_PORT by default.
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
#: MVAPICHRunner.__init__'s exports, in order (``MV2_USE_CUDA`` only on CUDA).
MVAPICH_EXPORTS = (("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"), ("MV2_USE_CUDA", "1"),
                   ("MV2_SUPPORT_DL", "1"), ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"),
                   ("MV2_CUDA_USE_NAIVE", "0"))
_TOOL = {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpiexec (Hydra)",
         "impi": "Intel MPI's mpirun (Hydra)", "mvapich": "MVAPICH2's mpirun (Hydra)"}
_RUNNER = {"openmpi": "OpenMPIRunner", "mpich": "MPICHRunner", "impi": "IMPIRunner", "mvapich": "MVAPICHRunner"}
_HYDRA_MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_SIZE")
#: launch_mode native: the tool's names, in the order the agent looks for them on node 0's PATH
#: (Debian installs Open MPI's and MPICH's side by side; plain ``mpirun`` is whichever won).
NATIVE_TOOLS = {"openmpi": ("mpirun.openmpi", "mpirun"), "mpich": ("mpiexec.hydra", "mpirun.mpich", "mpiexec"),
                "impi": ("mpirun",), "mvapich": ("mpirun",)}


def _runner_env(ctx: LaunchContext) -> dict[str, str]:
    """The tool's own environment that runner.py changes: the exported PYTHONPATH (set in its env too)."""
    return {"PYTHONPATH": ctx.exports["PYTHONPATH"]} if "PYTHONPATH" in ctx.exports else {}


@dataclass(frozen=True)
class MPILauncher:
    """One of DeepSpeed's MPI launchers (``name`` is ``openmpi``, ``mpich``, ``impi`` or ``mvapich``).

    See the module docstring for each rank's variables and the differences from DeepSpeed.
    """

    name: str

    # ---------------------------------------------------------------- checks

    def _multi(self, ctx: LaunchContext) -> bool:
        """runner.py ``main()``: the launcher is used only with more than one node."""
        return ctx.multi_node

    @property
    def family(self) -> str:
        """How the tool reads its arguments (:mod:`.args`): ``openmpi`` or ``hydra``."""
        return "openmpi" if self.name == "openmpi" else "hydra"

    def _check(self, ctx: LaunchContext) -> None:
        check_context(self.name, ctx, "DeepSpeed's runner", self.family if self._multi(ctx) else None)
        if not self._multi(ctx) or self.name == "openmpi":
            return
        problem = ctx.once(("mpi_counts", self.name), lambda: self._counts_problem(ctx))  # once, not once per node
        if problem:
            raise LaunchError(problem)

    def _counts_problem(self, ctx: LaunchContext) -> str | None:
        counts = {host: len(slots) for host, slots in ctx.world}
        if len(set(counts.values())) <= 1:
            return None
        shown = ", ".join(f"{h}: {n}" for h, n in counts.items())
        return (f"{self.name}: every node must run the same number of ranks ({_RUNNER[self.name]} "
                f"raises 'requires same number of devices per node'; -ppn is one count); the pool "
                f"has {shown}. Use num_gpus, or a filter that keeps as many slots on every host.")

    # ---------------------------------------------------------------- exports

    def exports(self, ctx: LaunchContext) -> dict[str, str]:
        """What the real command exports to every rank, in its order: the runner's own (openmpi
        ``UCX_TLS=tcp``; mvapich :data:`MVAPICH_EXPORTS`), then ``ctx.exports``, whose values win
        and keep the runner's positions (``add_export`` into one dict, as runner.py does)."""
        own: dict[str, str] = {}
        if self.name == "openmpi":
            own = {"UCX_TLS": "tcp"}
        elif self.name == "mvapich":
            own = {k: v for k, v in MVAPICH_EXPORTS if k != "MV2_USE_CUDA" or ctx.accelerator == "cuda"}
        return {**own, **ctx.exports}

    # ---------------------------------------------------------------- Launcher

    def ranks(self, ctx: LaunchContext, node_rank: int) -> list[RankLaunch]:
        """Return node ``node_rank``'s ranks with the variables the tool, DeepSpeed's command and its
        discovery give them (module docstring); one node: ``deepspeed.launcher.launch``'s ranks.

        Raises:
            LaunchError: ``node_rank`` out of range, a bad pool, unequal slot counts (mpich, impi,
                mvapich), or ``launcher_args`` that place ranks.
        """
        self._check(ctx)
        if not self._multi(ctx):
            return PDSH.ranks(ctx, node_rank)
        if not 0 <= node_rank < len(ctx.world):
            raise LaunchError(f"{self.name}: node rank {node_rank} is not in 0..{len(ctx.world) - 1}")
        host, slots = ctx.world[node_rank]
        base = ctx.rank_offsets[node_rank]
        size, local_size = ctx.world_size, len(slots)
        common = {**env_from_args(ctx.launcher_args, self.family)[0], **self.exports(ctx)}
        if tuple(slots) != tuple(range(local_size)):
            common["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        master = {"MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port),
                  "WORLD_SIZE": str(size), "LOCAL_SIZE": str(local_size)}
        script = ctx.once("script_argv", lambda: tuple(script_argv(ctx)))
        app = {"OMPI_COMMAND": posixpath.basename(script[0]), "OMPI_ARGV": " ".join(script[1:]),
               "OMPI_APP_CTX_NUM_PROCS": str(size), "OMPI_NUM_APP_CTX": "1", "OMPI_FIRST_RANKS": "0"}
        out = []
        for local in range(local_size):
            rank = base + local
            env = dict(common)
            if self.name in ("mpich", "impi"):
                env.update(master)
                if self.name == "impi":
                    env["I_MPI_PIN"] = "0"
            env.update(self._tool_env(host, rank, local, size, local_size))
            if self.name == "openmpi":  # the app context: one, the script's command line
                env.update(app)
            if self.name in ("openmpi", "mvapich"):  # mpi_discovery
                env.update(discovered_env(ctx, rank, local))
            else:  # launcher_helper.py (mpich) or -env (impi)
                env.update({"RANK": str(rank), "LOCAL_RANK": str(local)})
            out.append(RankLaunch(global_rank=rank, local_rank=local, slot=slots[local], argv=script, env=env))
        return out

    def _tool_env(self, host: str, rank: int, local: int, size: int, local_size: int) -> dict[str, str]:
        if self.name == "openmpi":
            return {"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
                    "OMPI_COMM_WORLD_NODE_RANK": str(local), "OMPI_UNIVERSE_SIZE": str(size)}
        env = {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(local),
               "MPI_LOCALNRANKS": str(local_size)}
        if self.name == "mpich":
            env["MPIR_CVAR_CH3_INTERFACE_HOSTNAME"] = host
        if self.name == "mvapich":
            env.update({"MV2_COMM_WORLD_RANK": str(rank), "MV2_COMM_WORLD_SIZE": str(size),
                        "MV2_COMM_WORLD_LOCAL_RANK": str(local), "MV2_COMM_WORLD_LOCAL_SIZE": str(local_size)})
        return env

    def env_defaults(self, ctx: LaunchContext, node_rank: int) -> dict[str, str]:
        """launch.py's (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` where the node lacks it) for one node and
        for mpich (launcher_helper.py imports deepspeed, whose ``__init__`` setdefaults it before it
        starts the script); nothing for the others (the script's own import sets it, after start)."""
        if not self._multi(ctx) or self.name == "mpich":
            return PDSH.env_defaults(ctx, node_rank)
        return {}

    def agent_store(self, ctx: LaunchContext, node_rank: int) -> tuple[str, int] | None:
        """None: rank 0 creates the c10d store at MASTER_ADDR:MASTER_PORT."""
        return None

    # ---------------------------------------------------------------- the real command

    def real_commands(self, ctx: LaunchContext) -> list[RealCommand]:
        """Return the command DeepSpeed's runner would run on the controller (``where=None``): its
        ``get_cmd`` for the same pool and arguments, with the fixes of the module docstring. One
        node: ``deepspeed.launcher.launch`` run locally (as :data:`~.deepspeed.PDSH`).

        Raises:
            LaunchError: as :meth:`ranks`.
        """
        self._check(ctx)
        if not self._multi(ctx):
            return PDSH.real_commands(ctx)
        return [RealCommand(where=None, argv=tuple(self._build(ctx, None)), env=_runner_env(ctx))]

    def native_command(self, ctx: LaunchContext, log_dir: str) -> tuple[tuple[str, ...], RealCommand]:
        """``launch_mode: native``: the tool names to look for and the command node 0's agent runs.

        The real command (:meth:`real_commands`) with every rank's program prefixed by orch's
        per-rank program (``python -u {SHIM_TOKEN} --dir <log_dir> --flavour <f> --``; mpich:
        ``--helper`` in place of DeepSpeed's launcher_helper.py, which exits 0 whatever the script
        did), so that each node's agent adopts the ranks the tool starts there. Its first word is
        replaced by the first of the returned tool names found on node 0's PATH (``NATIVE_TOOLS``).

        Raises:
            LaunchError: one node (DeepSpeed's runner does not use the tool then), or as :meth:`ranks`.
        """
        self._check(ctx)
        if not self._multi(ctx):
            raise LaunchError(f"launch_mode native: with one node DeepSpeed's runner does not use {self.name} "
                              "(it runs deepspeed.launcher.launch); use launch_mode: emulated")
        shim = [ctx.python, "-u", SHIM_TOKEN, "--dir", log_dir,
                "--flavour", "openmpi" if self.name == "openmpi" else "hydra"]
        shim += ["--helper", "--"] if self.name == "mpich" else ["--"]
        argv = self._build(ctx, shim + script_argv(ctx))
        return NATIVE_TOOLS[self.name], RealCommand(where=ctx.hosts[0], argv=tuple(argv), env=_runner_env(ctx))

    def _build(self, ctx: LaunchContext, program: list[str] | None) -> list[str]:
        """The tool's command line running ``program`` for every rank (None: DeepSpeed's own)."""
        if self.name == "mpich":
            if program is None:
                helper = posixpath.join(ctx.deepspeed_dir or "<deepspeed>", "launcher", "launcher_helper.py")
                flags = ["--module"] if ctx.module else ["--no_python"] if ctx.no_python else []
                program = [ctx.python, "-u", helper, "--launcher", "mpich", *flags, ctx.entrypoint, *ctx.args]
            return self._mpich(ctx, program)
        build = {"openmpi": self._openmpi, "impi": self._impi, "mvapich": self._mvapich}[self.name]
        return build(ctx, program or script_argv(ctx))

    def _openmpi(self, ctx: LaunchContext, program: list[str]) -> list[str]:
        user = list(ctx.launcher_args)
        mca = {user[i + 1] for i in range(len(user) - 1) if user[i] in ("-mca", "--mca")}
        if ctx.hostfile and ctx.hostfile_is_pool:
            where = ["-hostfile", ctx.hostfile]
        else:
            where = ["--host", ",".join(f"{h}:{len(s)}" for h, s in ctx.world)]
        cmd = ["mpirun", "-n", str(ctx.world_size), *where]
        if "btl" not in mca:
            cmd += ["--mca", "btl", "^openib"]
        if not mca & {"btl_tcp_if_include", "btl_tcp_if_exclude"}:
            cmd += ["--mca", "btl_tcp_if_include", "eth0"]
        cmd += user
        for k, v in self.exports(ctx).items():
            cmd += ["-x", f"{k}={v}"]
        return cmd + program

    def _hydra_master(self, ctx: LaunchContext) -> list[str]:
        per_node = len(ctx.world[0][1])
        out: list[str] = []
        for k, v in zip(_HYDRA_MASTER_VARS, (ctx.master_addr, ctx.master_port, ctx.world_size, per_node)):
            out += ["-genv", k, str(v)]
        return out

    def _mpich(self, ctx: LaunchContext, program: list[str]) -> list[str]:
        per_node = len(ctx.world[0][1])
        cmd = ["mpirun", "-n", str(ctx.world_size), "-ppn", str(per_node), *ctx.launcher_args]
        for k, v in self.exports(ctx).items():
            cmd += ["-genv", f"{k}={v}"]
        return cmd + self._hydra_master(ctx) + ["-hosts", ",".join(ctx.hosts)] + program

    def _impi(self, ctx: LaunchContext, program: list[str]) -> list[str]:
        per_node = len(ctx.world[0][1])
        cmd = ["mpirun", "-ppn", str(per_node), *ctx.launcher_args]
        for k, v in self.exports(ctx).items():
            cmd += ["-genv", k, v]
        cmd += self._hydra_master(ctx) + ["-genv", "I_MPI_PIN", "0", "-hosts", ",".join(ctx.hosts)]
        for rank in range(ctx.world_size):
            if rank:
                cmd.append(":")
            cmd += ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node), *program]
        return cmd

    def _mvapich(self, ctx: LaunchContext, program: list[str]) -> list[str]:
        per_node = len(ctx.world[0][1])
        cmd = ["mpirun", "-np", str(ctx.world_size), "-ppn", str(per_node), "-hosts", ",".join(ctx.hosts),
               *ctx.launcher_args]
        for k, v in self.exports(ctx).items():
            cmd += ["-env", f"{k}={v}"]
        return cmd + program

    # ---------------------------------------------------------------- warnings

    def warnings(self, ctx: LaunchContext) -> list[str]:
        """Where DeepSpeed's runner would have done differently than orch (module docstring)."""
        if not self._multi(ctx):
            return [f"one node: DeepSpeed's runner does not use {self.name} for a single node (runner.py main() "
                    "runs deepspeed.launcher.launch locally); orch does the same"]
        out = []
        runner = _RUNNER[self.name]
        filters = [n for n in ("include", "exclude") if getattr(ctx, n)]
        filters += [n for n in ("num_nodes", "num_gpus") if getattr(ctx, n) != -1]
        if filters:
            out.append(f"DeepSpeed's {runner} refuses {'/'.join(filters)} ('does not support worker "
                       "include/exclusion'); orch runs the filtered pool")
        for key, value in self.exports(ctx).items():
            if render_pdsh_export(value) != value:
                out.append(f"exported {key}={value!r} would reach the ranks as {render_pdsh_export(value)!r} under "
                           f"DeepSpeed's {runner} (add_export quotes it and no shell strips the quotes); orch "
                           "passes it exactly")
        for host, slots in ctx.world:
            if tuple(slots) != tuple(range(len(slots))):
                out.append(f"{host}: slots {list(slots)} are not 0..{len(slots) - 1}; {_TOOL[self.name]} cannot pin "
                           f"ranks to devices, so orch gives that node's ranks CUDA_VISIBLE_DEVICES="
                           f"{','.join(map(str, slots))} (slots; mapped to the node's own CUDA_VISIBLE_DEVICES, if set)")
        out += env_from_args(ctx.launcher_args, self.family)[1]
        if self.name == "mvapich":
            out.append("DeepSpeed's MVAPICHRunner writes the hosts to the shared /tmp/deepspeed_mvapich_hostfile "
                       "(--hostfile), which concurrent jobs overwrite; orch names them with -hosts")
        if self.name == "mpich" and (ctx.module or ctx.no_python):
            out.append("DeepSpeed's MPICHRunner would fail with module/no_python (it puts -m before "
                       "launcher_helper.py's path, or runs the helper without python); orch runs the helper with "
                       "python and passes --module/--no_python to it")
        return out


#: ``--launcher openmpi``: Open MPI's ``mpirun``.
OPENMPI = MPILauncher("openmpi")
#: ``--launcher mpich``: MPICH's Hydra ``mpirun`` with DeepSpeed's launcher_helper.py.
MPICH = MPILauncher("mpich")
#: ``--launcher impi``: Intel MPI's ``mpirun``, one argument set per rank.
IMPI = MPILauncher("impi")
#: ``--launcher mvapich``: MVAPICH2-GDR's ``mpirun``.
MVAPICH = MPILauncher("mvapich")
