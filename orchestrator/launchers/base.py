"""Types shared by every launcher: what a launcher is told, and what it answers.

A launcher is a set of *pure* functions (no I/O, no ``os.environ``) from a
:class:`LaunchContext` (the filtered resource pool plus how to run the script) to

* the argv and environment of every rank on a node (:class:`RankLaunch`), exactly as
  that launcher's real tool would give them, and
* the command lines the real tool would have run (:class:`RealCommand`), so ``orch plan``
  can show them beside ours.

The agent lays each rank's ``env`` over its node's own environment (the environment
the agent itself was started with), which is what a per-node launcher such as
``deepspeed.launcher.launch`` or ``torchrun`` does with ``os.environ.copy()``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Hashable, Mapping, Protocol, TypeVar

__all__ = ["LaunchContext", "RankLaunch", "NodeRanks", "RealCommand", "Launcher", "check_context", "script_argv",
           "discovered_env", "SHIM_TOKEN"]

#: In a native command (``launch_mode: native``), the word the node's agent replaces with the path
#: of its per-rank program (``agents/native_rank.py``), which the real tool starts for every rank.
SHIM_TOKEN = "{orch-native-rank}"

_T = TypeVar("_T")

#: id(context) -> (a weak reference to it, what was derived from it): kept beside the context, not in its
#: ``__dict__`` (which callers copy into a new context's fields), and dropped when the context dies.
_DERIVED: dict[int, tuple[weakref.ref, dict[Any, Any]]] = {}


def _derived(ctx: "LaunchContext") -> dict[Any, Any]:
    """The memo of ``ctx`` (:meth:`LaunchContext.once`); a race between threads only computes a value twice."""
    key = id(ctx)
    entry = _DERIVED.get(key)
    if entry is None or entry[0]() is not ctx:
        entry = (weakref.ref(ctx, lambda _, key=key: _DERIVED.pop(key, None)), {})
        _DERIVED[key] = entry
    return entry[1]


@dataclass(frozen=True)
class LaunchContext:
    """Everything a launcher needs to place ranks; built by ``orchestrator.planning.plan``.

    Attributes:
        world: the filtered resource pool in node-rank order, as ``((host, (slot, ...)), ...)``;
            the same mapping DeepSpeed encodes as ``--world_info``.
        master_addr: address of node rank 0 that every rank rendezvouses at.
        master_port: TCP port on ``master_addr`` (1..65535).
        python: the interpreter ranks run under on every node (absolute path or a name on PATH).
        entrypoint: the training script path (or module name when ``module``), as given.
        args: the script's own arguments, in order.
        workdir: absolute working directory of every rank.
        module: run ``python -m entrypoint`` (DeepSpeed's ``--module``).
        no_python: run the entrypoint directly, without the interpreter (``--no_python``).
        no_local_rank: do not pass ``--local_rank=N`` to the script (``--no_local_rank``).
        exports: variables exported to every rank on every node (the spec's ``env`` and the
            ``.deepspeed_env`` file), in order; values are passed byte for byte.
        run_id: the job's id (torchrun's ``--rdzv_id`` / ``TORCHELASTIC_RUN_ID``).
        restart_count: how many attempts preceded this one (``TORCHELASTIC_RESTART_COUNT``).
        max_restarts: torchrun's ``--max_restarts`` (``TORCHELASTIC_MAX_RESTARTS``).
        hostfile: path of the hostfile, used only to render the real tool's command.
        include: the include filter string as the user wrote it ("" if none).
        exclude: the exclude filter string as the user wrote it ("" if none).
        num_nodes: DeepSpeed's ``--num_nodes`` (-1 if unset).
        num_gpus: DeepSpeed's ``--num_gpus`` (-1 if unset).
        ssh_port: ssh port for pdsh's real command, or None.
        pdsh_ssh_args_append: ``PDSH_SSH_ARGS_APPEND`` in the runner's environment (pdsh adds it to
            every ssh command line), or None; DeepSpeed appends ``-p <ssh_port>`` to it.
        launcher_args: the launcher's own arguments (DeepSpeed's ``--launcher_args``, split), in
            the real tool's command; the MPI launchers refuse those that place ranks.
        hostfile_is_pool: the hostfile as written is exactly the pool (no filter, no excluded host),
            so a real tool may be handed the file itself (Open MPI's ``-hostfile``).
        accelerator: the nodes' DeepSpeed accelerator (``cuda``, ``cpu``, ...), for what a runner
            exports only on some (MVAPICH's ``MV2_USE_CUDA``).
        deepspeed_dir: the directory of the ``deepspeed`` package on the nodes ("" if unknown), for
            the path of ``launcher/launcher_helper.py`` in MPICH's command.
        force_multi: DeepSpeed's ``--force_multi``: take the runner's multi-node path (the
            launcher's real tool, its exports) even for one node.
        bind_cores: the spec's ``bind_cores`` (``off``, ``auto``, or slot -> CPU list); ``auto`` is
            DeepSpeed's ``--bind_cores_to_rank`` in the real tool's command where its runner passes it.
    """

    world: tuple[tuple[str, tuple[int, ...]], ...]
    master_addr: str
    master_port: int
    python: str
    entrypoint: str
    args: tuple[str, ...] = ()
    workdir: str = "."
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    exports: Mapping[str, str] = field(default_factory=dict)
    run_id: str = "none"
    restart_count: int = 0
    max_restarts: int = 0
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    ssh_port: int | None = None
    launcher_args: tuple[str, ...] = ()
    pdsh_ssh_args_append: str | None = None
    hostfile_is_pool: bool = False
    accelerator: str = "cuda"
    deepspeed_dir: str = ""
    force_multi: bool = False
    bind_cores: Any = "off"

    @property
    def multi_node(self) -> bool:
        """DeepSpeed's runner takes its multi-node path (pdsh, mpirun, srun) rather than running
        ``launch.py`` here: runner.py ``main()``, ``multi_node_exec = (args.force_multi or
        len(active_resources) > 1) and not args.no_ssh``."""
        return self.force_multi or len(self.world) > 1

    # What follows is derived from ``world`` once per context and kept beside it (the context is frozen,
    # so it cannot go stale): a launcher asks for it once per node, and recomputing it over every node
    # for each node made planning quadratic in nodes (5.8 s for 4,096 x 8; issue 18).

    @property
    def world_size(self) -> int:
        """Total number of ranks across all nodes."""
        return self.once("world_size", lambda: sum(len(slots) for _, slots in self.world))

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in node-rank order."""
        return self.once("hosts", lambda: tuple(host for host, _ in self.world))

    @property
    def rank_offsets(self) -> tuple[int, ...]:
        """The global rank of each node's first rank, in node-rank order: ``(0, len(slots of node 0), ...)``
        (launch.py numbers ranks node by node, slot by slot)."""
        return self.once("rank_offsets",
                         lambda: (0, *accumulate(len(slots) for _, slots in self.world))[:len(self.world)])

    def once(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()``, run once per context and ``key`` and then kept while the context lives: for what a
        launcher derives from the whole pool (a check, Slurm's host list) but needs for every node. An
        exception is not kept (the next call computes again)."""
        memo = _derived(self)
        if key not in memo:
            memo[key] = compute()
        return memo[key]


@dataclass(frozen=True)
class RankLaunch:
    """How one rank is started on its node.

    Attributes:
        global_rank: the rank in the whole job (0..world_size-1).
        local_rank: the rank on its node as the launcher reports it (``LOCAL_RANK``).
        slot: the hostfile slot (accelerator index) this rank uses.
        argv: the full command line, starting with the interpreter (unless no_python).
        env: variables this launcher sets for the rank, laid over the node's environment.
    """

    global_rank: int
    local_rank: int
    slot: int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    def __init__(self, global_rank: int, local_rank: int, slot: int, argv: tuple[str, ...], env: Mapping[str, str]):
        # What the dataclass would write, in one step: its frozen __init__ sets each field through
        # object.__setattr__, ~2x slower; a plan of 4,096 x 8 makes 32,768 of these (the dataclass keeps this one)
        self.__dict__.update(global_rank=global_rank, local_rank=local_rank, slot=slot, argv=argv, env=env)


@dataclass(frozen=True)
class NodeRanks:
    """A node's ranks with their variables in two parts: what every rank of the node shares, and each rank's own.
    Rank ``i``'s environment is ``{**common, **ranks[i][4]}`` (:meth:`launches`); a planner that lays more
    variables over it (``orchestrator.planning``) makes the shared part once per node instead of once per rank.

    Attributes:
        common: the variables every rank of the node gets, in order.
        names: the names every rank's ``own`` variables have, in order (and no other).
        ranks: ``(global_rank, local_rank, slot, argv, own)`` of each rank in spawn order (as
            :class:`RankLaunch`), ``own`` its own variables (``names``), laid over ``common``.
    """

    common: Mapping[str, str]
    names: tuple[str, ...]
    ranks: list[tuple[int, int, int, tuple[str, ...], dict[str, str]]]

    def launches(self) -> list[RankLaunch]:
        """The ranks as :class:`RankLaunch`, each with its whole ``env`` (a new dict each)."""
        common = self.common
        return [RankLaunch(g, local, slot, argv, {**common, **own}) for g, local, slot, argv, own in self.ranks]


@dataclass(frozen=True)
class RealCommand:
    """A command the real tool would run, for display and golden tests.

    Attributes:
        where: the host it runs on, or ``None`` for "the machine the user types on".
        argv: the command line, one element per argument.
        env: variables the real tool sets in that command's own environment (e.g.
            ``PDSH_RCMD_TYPE``), not the ranks'.
    """

    where: str | None
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


class Launcher(Protocol):
    """The interface every launcher module's launcher object satisfies."""

    name: str

    def ranks(self, ctx: LaunchContext, node_rank: int) -> list[RankLaunch]:
        """Return the ranks of node ``node_rank`` in local order, with argv and env."""
        ...

    def real_commands(self, ctx: LaunchContext) -> list[RealCommand]:
        """Return the command(s) the real tool would run for this job."""
        ...

    def env_defaults(self, ctx: LaunchContext, node_rank: int) -> dict[str, str]:
        """Variables the real tool sets on a node's ranks only where the node's environment lacks them."""
        ...

    def warnings(self, ctx: LaunchContext) -> list[str]:
        """Where the real tool would have passed something differently than orch does."""
        ...

    def agent_store(self, ctx: LaunchContext, node_rank: int) -> tuple[str, int] | None:
        """Return ``(addr, port)`` of a c10d TCPStore the node's agent must host, or None.

        torchrun's static rendezvous hosts the store on node 0's agent and its workers
        join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``); DeepSpeed's launcher
        hosts nothing (rank 0 creates the store).
        """
        ...


def check_context(launcher: str, ctx: LaunchContext, tool: str, family: str | None = None) -> None:
    """Checks every launcher makes of a context before placing ranks.

    Args:
        launcher: the launcher's name, for messages.
        ctx: the context.
        tool: the real tool whose rule forbids ``no_python`` with ``module`` (for messages).
        family: how the real tool reads ``ctx.launcher_args`` (:data:`.args.PLACING`), to refuse those
            that place ranks; None: not checked.

    Raises:
        LaunchError: an empty pool, a host listed twice or without slots, ``no_python`` together
            with ``module``, or ``launcher_args`` that place ranks.
    """
    problem = ctx.once(("check_context", launcher, tool, family), lambda: _context_problem(launcher, ctx, tool, family))
    if problem:
        from ..errors import LaunchError
        raise LaunchError(problem)


def _context_problem(launcher: str, ctx: LaunchContext, tool: str, family: str | None) -> str | None:
    """What :func:`check_context` refuses in ``ctx``, as its message, or None."""
    from .args import placing
    placed = placing(ctx.launcher_args, family) if family else []
    if placed:
        return (f"launcher_args {' '.join(placed)}: these place ranks, which the hostfile and the "
                f"include/exclude/num_nodes/num_gpus filters decide for {launcher}; remove them and "
                "filter the pool instead")
    if not ctx.world:
        return f"{launcher}: the resource pool is empty"
    hosts = ctx.hosts
    if len(set(hosts)) != len(hosts):
        return f"{launcher}: a host appears twice in the pool {list(hosts)}"
    for host, slots in ctx.world:
        if not slots:
            return f"{launcher}: host {host!r} has no slots"
    if ctx.no_python and ctx.module:
        return f"{launcher}: no_python and module cannot both be set ({tool})"
    return None


def script_argv(ctx: LaunchContext) -> list[str]:
    """The rank's program as the MPI runners and srun start it: ``python -u [-m] <entrypoint> <args>``,
    or ``<entrypoint> <args>`` with ``no_python`` (no ``--local_rank``: none of them passes one)."""
    python = [] if ctx.no_python else [ctx.python, "-u"] + (["-m"] if ctx.module else [])
    return python + [ctx.entrypoint, *ctx.args]


def discovered_env(ctx: LaunchContext, rank: int, local_rank: int) -> dict[str, str]:
    """What DeepSpeed's ``mpi_discovery`` (``deepspeed/comm/comm.py``) would set in a rank started by an
    MPI tool or srun: RANK, WORLD_SIZE, LOCAL_RANK, and the plan's MASTER_ADDR/MASTER_PORT."""
    return {"RANK": str(rank), "WORLD_SIZE": str(ctx.world_size), "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port)}
