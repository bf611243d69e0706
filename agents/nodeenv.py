"""The node's environment, as the ranks' environment is laid over it.

The agent's own environment, less its markers (``ORCH_AGENT_*``), and, when the agent is an srun
step of the slurm provisioner (``ORCH_AGENT_SLURM_STEP=1``), less what srun set about that step:
the ranks are not task 0 of a one-task step.
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["SLURM_STEP_VARS", "node_env", "node_accelerator", "rank_env", "read_env_files"]


#: What an srun step sets about itself (the slurm provisioner's agent step), which the ranks must not
#: inherit: they are not that step's task 0 of 1. The allocation's SLURM_JOB_* and SLURM_NODELIST stay.
SLURM_STEP_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES",
                   "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_STEPID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST",
                   "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                   "SLURM_NTASKS_PER_NODE", "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT",
                   "SLURM_LAUNCH_NODE_IPADDR", "SLURM_DISTRIBUTION", "SLURM_TOPOLOGY_ADDR",
                   "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_UMASK", "SLURM_PRIO_PROCESS", "SLURM_CPU_BIND",
                   "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE",
                   "SLURM_JOB_NAME", "SLURM_UNBUFFEREDIO", "SLURM_EXPORT_ENV")


def node_env(environ: "os._Environ[str] | Mapping[str, str]") -> dict[str, str]:
    """The node's environment the ranks' env is laid over: the agent's, less its own markers
    (``ORCH_AGENT_*``) and, when the agent is an srun step (``ORCH_AGENT_SLURM_STEP=1``, the slurm
    provisioner), less what srun set about that step (:data:`SLURM_STEP_VARS`)."""
    step = environ.get("ORCH_AGENT_SLURM_STEP") == "1"
    return {k: v for k, v in environ.items()
            if not k.startswith("ORCH_AGENT_") and not (step and k in SLURM_STEP_VARS)}


def node_accelerator(env: Mapping[str, str]) -> str:
    """The DeepSpeed accelerator a rank with environment ``env`` gets on this node, without importing DeepSpeed
    or torch: ``DS_ACCELERATOR`` when set (DeepSpeed's ``real_accelerator.get_accelerator`` takes it first),
    else ``cuda`` when the NVIDIA driver's control device ``/dev/nvidiactl`` exists, else ``cpu``.

    DeepSpeed's own detection goes on to try importing each vendor's extension (``torch_npu``,
    ``intel_extension_for_pytorch``...); a node with such an accelerator must set ``DS_ACCELERATOR``
    for orch to export that accelerator's variables to it (``planning.node_layers``)."""
    name = env.get("DS_ACCELERATOR")
    if name:
        return name
    return "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"


def read_env_files(files: dict[str, str], workdir: str, host: str) -> dict[str, str]:
    """The spec's ``env_from_file`` read here: each file's text, less one trailing newline (``~`` and paths
    relative to ``workdir`` taken on this node).

    Raises:
        ValueError: a file cannot be read (naming the variable, the path and why; never its content).
    """
    out = {}
    for name, path in files.items():
        full = os.path.join(workdir, os.path.expanduser(path))
        try:
            with open(full, encoding="utf-8") as f:
                value = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as err:
            why = getattr(err, "strerror", None) or ("not UTF-8 text" if isinstance(err, UnicodeDecodeError) else err)
            raise ValueError(f"env_from_file {name}: cannot read {full} on {host} ({why})") from None
        out[name] = value[:-1] if value.endswith("\n") else value
    return out


def rank_env(base_env: dict[str, str], node: dict, rank: dict) -> dict[str, str]:
    """A rank's environment: the node's; where it lacks them, the variables exported for the node's accelerator
    (``node["accelerator_env"]``, :func:`node_accelerator`) and the launcher's defaults; then the rank's own; and
    the node plan's ``path_prepend`` (the ranks' Python's directory) first on ``PATH`` unless already on it.
    A DeepSpeed job's rank (``ORCH_DEEPSPEED_CONFIG`` set) whose environment sets no ``TORCH_EXTENSIONS_DIR``
    gets its Python environment's own (:func:`agents.opbuild.default_extensions_dir`)."""
    env = dict(base_env)
    layers = node.get("accelerator_env")
    if layers:  # the controller's variables DeepSpeed's runner exports for this node's accelerator: the node's win
        for key, value in layers.get(node_accelerator({**base_env, **(rank.get("env") or {})}), {}).items():
            env.setdefault(key, value)
    for key, value in (node.get("env_defaults") or {}).items():
        env.setdefault(key, value)  # what the real launcher sets only where unset
    env.update(rank.get("env") or {})
    first = node.get("path_prepend")
    if first:
        path = env.get("PATH", os.defpath)
        if first not in path.split(os.pathsep):
            env["PATH"] = f"{first}{os.pathsep}{path}" if path else first
    if "ORCH_DEEPSPEED_CONFIG" in env and not env.get("TORCH_EXTENSIONS_DIR"):
        from .opbuild import default_extensions_dir, rank_python  # here: orch plan's preview does without (hashlib)
        python = rank_python(rank.get("argv") or [], env)  # a DeepSpeed job's ops: its environment's own cache
        if python:
            env["TORCH_EXTENSIONS_DIR"] = default_extensions_dir(python, env)
    return env
