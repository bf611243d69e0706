"""JobPlan: which ranks run where, with what environment and command line. Pure: no I/O.

``make_plan(spec, pool, inputs)`` turns a validated spec and a filtered resource pool
into a :class:`JobPlan`: nodes in node-rank order (the pool's order, which is the
hostfile's, as in ``deepspeed.launcher.runner``), every rank's global and local rank,
its slot, argv and environment, the master address and port, and the command lines the
real launcher would have run. Everything that needs I/O (reading files, picking a free
port, the controller's environment) is passed in through :class:`PlanInputs`, so the
planner can be tested exhaustively; it plans 4,096 nodes x 8 slots in 0.16-0.31 s by launcher (median, this
machine: `python -m bench --only plan_scale`, docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..errors import LaunchError, PlanError
from ..launchers import get_launcher
from ..launchers.base import SHIM_TOKEN, LaunchContext, RealCommand
from ..launchers.deepspeed import pdsh_exports
from ..spec import JobSpec
from .node_layers import accelerator_layers, node_env_layer, unmatched_patterns, with_node_env
from .pool import ResourcePool

#: Launchers whose real command is built by DeepSpeed's runner.py multi-node path (which exports
#: PYTHON*, MLFLOW*, MV2*, UCX*, the accelerator's prefixes and ``.deepspeed_env`` to every node).
DEEPSPEED_RUNNERS = ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")

__all__ = ["PlanInputs", "RankPlan", "NodePlan", "JobPlan", "make_plan", "orch_env"]


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs besides the spec and the pool; gathered by the caller.

    Attributes:
        job_id: the job's id.
        attempt: 1-based attempt number.
        master_port: the port chosen for this attempt (the spec's, or a free one for 'auto').
        run_dir: this attempt's directory (logs, resolved config); absolute.
        checkpoint_dir: where checkpoints are saved and loaded; absolute.
        python: interpreter the ranks run under (the spec's ``python`` or the controller's).
        default_master_addr: master address when the spec sets none (the provisioner's
            address of node 0; ``127.0.0.1`` for local agents).
        resume_tag: checkpoint tag the attempt resumes from, or None.
        resume_universal_from: when ``resume_tag`` is a universal checkpoint orch converted (the
            world size changed), the tag it was converted from; else None. The attempt's DeepSpeed
            config then gets ``"checkpoint": {"load_universal": true}`` and every rank
            ``ORCH_RESUME_UNIVERSAL=1``.
        controller_env: the controller's environment (DeepSpeed's pdsh runner exports
            some of its variables to every node).
        controller_cwd: the runner's working directory, which DeepSpeed's pdsh runner puts
            first on the exported PYTHONPATH (orch: the spec's workdir, where the runner's
            ``cd`` takes the ranks).
        deepspeed_env_lines: lines of the ``.deepspeed_env`` files, exported under pdsh.
        deepspeed_config: the DeepSpeed config, resolved.
        accelerator_exports: the accelerator's ``export_envs()`` prefixes (``("NCCL",)`` for
            CUDA, none for CPU), exported under pdsh.
        accelerate_env: what ``accelerate launch`` adds to every rank's environment (``ACCELERATE_*``,
            ``PYTHONPATH``; ``orchestrator.spec.accelerate``), laid over the launcher's variables;
            empty for a job without an Accelerate config.
        accelerate_env_defaults: variables ``accelerate launch`` passes on where a node lacks them.
        config_warnings: notes on the Accelerate and DeepSpeed configs (shown with the plan's warnings).
        resume_args: added to the entrypoint's arguments when ``resume_tag`` is set (the spec's
            ``resume.args``, placeholders filled), e.g. ``("--resume_from_checkpoint", "/ckpt/checkpoint-20")``.
        resume_env: variables every rank gets when ``resume_tag`` is set (``ORCH_RESUME_CHECKPOINT``,
            the spec's ``resume.env``).
        checkpoint_watch: what every agent watches for new checkpoint files (``agents.manifest``):
            ``{"dir", "tag_pattern", "hash", "sample_above", "interval_s"}``; None: nothing.
        resume_dir: where the job's checkpoints are looked for (the spec's ``resume.dir``, ...); None:
            ``checkpoint_dir``.
        hostfile_is_pool: the spec's hostfile as written is exactly the pool (no filter, no
            excluded host): Open MPI's real command can be given the file itself.
        accelerator: the nodes' DeepSpeed accelerator name (``DS_ACCELERATOR``, else cuda/cpu).
        deepspeed_dir: the installed ``deepspeed`` package's directory ("" if none), for the path
            of DeepSpeed's ``launcher_helper.py`` in MPICH's real command.
        node_addresses: host -> the address the controller reaches it at (the provisioner's), where each
            node's metrics exporter listens unless the spec's ``metrics_addr`` names one.
    """

    job_id: str
    master_port: int
    run_dir: str
    checkpoint_dir: str
    python: str
    attempt: int = 1
    default_master_addr: str = "127.0.0.1"
    resume_tag: str | None = None
    resume_universal_from: str | None = None
    controller_env: Mapping[str, str] = field(default_factory=dict)
    controller_cwd: str = "/"
    deepspeed_env_lines: tuple[str, ...] = ()
    deepspeed_config: Mapping[str, Any] = field(default_factory=dict)
    accelerator_exports: tuple[str, ...] = ()
    accelerate_env: Mapping[str, str] = field(default_factory=dict)
    accelerate_env_defaults: Mapping[str, str] = field(default_factory=dict)
    config_warnings: tuple[str, ...] = ()
    resume_args: tuple[str, ...] = ()
    resume_env: Mapping[str, str] = field(default_factory=dict)
    checkpoint_watch: Mapping[str, Any] | None = None
    resume_dir: str | None = None
    hostfile_is_pool: bool = False
    accelerator: str = "cuda"
    deepspeed_dir: str = ""
    node_addresses: Mapping[str, str] = field(default_factory=dict)

    @property
    def attempt_id(self) -> str:
        """``<job id>.<attempt>``: the marker every process of the attempt carries."""
        return f"{self.job_id}.{self.attempt}"

    @property
    def deepspeed_config_path(self) -> str:
        """Where the controller writes the resolved DeepSpeed config for the ranks."""
        return os.path.join(self.run_dir, "ds_config.json")


