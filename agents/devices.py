"""Devices a scheduler (or the user) assigned to a node before orch started: slots index into them.

When a node's own environment has ``CUDA_VISIBLE_DEVICES`` (Slurm sets it for a step with GPUs; a
user may set it), those are the devices the job may use there, in that order. orch's slots on such
a node are positions in that list, never renumbered: slot ``k`` is device ``assigned[k]``. A
launcher that sets ``CUDA_VISIBLE_DEVICES`` to slot indices (``deepspeed.launcher.launch``:
``0,1``; torchrun's ``--gpu_ids``) has them mapped (``4,5``); one that sets nothing (the MPI
launchers, srun) leaves the node's list to its ranks, whose ``LOCAL_RANK`` then indexes it, which
is the same mapping. DeepSpeed's own runner, by contrast, drops the variable whenever a hostfile is
given and numbers devices ``0..n-1`` on every node (runner.py ``main()``).
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["VAR", "assigned", "duplicate", "mapped", "describe"]

VAR = "CUDA_VISIBLE_DEVICES"


def assigned(node_env: Mapping[str, str]) -> list[str] | None:
    """The node's assigned devices (ids or UUIDs, in order), or None when the node sets none (or an
    empty value, the usual way to hide every GPU: nothing to map then)."""
    value = node_env.get(VAR)
    if value is None or not value.strip():  # unset, or empty: "no GPU here", nothing to map
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def duplicate(node_env: Mapping[str, str]) -> str | None:
    """A device the node's list names twice (two ranks would share it), or None."""
    seen: set[str] = set()
    for d in assigned(node_env) or []:
        if d in seen:
            return d
        seen.add(d)
    return None


def mapped(rank_env: Mapping[str, str], node_env: Mapping[str, str], host: str) -> str | None:
    """The rank's ``CUDA_VISIBLE_DEVICES`` with its slot indices mapped to the node's devices, or None
    when nothing is to be mapped (the node assigns none, or the plan sets none on the rank).

    Args:
        rank_env: the variables the plan sets on the rank (the launcher's ``CUDA_VISIBLE_DEVICES``, if
            any, holds slots; without one the rank inherits the node's list and nothing is mapped).
        node_env: the node's own environment (what the agent started with).
        host: the node's name, for messages.

    Raises:
        ValueError: a slot the plan uses is not among the node's assigned devices (a filter asks for a
            device the scheduler did not give), naming both.
    """
    devices = assigned(node_env)
    if devices is None or VAR not in rank_env:
        return None
    twice = duplicate(node_env)
    if twice is not None:
        raise ValueError(f"{host}: {VAR}={node_env[VAR]} (set before orch started) names device {twice} twice; "
                         "two slots would share it")
    slots = [s.strip() for s in rank_env[VAR].split(",") if s.strip()]
    try:
        return ",".join(devices[int(s)] for s in slots)
    except (ValueError, IndexError):
        raise ValueError(f"{host}: the job uses slot(s) {','.join(slots)} of this node, but {VAR}="
                         f"{node_env[VAR]} (set before orch started, by the scheduler or you) gives it "
                         f"{len(devices)} device(s): slots are positions in that list (0..{len(devices) - 1}); "
                         "use fewer slots or a filter within them") from None


def describe(node_env: Mapping[str, str], slots: list[int]) -> list[str] | None:
    """The physical device of each slot on a node with assigned devices (``"?"`` past the list), or None."""
    devices = assigned(node_env)
    if devices is None:
        return None
    return [devices[s] if 0 <= s < len(devices) else "?" for s in slots]