@dataclass(frozen=True)
class RankPlan:
    """One rank: where it runs and how it starts.

    Attributes:
        global_rank: 0..world_size-1.
        local_rank: ``LOCAL_RANK`` as the launcher gives it.
        slot: the hostfile slot (accelerator index) it uses.
        argv: its command line.
        env: variables laid over the node's environment (launcher's and orch's).
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

    def to_dict(self, shared: bool = False) -> dict:
        """JSON-able form. ``shared``: ``argv`` is the plan's own tuple and ``env`` the plan's own dict (when it is
        one), not copies: the same JSON text, for a caller that encodes it at once and changes nothing in it."""
        env = self.env if shared and type(self.env) is dict else dict(self.env)
        return {"global_rank": self.global_rank, "local_rank": self.local_rank, "slot": self.slot,
                "argv": self.argv if shared else list(self.argv), "env": env}


def _shared_ranks(ranks: tuple[RankPlan, ...]) -> list[dict]:
    """``[r.to_dict(shared=True) for r in ranks]``, made in one comprehension (no method call a rank)."""
    return [{"global_rank": r.global_rank, "local_rank": r.local_rank, "slot": r.slot, "argv": r.argv,
             "env": r.env if type(r.env) is dict else dict(r.env)} for r in ranks]


@dataclass(frozen=True)
class NodePlan:
    """One node: its host, node rank, ranks, and what its agent must host.

    Attributes:
        node_rank: 0..len(nodes)-1, in the pool's order.
        host: the hostfile's host name.
        slots: the slots used on it.
        ranks: its ranks in local order.
        workdir: working directory of its ranks.
        log_dir: directory its agent writes ``rank-<global rank>.log`` files into.
        agent_store: ``{"addr", "port"}`` of a c10d store the agent hosts, or None.
        env_defaults: variables set on its ranks only where the node's environment lacks
            them (``launcher.env_defaults``), applied by the agent before ``env``.
        metrics_port: port of the agent's Prometheus exporter on its host; 0: any free
            port; None: no exporter.
        metrics_addr: the address the exporter listens on (the one the controller reaches the node
            at, or the spec's ``metrics_addr``; ``0.0.0.0``: every interface).
        env_from_file: variable -> file the agent reads it from when the ranks start (the spec's
            ``env_from_file``; the value is never in the plan).
        accelerator_env: accelerator name -> variables the agent sets on the ranks where the node's environment
            lacks them, if the node's accelerator is that one (``planning.node_layers.accelerator_layers``).
        bind_cores: the spec's ``bind_cores`` (``off``, ``auto``, or slot -> CPU list), applied by the agent.
        metrics_dir: the attempt's scratch directory on the node, ``<run_dir>/scratch`` (its agent keeps
            its metrics and report files in ``node-<n>`` there: agents/metrics.py; removed at its end:
            docs/housekeeping.md), or None.
        deepspeed_monitor_dir: where DeepSpeed's CSV monitor writes rank 0's files (on the
            node of global rank 0, when orch manages the DeepSpeed config), or None.
        path_prepend: a directory the agent puts first on every rank's ``PATH`` unless it is on it
            already: the ranks' Python's (a virtualenv's ``bin``, where DeepSpeed's JIT build finds
            ``ninja``), unless the spec's ``prepend_python_bin`` is off; or None.
        master: ``{"addr", "port", "spans_hosts"}``: the rendezvous point, and whether the job's
            nodes are on more than one machine (any provisioner but ``local``, with two nodes or
            more). The agent picks the interface of the ranks' collectives by it (``agents.network``).
        checkpoint_watch: what the agent watches for checkpoint files (:class:`PlanInputs`), with the
            attempt's ``world_size``; or None.
        native: ``launch_mode: native``: ``{"start_timeout": s, "world_size": W, "command": None |
            {"tools": [names], "argv": [...], "env": {...}, "shim_token": str}}``: the agent does not start
            its ranks, the real launcher does (node 0's agent runs ``command``, whose first word is the first
            of ``tools`` found on PATH, and ``shim_token`` in it is the agent's per-rank program),
            and every agent adopts its ranks as they start (``agents.adopted``); None: emulated.
    """

    node_rank: int
    host: str
    slots: tuple[int, ...]
    ranks: tuple[RankPlan, ...]
    workdir: str
    log_dir: str
    agent_store: Mapping[str, Any] | None = None
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    metrics_port: int | None = None
    metrics_dir: str | None = None
    deepspeed_monitor_dir: str | None = None
    master: Mapping[str, Any] | None = None
    path_prepend: str | None = None
    checkpoint_watch: Mapping[str, Any] | None = None
    native: Mapping[str, Any] | None = None
    metrics_addr: str = "0.0.0.0"
    env_from_file: Mapping[str, str] = field(default_factory=dict)
    accelerator_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    bind_cores: Any = "off"

    def to_dict(self, shared: bool = False) -> dict:
        """JSON-able form (what the agent receives in its ``start`` message); ``shared``: each rank's argv and
        environment are the plan's own, not copies (:meth:`RankPlan.to_dict`)."""
        return {"node_rank": self.node_rank, "host": self.host, "slots": list(self.slots),
                "ranks": _shared_ranks(self.ranks) if shared else [r.to_dict() for r in self.ranks],
                "workdir": self.workdir,
                "log_dir": self.log_dir, "agent_store": dict(self.agent_store) if self.agent_store else None,
                "env_defaults": dict(self.env_defaults), "metrics_port": self.metrics_port,
                "metrics_dir": self.metrics_dir, "deepspeed_monitor_dir": self.deepspeed_monitor_dir,
                "master": dict(self.master) if self.master else None, "path_prepend": self.path_prepend,
                "checkpoint_watch": dict(self.checkpoint_watch) if self.checkpoint_watch else None,
                "native": dict(self.native) if self.native else None, "metrics_addr": self.metrics_addr,
                "env_from_file": dict(self.env_from_file),
                "accelerator_env": {k: dict(v) for k, v in self.accelerator_env.items()},
                "bind_cores": dict(self.bind_cores) if isinstance(self.bind_cores, Mapping) else self.bind_cores}


@dataclass(frozen=True)
class JobPlan:
    """The whole attempt, planned.

    Attributes:
        job_id, job_name, attempt: which attempt of which job.
        launcher, provisioner: names from the spec.
        master_addr, master_port: the rendezvous point.
        world_size: number of ranks.
        nodes: in node-rank order.
        real_commands: what the real launcher would have run (for display).
        exports: variables exported to every node: the spec's ``env`` and, under pdsh,
            what DeepSpeed's runner exports; the launcher's own variables win over them.
        run_dir, checkpoint_dir: absolute paths.
        resume_tag: start checkpoint tag, or None.
        deepspeed_config: the resolved DeepSpeed config; deepspeed_config_path: its file.
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        warnings: things the user should know (from filtering and planning).
        resume_universal_from: the tag a universal ``resume_tag`` was converted from, or None.
        deepspeed_autos: for a DeepSpeed config of the spec's with "auto" values, who fills them, why,
            and the keys left "auto" (``orchestrator.spec.JobDeepSpeed.autos``); else None.
        resume_dir: where the job's checkpoints are looked for (``checkpoint_dir`` unless the spec says).
    """

    job_id: str
    job_name: str
    attempt: int
    launcher: str
    provisioner: str
    master_addr: str
    master_port: int
    world_size: int
    nodes: tuple[NodePlan, ...]
    real_commands: tuple[RealCommand, ...]
    exports: Mapping[str, str]
    run_dir: str
    checkpoint_dir: str
    resume_tag: str | None
    deepspeed_config: Mapping[str, Any]
    deepspeed_config_path: str
    grace: float
    warnings: tuple[str, ...] = ()
    resume_universal_from: str | None = None
    deepspeed_autos: Mapping[str, Any] | None = None
    resume_dir: str | None = None

    @property
    def attempt_id(self) -> str:
        """``<job id>.<attempt>``."""
        return f"{self.job_id}.{self.attempt}"

    def ranks(self) -> list[tuple[NodePlan, RankPlan]]:
        """Every (node, rank) pair in global-rank order."""
        return [(n, r) for n in self.nodes for r in n.ranks]

    def to_dict(self, shared: bool = False) -> dict:
        """JSON-able form (what the store keeps and ``orch plan --output json`` prints). ``shared``: each rank's
        argv (a tuple) and environment are the plan's own, not copies (:meth:`RankPlan.to_dict`): the same JSON
        text, made faster, for a caller that encodes it at once and changes nothing in it."""
        return {
            "job_id": self.job_id, "job_name": self.job_name, "attempt": self.attempt,
            "launcher": self.launcher, "provisioner": self.provisioner,
            "master_addr": self.master_addr, "master_port": self.master_port,
            "world_size": self.world_size, "nodes": [n.to_dict(shared) for n in self.nodes],
            "real_commands": [{"where": c.where, "argv": list(c.argv), "env": dict(c.env)}
                              for c in self.real_commands],
            "exports": dict(self.exports), "run_dir": self.run_dir, "checkpoint_dir": self.checkpoint_dir,
            "resume_tag": self.resume_tag, "resume_universal_from": self.resume_universal_from,
            "deepspeed_config": dict(self.deepspeed_config),
            "deepspeed_config_path": self.deepspeed_config_path, "grace": self.grace,
            "warnings": list(self.warnings),
            "deepspeed_autos": dict(self.deepspeed_autos) if self.deepspeed_autos is not None else None,
            "resume_dir": self.resume_dir or self.checkpoint_dir,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobPlan":
        """The plan :meth:`to_dict` wrote (the store's copy: a controller taking over a running attempt).

        Raises:
            KeyError, TypeError, ValueError: ``data`` is not such a plan.
        """
        nodes = tuple(NodePlan(**{**n, "slots": tuple(n["slots"]),
                                  "ranks": tuple(RankPlan(**{**r, "argv": tuple(r["argv"])}) for r in n["ranks"])})
                      for n in data["nodes"])
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields.update(nodes=nodes, warnings=tuple(data.get("warnings") or ()),
                      real_commands=tuple(RealCommand(c["where"], tuple(c["argv"]), c.get("env") or {})
                                          for c in data.get("real_commands") or ()))
        return cls(**fields)


def orch_env(spec: JobSpec, inputs: PlanInputs, node_rank: int, host: str) -> dict[str, str]:
    """The ``ORCH_*`` variables every rank gets (documented in docs/contract.md)."""
    env = {
        "ORCH_JOB_ID": inputs.job_id,
        "ORCH_JOB_NAME": spec.name,
        "ORCH_ATTEMPT": str(inputs.attempt),
        "ORCH_ATTEMPT_ID": inputs.attempt_id,
        "ORCH_RESTART_COUNT": str(inputs.attempt - 1),
        "TORCHELASTIC_RESTART_COUNT": str(inputs.attempt - 1),  # what torchrun tells its workers
        "ORCH_NODE": host,
        "ORCH_NODE_RANK": str(node_rank),
        "ORCH_RUN_DIR": inputs.run_dir,
        "ORCH_CHECKPOINT_DIR": inputs.checkpoint_dir,
    }
    if spec.deepspeed_config is not None or inputs.deepspeed_config:  # or built from an Accelerate config
        env["ORCH_DEEPSPEED_CONFIG"] = inputs.deepspeed_config_path
    if inputs.resume_tag:
        env["ORCH_RESUME_TAG"] = inputs.resume_tag
        env.update(inputs.resume_env)
        if inputs.resume_universal_from:
            env["ORCH_RESUME_UNIVERSAL"] = "1"
    return env


def _launcher_exports(spec: JobSpec, inputs: PlanInputs, nodes: int) -> dict[str, str]:
    """What DeepSpeed's runner exports to every node on its multi-node path (pdsh and the MPI and Slurm
    runners; nothing for one node, nossh or standard).

    The spec's own ``env`` is not among them: it is laid over them by :func:`make_plan`,
    byte for byte, whatever the launcher.
    """
    if spec.launcher not in DEEPSPEED_RUNNERS or (nodes < 2 and not spec.force_multi):  # runner.main(): only the multi-node path exports
        return {}
    exports = pdsh_exports(inputs.controller_env, inputs.controller_cwd, inputs.deepspeed_env_lines,
                           accelerator_exports=())  # the accelerator's: decided per node (node_layers)
    return {k: v for k, v in exports.items() if k not in spec.env}


def _metrics_ports(spec: JobSpec, pool: ResourcePool) -> list[int | None]:
    """Every node's exporter port, in node-rank order (unchecked: :func:`_checked_port`): ``metrics_port``
    plus the number of earlier nodes on the same machine (local agents all share this machine; other
    provisioners' hosts are their own); 0 for ``auto``; None for no exporter."""
    if spec.metrics_port is None or spec.metrics_port == "auto":
        return [None if spec.metrics_port is None else 0] * len(pool.nodes)
    seen: dict[str, int] = {}  # host -> nodes on it so far: one pass, not a count over earlier nodes per node
    ports: list[int | None] = []
    for node_rank, (host, _) in enumerate(pool.nodes):
        earlier = node_rank if spec.provisioner == "local" else seen.get(host, 0)
        seen[host] = seen.get(host, 0) + 1
        ports.append(spec.metrics_port + earlier)
    return ports


def _checked_port(spec: JobSpec, node_rank: int, port: int | None) -> int | None:
    """``port`` (:func:`_metrics_ports`) of node ``node_rank``.

    Raises:
        PlanError: it is above 65535.
    """
    if port is not None and port > 65535:
        raise PlanError(f"metrics_port {spec.metrics_port} leaves no port for node {node_rank} (it would need "
                        f"{port}); choose a metrics_port of at most {65535 - node_rank}.")
    return port


def _with_monitor(config: Mapping[str, Any], metrics_dir: str) -> tuple[dict, str | None]:
    """The DeepSpeed config with DeepSpeed's CSV monitor on (rank 0 writes one CSV per event,
    ``deepspeed.monitor.csv_monitor``), and where its files land. A config that sets
    ``csv_monitor`` itself is kept as it is (read where it writes, if enabled); no config
    (the script brings its own): nothing."""
    config = dict(config)
    if not config:
        return config, None
    user = config.get("csv_monitor")
    if user is None:
        config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(metrics_dir, "deepspeed"),
                                 "job_name": "rank0"}
        return config, os.path.join(metrics_dir, "deepspeed", "rank0")
    if isinstance(user, Mapping) and user.get("enabled") and user.get("output_path"):
        return config, os.path.join(str(user["output_path"]), str(user.get("job_name") or "DeepSpeedJobName"))
    return config, None


def _with_load_universal(config: Mapping[str, Any]) -> dict:
    """The DeepSpeed config with ``"checkpoint": {"load_universal": true}``, which makes
    ``DeepSpeedEngine.load_checkpoint`` read a universal checkpoint's ``zero/`` folder
    (``deepspeed.runtime.config``: ``checkpoint.load_universal``). No config (the script brings its
    own): nothing; the rank's ``ORCH_RESUME_UNIVERSAL=1`` still says so."""
    config = dict(config)
    if config:
        config["checkpoint"] = {**dict(config.get("checkpoint") or {}), "load_universal": True}
    return config


def _native(spec: JobSpec, launcher: Any, ctx: LaunchContext, node_rank: int, log_dir: str) -> dict | None:
    """A node's ``native`` entry (:class:`NodePlan`): node 0 runs the real launcher's command.

    Raises:
        LaunchError: the launcher has no native mode.
    """
    if spec.launch_mode != "native":
        return None
    native_command = getattr(launcher, "native_command", None)
    if native_command is None:
        raise LaunchError(f"launch_mode native: the {launcher.name} launcher has no native mode (only openmpi, "
                          "mpich, impi, mvapich and slurm have); use launch_mode: emulated")
    out: dict[str, Any] = {"start_timeout": spec.native_start_timeout, "world_size": ctx.world_size, "command": None}
    if node_rank == 0:
        tools, cmd = native_command(ctx, log_dir)
        out["command"] = {"tools": list(tools), "argv": [tools[0], *cmd.argv[1:]], "env": dict(cmd.env),
                          "shim_token": SHIM_TOKEN, "family": getattr(launcher, "family", launcher.name)}
    return out


def _rank_plans(spec: JobSpec, inputs: PlanInputs, launcher: Any, ctx: LaunchContext, node_rank: int,
                extra: Mapping[str, str]) -> tuple[RankPlan, ...]:
    """Node ``node_rank``'s ranks, each with its whole environment: the spec's ``env``, the launcher's variables,
    then Accelerate's (``inputs.accelerate_env``) and orch's (``extra``: :func:`orch_env`), each laid over those
    before it.

    A launcher with ``node_ranks`` (``orchestrator.launchers.base.NodeRanks``: what the node's ranks share, and
    each rank's own variables) has those layers merged once per node, with each rank's own names in their
    places, and each rank takes a copy with its own values laid over: the same dict, key order included, as
    merging the four layers for every rank (~4 us a rank of 36 variables; 32,768 ranks for 4,096 x 8).

    Raises:
        LaunchError: as the launcher's ``ranks``.
    """
    tail = {**inputs.accelerate_env, **extra}
    node_ranks = getattr(launcher, "node_ranks", None)
    if node_ranks is None:
        return tuple(RankPlan(r.global_rank, r.local_rank, r.slot, tuple(r.argv), {**spec.env, **r.env, **tail})
                     for r in launcher.ranks(ctx, node_rank))
    laid = node_ranks(ctx, node_rank)
    names = dict.fromkeys(laid.names)
    if not names.keys().isdisjoint(tail):  # a rank's own variable that a later layer sets: merged rank by rank
        common = laid.common
        return tuple(RankPlan(g, local, slot, tuple(argv), {**spec.env, **common, **own, **tail})
                     for g, local, slot, argv, own in laid.ranks)
    template = {**spec.env, **laid.common, **names, **tail}
    return tuple(RankPlan(g, local, slot, tuple(argv), template | own) for g, local, slot, argv, own in laid.ranks)


def _mode_warnings(spec: JobSpec, ctx: LaunchContext) -> list[str]:
    """Settings that do nothing for this job, and what native mode needs of the hosts."""
    out = []
    used_by = spec.launcher in DEEPSPEED_RUNNERS and ctx.multi_node
    if spec.launcher_args and not used_by:
        why = ("one node: DeepSpeed's runner runs deepspeed.launcher.launch locally" if spec.launcher in DEEPSPEED_RUNNERS
               else f"the {spec.launcher} launcher has no real tool to give them to")
        out.append(f"launcher_args are not used ({why})")
    if "native_start_timeout" in spec.model_fields_set and spec.launch_mode != "native":
        out.append("native_start_timeout applies only to launch_mode: native")
    if spec.launch_mode == "native" and spec.provisioner == "local":
        out.append("launch_mode native with provisioner local: the real tool reaches the hostfile's hosts itself "
                   "(ssh, or srun), so they must be real hosts it can reach")
    if spec.launch_mode == "native" and spec.launcher == "openmpi" and not any(
            "btl_tcp_if" in a for a in spec.launcher_args):
        out.append("the native mpirun keeps DeepSpeed's --mca btl_tcp_if_include eth0: on nodes without eth0 name "
                   "their interface in launcher_args (--mca btl_tcp_if_include <interface or subnet>)")
    return out


def make_plan(spec: JobSpec, pool: ResourcePool, inputs: PlanInputs) -> JobPlan:
    """Plan one attempt of ``spec`` on ``pool``.

    Args:
        spec: the validated job spec.
        pool: the filtered resource pool (``orchestrator.planning.resolve_pool``).
        inputs: everything else (see :class:`PlanInputs`).

    Returns:
        The JobPlan. Node order is the pool's; global ranks are numbered node by node,
        slot by slot, as ``deepspeed.launcher.launch`` numbers them.

    Raises:
        PlanError: the pool is empty or has a host with no slots.
        LaunchError: the spec's launcher is not supported.
    """
    collecting = gc.isenabled()
    gc.disable()  # it makes ~100k objects and no cycle: the collector's passes over them (and all older objects)
    try:          # took ~25% of planning 4,096 x 8 (60-100 ms); it counts them and runs when next due
        return _make_plan(spec, pool, inputs)
    finally:
        if collecting:
            gc.enable()


def _make_plan(spec: JobSpec, pool: ResourcePool, inputs: PlanInputs) -> JobPlan:
    """:func:`make_plan`, with the collector paused."""
    launcher = get_launcher(spec.launcher)
    if not pool.nodes:
        raise PlanError("No slots are left to run on after applying the hostfile filters.")
    empty = [host for host, slots in pool.nodes if not slots]
    if empty:
        raise PlanError(f"Host(s) {', '.join(empty)} have no slots (slots=0 in the hostfile); remove "
                        "them or exclude them, so that every node runs at least one rank.")
    args = list(spec.args)
    if spec.deepspeed_args and (spec.deepspeed_config is not None or inputs.deepspeed_config):
        args += ["--deepspeed", "--deepspeed_config", inputs.deepspeed_config_path]
    if inputs.resume_tag:
        args += inputs.resume_args
    exports = _launcher_exports(spec, inputs, len(pool.nodes))
    by_accelerator = accelerator_layers(inputs.controller_env, inputs.controller_cwd, exports, spec.env) \
        if spec.launcher in DEEPSPEED_RUNNERS and (len(pool.nodes) > 1 or spec.force_multi) else {}
    ctx = LaunchContext(
        world=pool.nodes, master_addr=spec.master_addr or inputs.default_master_addr,
        master_port=inputs.master_port, python=inputs.python, entrypoint=spec.entrypoint,
        args=tuple(args), workdir=spec.workdir, module=spec.module, no_python=spec.no_python,
        no_local_rank=spec.no_local_rank, exports=exports, run_id=inputs.job_id,
        restart_count=inputs.attempt - 1, max_restarts=spec.restart.max_restarts, hostfile=spec.hostfile, include=spec.include,
        exclude=spec.exclude, num_nodes=spec.num_nodes, num_gpus=spec.num_gpus,
        launcher_args=tuple(spec.launcher_args), hostfile_is_pool=inputs.hostfile_is_pool, ssh_port=spec.ssh.port,
        pdsh_ssh_args_append=inputs.controller_env.get("PDSH_SSH_ARGS_APPEND"),
        accelerator=inputs.accelerator, deepspeed_dir=inputs.deepspeed_dir, force_multi=spec.force_multi,
        bind_cores=spec.bind_cores)
    log_dir = os.path.join(inputs.run_dir, "logs")
    metrics_dir = os.path.join(inputs.run_dir, "scratch")  # removed when the attempt ends (docs/housekeeping.md)
    ds_config, monitor_dir = _with_monitor(inputs.deepspeed_config, metrics_dir)
    if inputs.resume_tag and inputs.resume_universal_from:
        ds_config = _with_load_universal(ds_config)
    master = {"addr": ctx.master_addr, "port": ctx.master_port,
              "spans_hosts": spec.provisioner != "local" and len(pool.nodes) > 1}
    path_prepend = os.path.dirname(inputs.python) if spec.prepend_python_bin and os.path.isabs(inputs.python) else None
    world = sum(len(slots) for _, slots in pool.nodes)
    watch = {**inputs.checkpoint_watch, "world_size": world} if inputs.checkpoint_watch else None
    here = by_accelerator.get(inputs.accelerator, {})  # the real tool exports the controller's accelerator's
    shown = replace(ctx, exports={**exports, **here, **spec.env})  # what the real tool would export
    metrics_ports = _metrics_ports(spec, pool)
    nodes = []
    for node_rank, (host, slots) in enumerate(pool.nodes):
        extra = orch_env(spec, inputs, node_rank, host)
        ranks = _rank_plans(spec, inputs, launcher, ctx, node_rank, extra)
        if spec.node_env:
            ranks = with_node_env(ranks, node_env_layer(spec.node_env, host), host, spec.env, exports,
                                  {**inputs.accelerate_env, **extra}, launcher.name)
        store = launcher.agent_store(ctx, node_rank)
        defaults = {k: v for k, v in {**inputs.accelerate_env_defaults, **launcher.env_defaults(ctx, node_rank)}.items()
                    if k not in spec.env}
        nodes.append(NodePlan(node_rank, host, tuple(slots), ranks, spec.workdir, log_dir,
                              {"addr": store[0], "port": store[1]} if store else None, defaults,
                              _checked_port(spec, node_rank, metrics_ports[node_rank]), metrics_dir,
                              monitor_dir if any(r.global_rank == 0 for r in ranks) else None, master,
                              path_prepend, watch, _native(spec, launcher, shown, node_rank, log_dir),
                              spec.metrics_addr if spec.metrics_addr != "auto" else
                              inputs.node_addresses.get(host, "0.0.0.0"), dict(spec.env_from_file), by_accelerator,
                              spec.bind_cores))
    return JobPlan(
        job_id=inputs.job_id, job_name=spec.name, attempt=inputs.attempt, launcher=launcher.name,
        provisioner=spec.provisioner, master_addr=ctx.master_addr, master_port=ctx.master_port,
        world_size=ctx.world_size, nodes=tuple(nodes), real_commands=tuple(launcher.real_commands(shown)),
        exports={**exports, **spec.env}, run_dir=inputs.run_dir, checkpoint_dir=inputs.checkpoint_dir,
        resume_tag=inputs.resume_tag, deepspeed_config=ds_config,
        deepspeed_config_path=inputs.deepspeed_config_path, grace=spec.stop_grace_seconds,
        warnings=(tuple(pool.warnings) + tuple(launcher.warnings(shown)) + tuple(_mode_warnings(spec, shown))
                  + tuple(inputs.config_warnings) + tuple(unmatched_patterns(spec.node_env, pool.hosts))),
        resume_universal_from=inputs.resume_universal_from if inputs.resume_tag else None,
        resume_dir=inputs.resume_dir or inputs.checkpoint_dir)
